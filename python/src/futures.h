// A recv's end and the future Python waits on: RecvState is one recv's result as the task's
// callback reports it; RecvFuture is what Step.recv_async returns, with
// concurrent.futures.Future's methods over that state.
//
// The task completes a RecvState on a callback thread without the GIL: it stores the tensor and
// wakes the waiter, which converts it on the caller's thread; only done-callbacks added before
// the recv ended make the callback thread take the GIL, to run them. Step starts the recvs and
// shares the state with the callback (shared_ptr), whose reference may be the last; Python
// objects in it are therefore held in HeldObjects, which take the GIL to let them go. Waits
// release the GIL, drive the task's progress and wake every 50 ms to let Ctrl-C through.
#ifndef TENSORVERBS_PYTHON_FUTURES_H_
#define TENSORVERBS_PYTHON_FUTURES_H_

#include <pybind11/pybind11.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "python/src/binding_util.h"
#include "python/src/task_binding.h"
#include "tensorverbs/event.h"
#include "tensorverbs/task.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::python {

// One recv's end as the task's callback reports it. Shared by the callback (a task thread,
// without the GIL) and whoever waits; it holds Python objects only in HeldObjects, which take
// the GIL to let them go, because its last reference may drop on the task thread.
struct RecvState {
  std::mutex mu;
  Event event;        // notified once `done` is set
  bool done = false;  // under mu
  // Written once before `done` is set and read only after: needs no lock then.
  absl::StatusOr<Tensor> result;
  // Under mu: done-callbacks added before the end, and the future they are given.
  std::vector<std::unique_ptr<HeldObject>> callbacks;
  std::unique_ptr<HeldObject> future;

  // The callback: without the GIL, which it takes only to run done-callbacks.
  static void Complete(const std::shared_ptr<RecvState>& state, absl::StatusOr<Tensor> result);

  bool Done();

  // Waits (GIL released, `task`'s progress driven, Ctrl-C let through) for the end, or raises
  // DeadlineExceededError naming `what` after `timeout` seconds (None: no limit). With the GIL.
  void Wait(Task& task, const std::optional<double>& timeout, const std::string& what);

  // The received tensor once the recv ended, or raises its error (or the timeout's).
  const Tensor& Received(Task& task, const std::optional<double>& timeout, const std::string& what);
};

// What recv_async returns: one recv's result, with concurrent.futures.Future's methods
// (result, exception, done, running, cancelled, cancel, add_done_callback). The task completes
// it on a callback thread without the GIL (it stores the tensor and wakes a waiter); result()
// converts the tensor on the caller's thread. Only done-callbacks added before the recv ended
// run on the callback thread, with the GIL. Made and dropped with the GIL (it is Python's).
class RecvFuture : public std::enable_shared_from_this<RecvFuture> {
 public:
  // `what` names the recv in a timeout's message ("recv of 'x' from worker:1 in step 3").
  RecvFuture(std::shared_ptr<RecvState> state, std::string what, std::shared_ptr<PyTask> task);

  // The tensor, or raises the recv's error; DeadlineExceededError (a TimeoutError) after
  // `timeout` seconds, the recv still asked for.
  pybind11::object Result(std::optional<double> timeout);

  // The recv's error as an exception object, or None if it succeeded.
  pybind11::object Exception(std::optional<double> timeout);

  bool Done() { return state_->Done(); }

  // `fn(future)` once the recv ended: at once if it has.
  void AddDoneCallback(pybind11::object fn);

 private:
  const std::shared_ptr<RecvState> state_;
  const std::string what_;
  const std::shared_ptr<PyTask> task_;  // whose progress a wait drives
  pybind11::object value_;
};

// Registers RecvFuture with `m`.
void BindFutures(pybind11::module_& m);

}  // namespace tensorverbs::python

#endif  // TENSORVERBS_PYTHON_FUTURES_H_
