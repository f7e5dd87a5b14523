// WorkCompleter: completes TvWorks on a thread of its own, for completions that arrive on
// threads that must not run them: the transport's threads, which release the memory a send
// adopted from the caller's tensor (process_group.h). Completing a work runs torch's future
// callbacks (Python ones take the GIL) and may drop the last reference to a Python tensor, and
// neither may stall a progress loop.
//
// Owned by one ProcessGroupTensorVerbs and shared with the release callbacks it hands to the
// task; Push and Watch are called from any thread. Every work pushed completes exactly once: on
// the completer's thread while it runs, inline in Push after Stop (with Stop's status in place
// of an OK one: a send the group stopped under was not known to be taken). A watched work that
// is not pushed by its deadline fails with DeadlineExceeded: a lent send whose peer never takes
// it (a dead peer, a rank that never posts the recv) fails like a recv would, instead of
// leaving wait() without a timeout blocked for good.
#ifndef TENSORVERBS_PYTHON_TORCH_WORK_COMPLETER_H_
#define TENSORVERBS_PYTHON_TORCH_WORK_COMPLETER_H_

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>

#include "absl/status/status.h"
#include "python/src/torch/work.h"

namespace tensorverbs::torch_backend {

class WorkCompleter {
 public:
  static std::shared_ptr<WorkCompleter> Start();
  WorkCompleter(const WorkCompleter&) = delete;
  WorkCompleter& operator=(const WorkCompleter&) = delete;
  ~WorkCompleter();

  void Push(c10::intrusive_ptr<TvWork> work, absl::Status status);
  // Lets go of a reference to `work` on the completer's thread (inline after Stop), without
  // completing it: a collective's lent memory, released while the collective still runs.
  void Drop(c10::intrusive_ptr<TvWork> work);
  // Fails `work` with DeadlineExceeded(`what`) at `deadline` unless it is pushed before.
  void Watch(c10::intrusive_ptr<TvWork> work, std::chrono::steady_clock::time_point deadline,
             std::string what);
  // Completes what is queued, then ends the thread (detached when called on it, from inside a
  // work's callback); later Pushes complete inline, an OK status replaced by `late`.
  void Stop(absl::Status late);

 private:
  struct Queued {
    c10::intrusive_ptr<TvWork> work;
    absl::Status status;
    bool complete = true;  // false: only drop the reference
  };
  struct Watched {
    c10::intrusive_ptr<TvWork> work;
    std::chrono::steady_clock::time_point deadline;
    std::string what;
  };
  WorkCompleter() = default;
  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Queued> queue_;  // guarded by mu_
  // Few at a time (the lent sends not yet taken): scanned for the next deadline.
  std::unordered_map<TvWork*, Watched> watched_;  // guarded by mu_
  bool stopping_ = false;                         // guarded by mu_
  absl::Status late_;                             // guarded by mu_
  std::thread thread_;
};

}  // namespace tensorverbs::torch_backend

#endif  // TENSORVERBS_PYTHON_TORCH_WORK_COMPLETER_H_
