// RendezvousMgr: the rendezvous of each step of one worker task, keyed by step_id.
//
// Find(step_id) creates the step's rendezvous on first use through the protocol's factory.
// Cleanup(step_id) aborts it (pending recvs fail with Cancelled naming the step) and forgets
// it; the most recent cleaned-up step ids are remembered so that a late request for one gets a
// clear FailedPrecondition instead of waiting forever in a fresh rendezvous.
//
// Peers' requests may name a step this task has not started yet (a receiver runs ahead, or
// asks for a key's next step early); FindForPeer creates it then. Such steps are bounded: at
// most `max_peer_steps` exist that only peers' requests made (ResourceExhausted beyond, naming
// TENSORVERBS_MAX_PEER_STEPS), and one this task has not taken up (Find) within
// `peer_step_expiry` is aborted with DeadlineExceeded and forgotten (not remembered as cleaned
// up, so the task can still run it) when a later peer step is made. Thread-safe; the
// factory runs under the lock, so it must only construct (take no lock, run no callback), and
// aborts run outside it.
#ifndef TENSORVERBS_RENDEZVOUS_RENDEZVOUS_MGR_H_
#define TENSORVERBS_RENDEZVOUS_RENDEZVOUS_MGR_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/common/mutex.h"
#include "src/rendezvous/remote_rendezvous.h"

namespace tensorverbs {

class RendezvousMgr {
 public:
  // Constructs a step's rendezvous; called under the manager's lock.
  using Factory = std::function<std::shared_ptr<RemoteRendezvous>(int64_t step_id)>;
  // Told of a cleaned-up step this task never made a rendezvous for (a transport may have work
  // for it anyway: grpc+verbs asks for a key's next step before its recv). Any thread.
  using StepEnded = std::function<void(int64_t step_id)>;

  explicit RendezvousMgr(Factory factory, size_t remembered_cleanups = 100000,
                         StepEnded step_ended = nullptr);
  RendezvousMgr(const RendezvousMgr&) = delete;
  RendezvousMgr& operator=(const RendezvousMgr&) = delete;
  ~RendezvousMgr();  // CleanupAll

  // Bounds on the steps that only peers' requests created (see above); the default is none.
  struct PeerStepLimits {
    size_t max_steps = SIZE_MAX;
    absl::Duration expiry = absl::InfiniteDuration();
  };

  // This task's own use of a step (its Send and Recv): FailedPrecondition if `step_id` was
  // cleaned up recently.
  absl::StatusOr<std::shared_ptr<RemoteRendezvous>> Find(int64_t step_id);
  // A peer's request for `step_id`: as Find, within the PeerStepLimits when the step is new.
  absl::StatusOr<std::shared_ptr<RemoteRendezvous>> FindForPeer(int64_t step_id);
  void SetPeerStepLimits(PeerStepLimits limits);

  void Cleanup(int64_t step_id);
  void CleanupAll();

  size_t NumActiveSteps() const;
  // Steps that only peers' requests created and this task has not taken up.
  size_t NumPeerSteps() const;

 private:
  const Factory factory_;
  const size_t remembered_cleanups_;
  const StepEnded step_ended_;
  mutable Mutex mu_;
  absl::flat_hash_map<int64_t, std::shared_ptr<RemoteRendezvous>> table_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<int64_t> cleaned_ ABSL_GUARDED_BY(mu_);
  std::deque<int64_t> cleaned_order_ ABSL_GUARDED_BY(mu_);
  PeerStepLimits peer_limits_ ABSL_GUARDED_BY(mu_);
  // Steps only peers made, with when; the deque keeps them oldest first (entries of steps taken
  // up or cleaned up since are skipped when they reach its front).
  absl::flat_hash_map<int64_t, absl::Time> peer_steps_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<int64_t, absl::Time>> peer_order_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_RENDEZVOUS_RENDEZVOUS_MGR_H_
