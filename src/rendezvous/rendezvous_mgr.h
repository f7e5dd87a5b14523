// RendezvousMgr: the rendezvous of each step of one worker task, keyed by step_id.
//
// Find(step_id) creates the step's rendezvous on first use through the protocol's factory.
// Cleanup(step_id) aborts it (pending recvs fail with Cancelled naming the step) and forgets
// it; the most recent cleaned-up step ids are remembered so that a late request for one gets a
// clear FailedPrecondition instead of waiting forever in a fresh rendezvous. Thread-safe; the
// factory runs under the lock, so it must only construct (take no lock, run no callback), and
// aborts run outside it.
#ifndef TENSORVERBS_RENDEZVOUS_RENDEZVOUS_MGR_H_
#define TENSORVERBS_RENDEZVOUS_RENDEZVOUS_MGR_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
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

  // FailedPrecondition if `step_id` was cleaned up recently.
  absl::StatusOr<std::shared_ptr<RemoteRendezvous>> Find(int64_t step_id);

  void Cleanup(int64_t step_id);
  void CleanupAll();

  size_t NumActiveSteps() const;

 private:
  const Factory factory_;
  const size_t remembered_cleanups_;
  const StepEnded step_ended_;
  mutable Mutex mu_;
  absl::flat_hash_map<int64_t, std::shared_ptr<RemoteRendezvous>> table_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<int64_t> cleaned_ ABSL_GUARDED_BY(mu_);
  std::deque<int64_t> cleaned_order_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_RENDEZVOUS_RENDEZVOUS_MGR_H_
