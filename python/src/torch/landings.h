// The joins of the torch backend's recvs into the caller's tensor (RecvOptions::into), each one
// machine of one table (src/common/state_table.h; drawn in docs/architecture/state-machines.md):
//
// - InPlaceLanding, a p2p recv's: the task's release of the tensor (a transport thread) against
//   the recv's end (a callback thread). A recv that fails while the task still holds the tensor,
//   which its peer may then still write, completes only once the task lets go of it: nothing
//   writes into a failed recv's tensor.
// - CollectiveLanding, one destination of a collective's: settled once, when its message landed
//   or the task let go of it, whichever comes first.
//
// Each event is taken under the landing's lock and returns what its caller does next, on its own
// thread: the release's thread must hand its reference to the work to the completer (it may be
// the last, and a transport thread must not drop it), so the machine decides and the caller
// acts, rather than the action running on whichever thread last touched the machine.
//
// Needs no torch (its unit test builds without it); thread-safe.
#ifndef TENSORVERBS_PYTHON_TORCH_LANDINGS_H_
#define TENSORVERBS_PYTHON_TORCH_LANDINGS_H_

#include <mutex>

#include "absl/status/status.h"
#include "src/common/state_table.h"

namespace tensorverbs::torch_backend {

class InPlaceLanding {
 public:
  enum class State { kLent, kReleased, kLanded, kFailedHeld, kDone };
  enum class Event { kReleased, kRecvEnded };
  // What the caller of an event does next.
  enum class Action {
    kLand,   // complete the work with the recv's outcome, now
    kWatch,  // wait for the release, bounded by the group's grace
    kDrop,   // hand the release's reference to the work to the completer: nothing to report
    kFail,   // have the completer complete the work with failure()
  };

  // The task let go of the tensor (a transport thread, or inline on a refusal): kDrop or kFail.
  Action Released();
  // The recv ended with `status` (its message's, named for the work): kLand or kWatch.
  Action RecvEnded(const absl::Status& status);
  // The recv's failure, once Released returned kFail.
  absl::Status failure() const;
  State state() const;

 private:
  void MoveTo(State next, Event event);

  mutable std::mutex mu_;
  State state_ = State::kLent;  // guarded by mu_
  absl::Status failure_;        // guarded by mu_
};

class CollectiveLanding {
 public:
  enum class State { kWaiting, kSettled };
  enum class Event { kLanded, kReleased };

  // The message landed (the fabric writes no more), or the task let go of the memory: true for
  // the first of the two, which settles the destination.
  bool Settle(Event event);

 private:
  std::mutex mu_;
  State state_ = State::kWaiting;  // guarded by mu_
};

StateTableView InPlaceLandingTable();
StateTableView CollectiveLandingTable();

}  // namespace tensorverbs::torch_backend

#endif  // TENSORVERBS_PYTHON_TORCH_LANDINGS_H_
