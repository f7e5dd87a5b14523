#include "python/src/step_binding.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "python/src/binding_util.h"
#include "python/src/dtypes.h"
#include "python/src/futures.h"
#include "python/src/pool_views.h"
#include "python/src/task_binding.h"
#include "tensorverbs/event.h"
#include "tensorverbs/task.h"
#include "tensorverbs/tensor.h"
#include "tensorverbs/tensor_shape.h"
#include "tensorverbs/types.h"

namespace py = pybind11;

namespace tensorverbs::python {
namespace {

// Gives back a reference taken with the GIL from a thread that may not take it (a progress
// thread must never wait for it): the interpreter drops it at its next pending-calls check.
// An interpreter that is going, or whose queue is full, keeps it: a leak, never a crash.
int DecrefPending(void* object) {
  Py_DECREF(static_cast<PyObject*>(object));
  return 0;
}
void DecrefLater(PyObject* object) {
  if (!Py_IsInitialized() || _Py_IsFinalizing()) return;
  (void)Py_AddPendingCall(DecrefPending, object);
}

class PyStep {
 public:
  PyStep(std::shared_ptr<PyTask> task, int64_t id) : task_(std::move(task)) {
    absl::StatusOr<std::unique_ptr<Step>> step;
    {
      py::gil_scoped_release nogil;
      step = task_->task()->BeginStep(id);
    }
    step_ = ValueOrRaise(std::move(step));
    id_ = id;
  }
  ~PyStep() { End(); }

  int64_t id() const { return id_; }

  void Send(const std::string& dst_task, const std::string& name, const py::object& value) {
    Step& step = Live();
    Tensor tensor = task_->TensorFor(value);
    absl::Status s;
    {
      py::gil_scoped_release nogil;
      s = step.Send(dst_task, name, tensor);
    }
    OkOrRaise(s);
  }

  // Starts the recv of `name` from `src_task`; the future ends once with its result.
  std::shared_ptr<RecvFuture> RecvAsync(const std::string& src_task, const std::string& name,
                                        std::optional<int> device) {
    // Not a quick callback: done-callbacks added to the future run in it, with the GIL.
    return std::make_shared<RecvFuture>(Start(src_task, name, device, /*quick=*/false),
                                        Describe(src_task, name), task_);
  }

  // The tensor, waiting at most `timeout` seconds (None: the task's recv timeout).
  // `device`: into that GPU's memory (a DeviceTensor), else into host memory.
  py::object Recv(const std::string& src_task, const std::string& name,
                  std::optional<double> timeout, std::optional<int> device) {
    return ValueOf(Start(src_task, name, device, /*quick=*/true)
                       ->Received(*task_->task(), timeout, Describe(src_task, name)));
  }

  // The tensor, received into the caller's array `out` (writable, C-contiguous, of the
  // tensor's dtype and shape) and returned as `out`. Where the fabric can write the array's
  // memory (tcp, ibverbs) the bytes land there with no copy; elsewhere they are copied in once.
  // The task holds a reference to `out` for as long as a peer may write it, so its memory
  // stays valid whatever the caller does. A recv that fails waits for the task to let go of
  // `out` (at most kOutGraceSeconds: the sender answers or the channel closes) before it
  // raises; one that times out raises at once and, asked for still, may land in `out` later.
  py::object RecvInto(const std::string& src_task, const std::string& name,
                      std::optional<double> timeout, py::array out) {
    Step& step = Live();
    const std::string what = Describe(src_task, name);
    if (!out.writeable()) throw py::value_error(what + ": `out` is read-only");
    if ((out.flags() & py::array::c_style) == 0) {
      throw py::value_error(what + ": `out` must be C-contiguous");
    }
    const DataType type = DataTypeOf(out.dtype());
    if (type == DataType::kString) throw py::value_error(what + ": `out` cannot hold strings");
    std::vector<int64_t> dims(out.shape(), out.shape() + out.ndim());
    const TensorShape shape = ValueOrRaise(TensorShape::Create(dims));
    struct Landing {
      std::mutex mu;
      std::condition_variable cv;
      bool released = false;          // under mu: the task let go of `out`
      Event done;                     // the recv ended
      absl::StatusOr<Tensor> result;  // written once before `done`
    };
    auto landing = std::make_shared<Landing>();
    RecvOptions options;
    if (out.nbytes() > 0) {
      // The release may run on the task's progress thread, which must never wait for the GIL:
      // it gives the reference back through the interpreter's pending calls.
      PyObject* held = out.ptr();
      Py_INCREF(held);
      options.into = ValueOrRaise(
          task_->task()->AdoptHostMemory(out.mutable_data(), type, shape, [landing, held] {
            {
              std::lock_guard<std::mutex> lock(landing->mu);
              landing->released = true;
            }
            landing->cv.notify_all();
            DecrefLater(held);
          }));
    } else {
      landing->released = true;
    }
    Tensor into = options.into;
    options.quick_callback = true;
    options.waiter_starts = true;
    {
      py::gil_scoped_release nogil;
      step.RecvAsync(src_task, name, options, [landing](absl::StatusOr<Tensor> result) {
        landing->result = std::move(result);
        landing->done.Notify();
      });
      options.into = Tensor();
    }
    Landing* l = landing.get();
    if (!WaitWithoutGil(*task_->task(), l->done, DeadlineAfter(timeout))) {
      Raise(absl::DeadlineExceededError(
          absl::StrFormat("%s took over %g s; it is still asked for and may land in `out` later",
                          what, timeout.value_or(0))));
    }
    absl::StatusOr<Tensor> result = std::move(l->result);
    if (!result.ok()) {
      into.Clear();  // the task holds it as long as the peer may write it
      py::gil_scoped_release nogil;
      std::unique_lock<std::mutex> lock(l->mu);
      l->cv.wait_for(lock, std::chrono::seconds(kOutGraceSeconds), [l] { return l->released; });
    }
    if (!result.ok()) Raise(result.status());
    const Tensor& got = *result;
    if (got.SharesBufferWith(into)) return out;  // in place (in_place_recvs)
    if (got.dtype() != type || got.shape() != shape) {
      throw py::value_error(absl::StrCat(what, ": the tensor is ", DataTypeName(got.dtype()),
                                         got.shape().DebugString(), ", `out` is ",
                                         DataTypeName(type), shape.DebugString(),
                                         "; nothing was written into `out`"));
    }
    if (got.TotalBytes() > 0) {
      py::gil_scoped_release nogil;
      std::memcpy(out.mutable_data(), got.data(), got.TotalBytes());
    }
    task_->CountOutCopy(got.TotalBytes());
    return out;
  }

  // Every recv of `keys` ((task, name) pairs) started at once and waited for together: their
  // values in order, or the first failure's error (by order), after all ended, or
  // DeadlineExceededError naming the first still waiting after `timeout` seconds.
  py::list RecvMany(const std::vector<std::pair<std::string, std::string>>& keys,
                    std::optional<double> timeout, std::optional<int> device) {
    Step& step = Live();
    if (keys.empty()) return py::list();
    RecvOptions options;
    options.allocator = task_->RecvAllocator(device);
    options.quick_callback = true;
    options.waiter_starts = true;
    struct Batch {
      std::mutex mu;
      Event all_ended;
      size_t left = 0;                              // under mu
      std::vector<bool> ended;                      // under mu
      std::vector<absl::StatusOr<Tensor>> results;  // each written once, before `left` drops
    };
    auto batch = std::make_shared<Batch>();
    batch->results.resize(keys.size());
    batch->left = keys.size();
    batch->ended.assign(keys.size(), false);
    const absl::Time deadline = DeadlineAfter(timeout);
    {
      py::gil_scoped_release nogil;
      for (size_t i = 0; i < keys.size(); ++i) {
        step.RecvAsync(keys[i].first, keys[i].second, options,
                       [batch, i](absl::StatusOr<Tensor> result) {
                         batch->results[i] = std::move(result);
                         bool last;
                         {
                           std::lock_guard<std::mutex> lock(batch->mu);
                           batch->ended[i] = true;
                           last = --batch->left == 0;
                         }
                         if (last) batch->all_ended.Notify();
                       });
      }
    }
    Batch* b = batch.get();
    if (!WaitWithoutGil(*task_->task(), b->all_ended, deadline)) {
      std::lock_guard<std::mutex> lock(b->mu);
      const size_t first = std::find(b->ended.begin(), b->ended.end(), false) - b->ended.begin();
      Raise(absl::DeadlineExceededError(absl::StrFormat(
          "recv_many: %d of %d recvs in step %d still waiting after %g s, the first %s", b->left,
          keys.size(), id_, timeout.value_or(0),
          first < keys.size() ? Describe(keys[first].first, keys[first].second) : "")));
    }
    for (const absl::StatusOr<Tensor>& result : batch->results) {
      if (!result.ok()) Raise(result.status());
    }
    py::list values(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      values[i] = ValueOf(*batch->results[i]);
    }
    return values;
  }

  // Sends every (task, name, value) of `items`: all converted first (a bad value sends none),
  // then sent in one pass without the GIL.
  void SendMany(const std::vector<std::tuple<std::string, std::string, py::object>>& items) {
    Step& step = Live();
    std::vector<Tensor> tensors;
    tensors.reserve(items.size());
    for (const auto& [task, name, value] : items) tensors.push_back(task_->TensorFor(value));
    absl::Status s;
    {
      py::gil_scoped_release nogil;
      for (size_t i = 0; i < items.size() && s.ok(); ++i) {
        s = step.Send(std::get<0>(items[i]), std::get<1>(items[i]), tensors[i]);
      }
    }
    OkOrRaise(s);
  }

  void WaitUntilSendsTaken(double timeout) {
    Step& step = Live();
    absl::Status s;
    {
      py::gil_scoped_release nogil;
      s = step.WaitUntilSendsTaken(Seconds(timeout));
    }
    OkOrRaise(s);
  }

  // Ends the step: pending recvs fail with Cancelled, untaken sends are dropped. Idempotent.
  void End() {
    if (step_ == nullptr) return;
    std::unique_ptr<Step> step = std::move(step_);
    if (PyGILState_Check()) {
      py::gil_scoped_release nogil;
      step.reset();
    } else {
      step.reset();
    }
  }

  bool ended() const { return step_ == nullptr; }

 private:
  Step& Live() {
    if (step_ == nullptr) {
      Raise(absl::FailedPreconditionError(absl::StrCat("step ", id_, " has ended")));
    }
    return *step_;
  }

  // Starts the recv; the task ends the state once.
  // `quick`: nobody can add done-callbacks (a blocking recv's), so the callback only stores the
  // tensor and wakes the waiter, wherever the task's progress runs.
  std::shared_ptr<RecvState> Start(const std::string& src_task, const std::string& name,
                                   std::optional<int> device, bool quick) {
    Step& step = Live();
    RecvOptions options;
    options.allocator = task_->RecvAllocator(device);
    options.quick_callback = quick;
    options.waiter_starts = quick;  // a blocking recv waits at once; a future may never
    auto state = std::make_shared<RecvState>();
    py::gil_scoped_release nogil;
    step.RecvAsync(src_task, name, options, [state](absl::StatusOr<Tensor> result) {
      RecvState::Complete(state, std::move(result));
    });
    return state;
  }

  std::string Describe(const std::string& src_task, const std::string& name) const {
    return absl::StrCat("recv of '", name, "' from ", src_task, " in step ", id_);
  }

  // How long a recv into `out` that failed waits for the task to let go of `out`.
  static constexpr int kOutGraceSeconds = 10;

  std::shared_ptr<PyTask> task_;
  std::unique_ptr<Step> step_;
  int64_t id_ = 0;
};

}  // namespace

void BindStep(py::module_& m) {
  py::class_<PyStep>(m, "Step")
      .def(py::init<std::shared_ptr<PyTask>, int64_t>(), py::arg("task"), py::arg("id"))
      .def_property_readonly("id", &PyStep::id)
      .def_property_readonly("ended", &PyStep::ended)
      .def("send", &PyStep::Send, py::arg("task"), py::arg("name"), py::arg("value"))
      .def("send_many", &PyStep::SendMany, py::arg("items"))
      .def("recv", &PyStep::Recv, py::arg("task"), py::arg("name"), py::arg("timeout") = py::none(),
           py::arg("device") = py::none())
      .def("recv_into", &PyStep::RecvInto, py::arg("task"), py::arg("name"),
           py::arg("timeout") = py::none(), py::arg("out"))
      .def("recv_async", &PyStep::RecvAsync, py::arg("task"), py::arg("name"),
           py::arg("device") = py::none())
      .def("recv_many", &PyStep::RecvMany, py::arg("keys"), py::arg("timeout") = py::none(),
           py::arg("device") = py::none())
      .def("wait_until_sends_taken", &PyStep::WaitUntilSendsTaken, py::arg("timeout"))
      .def("end", &PyStep::End);
}

}  // namespace tensorverbs::python
