#include "python/src/torch/work_completer.h"

#include <algorithm>

namespace tensorverbs::torch_backend {

std::shared_ptr<WorkCompleter> WorkCompleter::Start() {
  std::shared_ptr<WorkCompleter> c(new WorkCompleter());
  // The thread holds the completer: one detached by Stop still has it while it drains.
  c->thread_ = std::thread([c] { c->Loop(); });
  return c;
}

WorkCompleter::~WorkCompleter() {
  // Only the thread's own reference can be the last while it runs, and it ends the loop
  // first; a completer never started has no thread.
  if (thread_.joinable()) thread_.detach();
}

void WorkCompleter::Watch(c10::intrusive_ptr<TvWork> work,
                          std::chrono::steady_clock::time_point deadline, std::string what) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return;  // the group's destructor fails what is left
  TvWork* key = work.get();
  watched_[key] = Watched{std::move(work), deadline, std::move(what)};
  cv_.notify_one();
}

void WorkCompleter::Push(c10::intrusive_ptr<TvWork> work, absl::Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Its reference goes while `work` still holds one, so never the last one, here.
    watched_.erase(work.get());
    if (!stopping_) {
      queue_.push_back(Queued{std::move(work), std::move(status)});
      cv_.notify_one();
      return;
    }
    if (status.ok()) status = late_;
  }
  work->Complete(status);
}

void WorkCompleter::Drop(c10::intrusive_ptr<TvWork> work) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return;  // `work` goes here, as it would have on the thread
  queue_.push_back(Queued{std::move(work), absl::OkStatus(), /*complete=*/false});
  cv_.notify_one();
}

void WorkCompleter::Stop(absl::Status late) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
    late_ = std::move(late);
  }
  cv_.notify_one();
  std::unordered_map<TvWork*, Watched> watched;  // their release callbacks hold them too
  {
    std::lock_guard<std::mutex> lock(mu_);
    watched.swap(watched_);
  }
  if (thread_.get_id() == std::this_thread::get_id()) {
    thread_.detach();  // inside a work's callback: the loop ends after it returns
  } else if (thread_.joinable()) {
    thread_.join();
  }
}

void WorkCompleter::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (queue_.empty() && !stopping_) {
      auto next = std::chrono::steady_clock::time_point::max();
      for (const auto& [key, w] : watched_) next = std::min(next, w.deadline);
      if (next == std::chrono::steady_clock::time_point::max()) {
        cv_.wait(lock);
      } else {
        cv_.wait_until(lock, next);
      }
      const auto now = std::chrono::steady_clock::now();
      for (auto it = watched_.begin(); it != watched_.end();) {
        if (it->second.deadline > now) {
          ++it;
          continue;
        }
        queue_.push_back(Queued{std::move(it->second.work),
                                absl::DeadlineExceededError(std::move(it->second.what))});
        it = watched_.erase(it);
      }
      continue;
    }
    if (queue_.empty()) break;  // stopping, and everything completed
    Queued q = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    if (q.complete) q.work->Complete(q.status);
    q.work.reset();  // may drop the last reference to a Python tensor: not under the lock
    lock.lock();
  }
}

}  // namespace tensorverbs::torch_backend
