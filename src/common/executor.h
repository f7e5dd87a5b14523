// Executor: a small fixed pool of threads that runs user callbacks.
//
// Transports hand user `done` callbacks here so that user code never runs on a progress loop or
// a gRPC completion thread, where it could stall every other transfer. Schedule() may be called
// from any thread; tasks start in FIFO order. The destructor runs every task already scheduled,
// then joins; Schedule() after destruction began is a programming error.
//
// An executor of zero threads runs each task inline, in Schedule(), on the caller's thread:
// the lowest-latency choice (no hand-off between threads) for callbacks that never block, and
// the callers must then not hold a lock when they schedule.
#ifndef TENSORVERBS_COMMON_EXECUTOR_H_
#define TENSORVERBS_COMMON_EXECUTOR_H_

#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "src/common/mutex.h"

namespace tensorverbs {

class Executor {
 public:
  using Task = absl::AnyInvocable<void() &&>;

  Executor(std::string name, int num_threads);
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;
  ~Executor();

  void Schedule(Task task);
  // Schedules every task of `tasks` (emptied) as one unit: one lock and at most one wake-up
  // for all of them; they run in order on one thread. For a caller that completes many
  // callbacks at once (a progress loop's turn).
  void ScheduleAll(std::vector<Task>* tasks);

 private:
  void WorkerLoop();

  Mutex mu_;
  std::deque<Task> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_EXECUTOR_H_
