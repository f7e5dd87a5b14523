// TvWork: the c10d::Work of every tensorverbs backend operation, with the c10::ivalue::Future
// that DDP's comm hooks and `get_future()` wait on.
//
// Made by ProcessGroupTensorVerbs on the caller's thread; completed exactly once, by the worker
// thread, a recv's callback thread, or a `wait(timeout)` that expired. Write() lets the completing
// side write into the caller's tensors only while the work has not completed, so once wait()
// has failed, nothing touches those tensors any more.
#ifndef TENSORVERBS_PYTHON_TORCH_WORK_H_
#define TENSORVERBS_PYTHON_TORCH_WORK_H_

#include <ATen/core/ivalue.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace tensorverbs::torch_backend {

class TvWork final : public c10d::Work {
 public:
  // `what` names the operation in errors: "allreduce #12 (rank 1 of 4)".
  TvWork(int rank, c10d::OpType type, const char* profiling_title, std::vector<at::Tensor> outputs,
         std::string what);

  // Completes the work (OK: the outputs are final) and its future, unless it completed already;
  // returns whether this call completed it. Runs the future's callbacks on this thread.
  bool Complete(const absl::Status& status);
  // Runs `write` (which writes into the outputs) unless the work completed; false if it did.
  template <typename F>
  bool Write(F&& write) {
    std::lock_guard<std::mutex> lock(write_mu_);
    if (done_) return false;
    write();
    return true;
  }
  bool done() const {
    std::lock_guard<std::mutex> lock(write_mu_);
    return done_;
  }
  void set_source_rank(int rank) { source_rank_.store(rank, std::memory_order_relaxed); }
  // Keeps `t` (an operation's scratch memory) for as long as the work lives, as the outputs are
  // kept: memory lent to the task or named as a destination must outlive every use the task
  // makes of it, and the task's releases hold the work.
  void Keep(at::Tensor t) {
    std::lock_guard<std::mutex> lock(write_mu_);
    kept_.push_back(std::move(t));
  }
  const std::string& what() const { return what_; }

  // What wait() runs first, on the waiting thread: the group's queue, up to this work
  // (ProcessGroupTensorVerbs::RunQueuedUntil). Set once, before the work is handed out.
  void set_runner(std::function<void(TvWork&)> runner) { runner_ = std::move(runner); }

  bool wait(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  int sourceRank() const override;
  std::vector<at::Tensor> result() override { return outputs_; }

 private:
  std::function<void(TvWork&)> runner_;
  const std::vector<at::Tensor> outputs_;
  const std::string what_;
  const c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<int> source_rank_{-1};
  mutable std::mutex write_mu_;
  bool done_ = false;             // guarded by write_mu_
  std::vector<at::Tensor> kept_;  // guarded by write_mu_
};

}  // namespace tensorverbs::torch_backend

#endif  // TENSORVERBS_PYTHON_TORCH_WORK_H_
