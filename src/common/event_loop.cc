#include "src/common/event_loop.h"

#include <pthread.h>

#include <utility>

#include "src/common/logging.h"

namespace tensorverbs {

EventLoop::EventLoop(std::string name) : name_(std::move(name)) {
  thread_ = std::thread([this] { Run(); });
  thread_id_ = thread_.get_id();
  pthread_setname_np(thread_.native_handle(), name_.substr(0, 15).c_str());
}

EventLoop::~EventLoop() {
  CHECK(!InLoop()) << "EventLoop " << name_ << " destroyed from its own thread";
  Close();
  if (thread_.joinable()) thread_.join();
}

bool EventLoop::DeferToLoop(Task task) {
  MutexLock lock(&mu_);
  if (closed_) return false;
  tasks_.push_back(std::move(task));
  return true;
}

uint64_t EventLoop::RunAfter(absl::Duration delay, Task task) {
  MutexLock lock(&mu_);
  if (closed_) return 0;
  uint64_t id = next_timer_id_++;
  timers_.emplace(std::make_pair(absl::Now() + delay, id), std::move(task));
  timers_changed_ = true;
  return id;
}

bool EventLoop::Cancel(uint64_t timer_id) {
  MutexLock lock(&mu_);
  for (auto it = timers_.begin(); it != timers_.end(); ++it) {
    if (it->first.second == timer_id) {
      timers_.erase(it);
      return true;
    }
  }
  return false;
}

bool EventLoop::InLoop() const { return std::this_thread::get_id() == thread_id_; }

void EventLoop::Close() {
  MutexLock lock(&mu_);
  closed_ = true;
}

void EventLoop::Run() {
  while (true) {
    std::deque<Task> batch;
    {
      MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return closed_ || !tasks_.empty() || timers_changed_ ||
               (!timers_.empty() && timers_.begin()->first.first <= absl::Now());
      };
      absl::Time wake = timers_.empty() ? absl::InfiniteFuture() : timers_.begin()->first.first;
      mu_.AwaitWithDeadline(ready, wake);
      timers_changed_ = false;
      // Due timers go behind already-queued tasks, preserving posting order.
      absl::Time now = absl::Now();
      while (!timers_.empty() && timers_.begin()->first.first <= now) {
        tasks_.push_back(std::move(timers_.begin()->second));
        timers_.erase(timers_.begin());
      }
      batch.swap(tasks_);
      if (batch.empty() && closed_) {
        timers_.clear();
        return;
      }
    }
    for (Task& task : batch) std::move(task)();
  }
}

}  // namespace tensorverbs
