// Executor: a small fixed pool of threads that runs user callbacks.
//
// Transports hand user `done` callbacks here so that user code never runs on a progress loop or
// a gRPC completion thread, where it could stall every other transfer. Schedule() may be called
// from any thread; tasks start in FIFO order. The destructor runs every task already scheduled,
// then joins; Schedule() after destruction began is a programming error.
//
// Adopt() takes a thread that became one of the executor's (a progress loop's thread that a
// callback kept, see ProgressEngine): it is named as the executor's, counts for OnOwnThread, and
// the destructor joins it with the others.
//
// An executor of zero threads runs each task inline, in Schedule(), on the caller's thread:
// the lowest-latency choice (no hand-off between threads) for callbacks that never block, and
// the callers must then not hold a lock when they schedule.
#ifndef TENSORVERBS_COMMON_EXECUTOR_H_
#define TENSORVERBS_COMMON_EXECUTOR_H_

#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"

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
  // Without threads, Schedule runs each task on the caller's thread.
  bool runs_inline() const { return threads_.empty(); }
  // Whether the calling thread is one of this executor's (a callback running now).
  bool OnOwnThread() const;
  // Joins `thread` at destruction, as one of the executor's own.
  void Adopt(std::thread thread);

 private:
  void WorkerLoop();

  // A plain mutex and condition variable, not tensorverbs::Mutex: its Await wakes every waiter
  // at every unlock, and here a task needs exactly one worker (notify_one), which keeps idle
  // workers asleep while small tasks stream in.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  // A vector and the index of the next task to run, not a deque: a deque allocates a node every
  // few tasks, and a stream of callbacks would pay a malloc for it.
  static constexpr size_t kCompactAfter = 1024;
  std::vector<Task> tasks_;  // guarded by mu_
  size_t head_ = 0;          // guarded by mu_
  bool stopping_ = false;    // guarded by mu_
  std::vector<std::thread> threads_;
  const std::string name_;
  std::vector<std::thread> adopted_;  // guarded by mu_
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_EXECUTOR_H_
