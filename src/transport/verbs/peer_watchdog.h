// PeerWatchdog: liveness of the peers a task receives from. libfabric reports nothing when a
// peer dies, so every `peer_timeout / 4` (clamped to 25 ms .. 5 s) the watchdog asks the
// progress thread which owner channels have recvs pending and probes each such peer with
// VerbsService.CheckChannel, all probes of a round in flight at once on gRPC's async API. A
// peer that does not answer within `peer_timeout` fails its recvs with Unavailable naming it;
// one that answers with a new incarnation fails them with Aborted ("restarted"); one that
// closed its end of the channel fails them with its reason. A channel still being set up with
// recvs waiting on it is probed too, and fails them only if its peer does not answer at all
// (the peer cannot know the channel yet); the peer answers that probe from its RPC thread, so a
// progress thread busy accepting many peers' channels at once does not hold it past the peer
// timeout (CheckChannelRequest.reachable_only). Every other probe is answered on the peer's RPC
// thread too, from its channel table, while the peer's loop moves (VerbsServiceImpl); a loop
// held in one turn for half the peer timeout leaves its probes unanswered. The verdict closes
// the channel on the progress thread, and the next recv from that task sets up a new one. A
// verdict of silence says how late this task heard the deadline (a starved prober hears it
// late) and, on a host with more than 4 runnable tasks a core, names the load and the setting.
//
// The sending side is watched the same way: an accepted channel that holds something for its
// peer (responses, copy buffers, grpc+gdr's lent tensors) is probed for whether the peer's own
// end still stands, so a receiver that died or dropped the channel does not pin that memory
// until this process ends. Its verdict closes the accepted channel (its memory quarantined as
// on any close); silence also ends what was lent to that task alone
// (protocol::PeerChannels::PeerGone).
//
// Each round it also asks the progress engine whether its loop has stopped turning
// (ProgressEngine::StallReport, with the peer timeout as the limit) and logs the report once
// per stall: a provider call that never returns would otherwise look like silent peers.
//
// One thread (its own), started by Start and joined by Stop (idempotent, any thread but its
// own). Stop cancels the probes in flight and waits for their callbacks, so nothing refers to
// the watchdog after it returns.
#ifndef TENSORVERBS_TRANSPORT_VERBS_PEER_WATCHDOG_H_
#define TENSORVERBS_TRANSPORT_VERBS_PEER_WATCHDOG_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "src/common/mutex.h"
#include "src/protocol/peer_channels.h"
#include "src/protocol/progress_engine.h"
#include "src/transport/verbs/verbs_stubs.h"

namespace tensorverbs::verbs {

class PeerWatchdog {
 public:
  // `self` is this task's name (the probes carry it); the others outlive the watchdog. Each probe
  // sent is counted in `probes_sent`.
  PeerWatchdog(std::string self, absl::Duration peer_timeout, protocol::ProgressEngine* engine,
               protocol::PeerChannels* channels, protocol::ChannelTable* table, VerbsStubs* stubs,
               std::atomic<int64_t>* probes_sent);
  PeerWatchdog(const PeerWatchdog&) = delete;
  PeerWatchdog& operator=(const PeerWatchdog&) = delete;
  ~PeerWatchdog();  // Stop()

  void Start();
  void Stop();
  // After Stop, one more round on the caller's thread, each probe answered within `timeout`.
  // A task stopping its traffic asks this way whether the borrowers of its lent tensors still
  // hold their channels: one that dropped its end, or stopped, tells nobody otherwise, and the
  // shutdown would wait its whole grace for a release that cannot come.
  void LastRound(absl::Duration timeout);

 private:
  struct Probe;
  void Loop();
  // Probes every peer of `peers` at once, each within `timeout`, and returns when every probe
  // has an answer (or was cancelled by Stop, which the last round ignores).
  void ProbeRound(const std::vector<protocol::PeerChannels::Probe>& peers, absl::Duration timeout,
                  bool last);
  // The verdict on one answer, applied on the progress thread.
  void Judge(const Probe& probe);
  // The verdict on a probe that had no answer: the peer did not do `what`. It says how late this
  // task heard the deadline, and the host's load where that can starve a live peer.
  absl::Status Silence(const Probe& probe, absl::string_view what) const;

  const std::string self_;
  const absl::Duration peer_timeout_;
  protocol::ProgressEngine* const engine_;
  protocol::PeerChannels* const channels_;
  protocol::ChannelTable* const table_;
  VerbsStubs* const stubs_;
  std::atomic<int64_t>* const probes_sent_;

  Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int outstanding_ ABSL_GUARDED_BY(mu_) = 0;  // probes of the current round without an answer
  std::vector<std::shared_ptr<Probe>> round_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace tensorverbs::verbs

#endif  // TENSORVERBS_TRANSPORT_VERBS_PEER_WATCHDOG_H_
