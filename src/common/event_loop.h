// EventLoop: one thread that runs deferred tasks and timers in order.
//
// Protocol state lives on exactly one loop thread and other threads reach it only through
// DeferToLoop, so that state needs no locks; methods that must run on the loop begin with
// DCHECK(loop.InLoop()). Tasks posted from any thread run in FIFO order; RunAfter tasks run at
// or after their deadline. Close() is idempotent and callable from any thread: it stops
// accepting work, runs what was already queued (timers not yet due are dropped, never run), and
// the destructor joins the thread. A task posted after Close() is dropped and DeferToLoop
// returns false, so callers can fail their operation instead of losing a callback.
#ifndef TENSORVERBS_COMMON_EVENT_LOOP_H_
#define TENSORVERBS_COMMON_EVENT_LOOP_H_

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "src/common/mutex.h"
#include "absl/time/time.h"

namespace tensorverbs {

class EventLoop {
 public:
  using Task = absl::AnyInvocable<void() &&>;

  explicit EventLoop(std::string name);
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;
  ~EventLoop();  // Close() and join. Must not be called on the loop thread.

  // Queues `task` to run on the loop thread. Returns false (and drops it) after Close().
  bool DeferToLoop(Task task);

  // Runs `task` on the loop after `delay`. Returns an id for Cancel, or 0 after Close().
  uint64_t RunAfter(absl::Duration delay, Task task);

  // Cancels a timer that has not run yet. Returns true if it was cancelled.
  bool Cancel(uint64_t timer_id);

  // True on the loop thread.
  bool InLoop() const;

  void Close();

  const std::string& name() const { return name_; }

 private:
  void Run();

  const std::string name_;
  mutable Mutex mu_;
  std::deque<Task> tasks_ ABSL_GUARDED_BY(mu_);
  // (deadline, id) -> task; the id keeps equal deadlines distinct and in posting order.
  std::map<std::pair<absl::Time, uint64_t>, Task> timers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_timer_id_ ABSL_GUARDED_BY(mu_) = 1;
  // Set by RunAfter so a sleeping loop recomputes its wake-up time.
  bool timers_changed_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
  std::thread::id thread_id_;
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_EVENT_LOOP_H_
