#include "python/src/futures.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "python/src/binding_util.h"
#include "python/src/pool_views.h"
#include "python/src/task_binding.h"
#include "tensorverbs/task.h"
#include "tensorverbs/tensor.h"

namespace py = pybind11;

namespace tensorverbs::python {

void RecvState::Complete(const std::shared_ptr<RecvState>& state, absl::StatusOr<Tensor> result) {
  std::vector<std::unique_ptr<HeldObject>> callbacks;
  std::unique_ptr<HeldObject> future;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    state->result = std::move(result);
    state->done = true;
    callbacks.swap(state->callbacks);
    future.swap(state->future);
  }
  state->event.Notify();
  if (callbacks.empty() || !Py_IsInitialized() || _Py_IsFinalizing()) return;
  py::gil_scoped_acquire gil;
  for (const auto& callback : callbacks) {
    try {
      callback->get()(future->get());
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("tensorverbs recv done-callback");
    }
    callback->Reset();
  }
  future->Reset();
}

bool RecvState::Done() {
  std::lock_guard<std::mutex> lock(mu);
  return done;
}

void RecvState::Wait(Task& task, const std::optional<double>& timeout, const std::string& what) {
  if (event.HasBeenNotified()) return;
  if (!WaitWithoutGil(task, event, DeadlineAfter(timeout))) {
    Raise(absl::DeadlineExceededError(
        absl::StrFormat("%s took over %g s", what, timeout.value_or(0))));
  }
}

const Tensor& RecvState::Received(Task& task, const std::optional<double>& timeout,
                                  const std::string& what) {
  Wait(task, timeout, what);
  if (!result.ok()) Raise(result.status());
  return *result;
}

RecvFuture::RecvFuture(std::shared_ptr<RecvState> state, std::string what,
                       std::shared_ptr<PyTask> task)
    : state_(std::move(state)), what_(std::move(what)), task_(std::move(task)) {}

py::object RecvFuture::Result(std::optional<double> timeout) {
  const Tensor& tensor = state_->Received(*task_->task(), timeout, what_);
  if (!value_) value_ = ValueOf(tensor);  // result() may be called again
  return value_;
}

py::object RecvFuture::Exception(std::optional<double> timeout) {
  state_->Wait(*task_->task(), timeout, what_);
  return state_->result.ok() ? py::none() : ErrorOf(state_->result.status());
}

void RecvFuture::AddDoneCallback(py::object fn) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->done) {
      state_->callbacks.push_back(std::make_unique<HeldObject>(std::move(fn)));
      // The future lives until its callbacks ran, even if the caller dropped it.
      if (state_->future == nullptr) {
        state_->future = std::make_unique<HeldObject>(py::cast(shared_from_this()));
      }
      return;
    }
  }
  try {
    fn(py::cast(shared_from_this()));
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable("tensorverbs recv done-callback");
  }
}

void BindFutures(py::module_& m) {
  py::class_<RecvFuture, std::shared_ptr<RecvFuture>>(m, "RecvFuture")
      .def("result", &RecvFuture::Result, py::arg("timeout") = py::none())
      .def("exception", &RecvFuture::Exception, py::arg("timeout") = py::none())
      .def("done", &RecvFuture::Done)
      .def("running", [](RecvFuture& f) { return !f.Done(); })
      .def("cancelled", [](const RecvFuture&) { return false; })
      .def("cancel", [](const RecvFuture&) { return false; })
      .def("add_done_callback", &RecvFuture::AddDoneCallback, py::arg("fn"));
}

}  // namespace tensorverbs::python
