#include "src/common/executor.h"

#include <pthread.h>

#include <cstddef>

#include "src/common/logging.h"

namespace tensorverbs {

Executor::Executor(std::string name, int num_threads) : name_(name.substr(0, 15)) {
  CHECK(num_threads >= 0);
  for (int i = 0; i < num_threads; ++i) {
    threads_.emplace_back([this] { WorkerLoop(); });
    pthread_setname_np(threads_.back().native_handle(), name_.c_str());
  }
}

Executor::~Executor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
  std::vector<std::thread> adopted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    adopted.swap(adopted_);
  }
  for (std::thread& t : adopted) t.join();
}

void Executor::Adopt(std::thread thread) {
  pthread_setname_np(thread.native_handle(), name_.c_str());
  std::lock_guard<std::mutex> lock(mu_);
  adopted_.push_back(std::move(thread));
}

bool Executor::OnOwnThread() const {
  const std::thread::id me = std::this_thread::get_id();
  for (const std::thread& t : threads_) {
    if (t.get_id() == me) return true;
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (const std::thread& t : adopted_) {
    if (t.get_id() == me) return true;
  }
  return false;
}

void Executor::Schedule(Task task) {
  if (threads_.empty()) {
    std::move(task)();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    CHECK(!stopping_) << "Executor::Schedule after shutdown began";
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void Executor::ScheduleAll(std::vector<Task>* tasks) {
  if (tasks->empty()) return;
  if (threads_.empty() || tasks->size() == 1) {
    for (Task& task : *tasks) Schedule(std::move(task));
    tasks->clear();
    return;
  }
  Task all = [batch = std::move(*tasks)]() mutable {
    for (Task& task : batch) std::move(task)();
  };
  tasks->clear();
  Schedule(std::move(all));
}

void Executor::WorkerLoop() {
  while (true) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || tasks_.size() > head_; });
      if (tasks_.size() == head_) return;  // stopping and drained
      task = std::move(tasks_[head_]);
      ++head_;
      if (head_ == tasks_.size()) {
        tasks_.clear();  // keeps its capacity
        head_ = 0;
      } else if (head_ >= kCompactAfter && 2 * head_ >= tasks_.size()) {
        // A queue that never drains: drop the run slots in front, at most once per its length.
        tasks_.erase(tasks_.begin(), tasks_.begin() + static_cast<std::ptrdiff_t>(head_));
        head_ = 0;
      }
    }
    std::move(task)();
  }
}

}  // namespace tensorverbs
