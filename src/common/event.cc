#include "tensorverbs/event.h"

namespace tensorverbs {

void Event::Notify() {
  std::lock_guard<std::mutex> lock(mu_);
  if (notified_.load(std::memory_order_relaxed)) return;
  notified_.store(true, std::memory_order_release);
  for (Waker* w = wakers_; w != nullptr; w = w->next_) w->Wake();
  if (sleepers_ > 0) cv_.notify_all();
}

bool Event::WaitUntil(absl::Time deadline) {
  if (HasBeenNotified()) return true;
  std::unique_lock<std::mutex> lock(mu_);
  ++sleepers_;
  auto notified = [this] { return notified_.load(std::memory_order_relaxed); };
  if (deadline == absl::InfiniteFuture()) {
    cv_.wait(lock, notified);
  } else {
    cv_.wait_until(lock, absl::ToChronoTime(deadline), notified);
  }
  --sleepers_;
  return notified();
}

bool Event::AddWaker(Waker* waker) {
  std::lock_guard<std::mutex> lock(mu_);
  if (notified_.load(std::memory_order_relaxed)) return false;
  waker->next_ = wakers_;
  wakers_ = waker;
  return true;
}

void Event::RemoveWaker(Waker* waker) {
  std::lock_guard<std::mutex> lock(mu_);
  for (Waker** p = &wakers_; *p != nullptr; p = &(*p)->next_) {
    if (*p == waker) {
      *p = waker->next_;
      waker->next_ = nullptr;
      return;
    }
  }
}

}  // namespace tensorverbs
