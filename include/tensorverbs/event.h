// Event: a one-shot signal from the callback that completes a recv to the thread that waits for
// its result.
//
// The callback stores its result, then calls Notify(). The waiting thread calls
// Task::Wait(event, deadline), which drives the task's transport while it waits (it polls the
// fabric and runs the protocol itself, so the recv it waits for completes on that very thread,
// with no hand-off between threads), or WaitUntil(deadline), which only sleeps. Notify may be
// called from any thread, and more than once (later calls do nothing); any number of threads may
// wait. An Event must outlive every Notify and every wait on it: share it with the callback (a
// std::shared_ptr) when the waiter may give up first.
//
// Waker is for whoever waits somewhere else than in the Event itself (the task's progress
// engine, which sleeps in the fabric): a Waker added to an Event is woken by Notify, under the
// Event's lock, until it is removed, so the waker cannot go while Notify uses it.
#ifndef TENSORVERBS_PUBLIC_EVENT_H_
#define TENSORVERBS_PUBLIC_EVENT_H_

#include <atomic>
#include <condition_variable>
#include <mutex>

#include "absl/time/time.h"

namespace tensorverbs {

class Event {
 public:
  class Waker {
   public:
    // Runs on the notifying thread, under the Event's lock: it must only wake, never block.
    virtual void Wake() = 0;

   protected:
    ~Waker() = default;

   private:
    friend class Event;
    Waker* next_ = nullptr;  // the Event's list, under its lock
  };

  Event() = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void Notify();
  bool HasBeenNotified() const { return notified_.load(std::memory_order_acquire); }
  // Sleeps until notified or `deadline`; whether it was notified.
  bool WaitUntil(absl::Time deadline);

  // Adds `waker`, which Notify wakes until RemoveWaker; false (and nothing added) when the Event
  // was notified already.
  bool AddWaker(Waker* waker);
  void RemoveWaker(Waker* waker);

 private:
  std::atomic<bool> notified_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  int sleepers_ = 0;         // threads in WaitUntil, guarded by mu_
  Waker* wakers_ = nullptr;  // guarded by mu_
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_PUBLIC_EVENT_H_
