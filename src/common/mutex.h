// Mutex, MutexLock and Notification: the project's synchronization primitives.
//
// They have absl::Mutex's shape (Lock/Unlock, Await(condition) re-checked whenever the holder
// unlocks, thread-safety annotations) but are built on std::mutex and std::condition_variable.
// The reason is ThreadSanitizer: Debian's abseil is a shared library built without TSan, so TSan
// cannot see the ordering absl::Mutex provides and reports false races everywhere; it does
// understand the pthread primitives underneath the std types. Any thread may use them.
#ifndef TENSORVERBS_COMMON_MUTEX_H_
#define TENSORVERBS_COMMON_MUTEX_H_

#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tensorverbs {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() {
    // Waiters re-check their condition whenever the state they wait on may have changed.
    if (waiters_ > 0) cv_.notify_all();
    mu_.unlock();
  }

  // With the lock held: blocks until `condition()` (evaluated with the lock held) is true.
  template <typename Condition>
  void Await(Condition condition) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    ++waiters_;
    cv_.wait(lock, condition);
    --waiters_;
    lock.release();
  }

  // As Await, giving up at `deadline`. Returns the condition's final value.
  template <typename Condition>
  bool AwaitWithDeadline(Condition condition, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    if (deadline == absl::InfiniteFuture()) {
      Await(condition);
      return true;
    }
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    ++waiters_;
    bool result = cv_.wait_until(lock, absl::ToChronoTime(deadline), condition);
    --waiters_;
    lock.release();
    return result;
  }

  template <typename Condition>
  bool AwaitWithTimeout(Condition condition, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    if (timeout == absl::InfiniteDuration()) return AwaitWithDeadline(condition, absl::InfiniteFuture());
    return AwaitWithDeadline(condition, absl::Now() + timeout);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int waiters_ = 0;  // guarded by mu_
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }

 private:
  Mutex* const mu_;
};

// A one-shot event: Notify() once; any number of threads wait for it.
class Notification {
 public:
  void Notify() {
    MutexLock lock(&mu_);
    notified_ = true;
  }
  bool HasBeenNotified() {
    MutexLock lock(&mu_);
    return notified_;
  }
  void WaitForNotification() {
    MutexLock lock(&mu_);
    mu_.Await([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return notified_; });
  }
  bool WaitForNotificationWithTimeout(absl::Duration timeout) {
    MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return notified_; },
                                timeout);
  }

 private:
  Mutex mu_;
  bool notified_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_MUTEX_H_
