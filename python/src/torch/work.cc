#include "python/src/torch/work.h"

#include <ATen/core/jit_type.h>

#include <stdexcept>

#include "absl/strings/str_cat.h"

namespace tensorverbs::torch_backend {
namespace {

// What every work's future holds (what DDP's reducer requires): made once, not per work.
const c10::TypePtr& TensorListType() {
  static const c10::TypePtr* type = new c10::TypePtr(c10::ListType::create(c10::TensorType::get()));
  return *type;
}

}  // namespace

TvWork::TvWork(int rank, c10d::OpType type, const char* profiling_title,
               std::vector<at::Tensor> outputs, std::string what)
    : c10d::Work(rank, type, profiling_title),
      outputs_(std::move(outputs)),
      what_(std::move(what)),
      future_(c10::make_intrusive<c10::ivalue::Future>(TensorListType())) {}

bool TvWork::Complete(const absl::Status& status) {
  {
    std::lock_guard<std::mutex> lock(write_mu_);
    if (done_) return false;
    done_ = true;
  }
  if (status.ok()) {
    future_->markCompleted(c10::IValue(outputs_));
    finish();
  } else {
    // torch turns a std::runtime_error into Python's RuntimeError.
    std::exception_ptr error = std::make_exception_ptr(
        std::runtime_error(absl::StrCat("tensorverbs: ", what_, " failed: ", status.ToString())));
    future_->setError(error);
    finish(error);
  }
  return true;
}

bool TvWork::wait(std::chrono::milliseconds timeout) {
  // Without a timeout the caller may as well run the collective itself; with one, it waits, so
  // that the timeout can abandon the work.
  if (runner_ && timeout == kNoTimeout) runner_(*this);
  std::unique_lock<std::mutex> lock(mutex_);
  if (timeout == kNoTimeout) {
    cv_.wait(lock, [this] { return completed_; });
  } else if (!cv_.wait_for(lock, timeout, [this] { return completed_; })) {
    lock.unlock();
    Complete(absl::DeadlineExceededError(
        absl::StrCat("wait() gave up after ", timeout.count(),
                     " ms; the operation is abandoned and writes nothing more")));
    lock.lock();
    cv_.wait(lock, [this] { return completed_; });
  }
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

int TvWork::sourceRank() const {
  const int rank = source_rank_.load(std::memory_order_relaxed);
  if (rank < 0) {
    throw std::runtime_error(
        absl::StrCat("tensorverbs: ", what_, " has no source rank (only a completed recv has)"));
  }
  return rank;
}

}  // namespace tensorverbs::torch_backend
