// _tensorverbs: the C++ half of the `tensorverbs` Python package (python/tensorverbs/), over the
// public API of include/tensorverbs/ only.
//
// It exposes Task and Step as thin objects and the conversions between tensors and NumPy
// arrays; the Python half adds context managers, futures, asyncio and the exception classes.
// Received tensors become arrays without a copy: the array's base is a capsule that owns a
// Tensor, so the pooled buffer lives as long as any array viewing it. Arrays made by
// Task.empty() are pool tensors too and are sent as they are; any other array is staged once
// into the pool.
//
// Threads: every call that may wait (start, wait_for_peers, stop, ending a step, recv_async,
// send) releases the GIL, because the task's callback threads take the GIL to run Python
// callbacks and a caller holding it while the task waits for them would deadlock. Callbacks
// run on those threads with the GIL held, exactly once each; Python objects they hold are
// released with the GIL held, or leaked if the interpreter is already finalizing.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "tensorverbs/tensorverbs.h"

namespace py = pybind11;

namespace tensorverbs::python {
namespace {

constexpr char kCapsuleName[] = "tensorverbs.Tensor";

// Raises the Python exception tensorverbs._errors maps `status` to (its code and message).
[[noreturn]] void Raise(const absl::Status& status) {
  py::object error = py::module_::import("tensorverbs._errors")
                         .attr("error_from_status")(static_cast<int>(status.code()),
                                                    std::string(status.message()));
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  throw py::error_already_set();
}

template <typename T>
T ValueOrRaise(absl::StatusOr<T> value) {
  if (!value.ok()) Raise(value.status());
  return *std::move(value);
}

void OkOrRaise(const absl::Status& status) {
  if (!status.ok()) Raise(status);
}

absl::Duration Seconds(double seconds) {
  if (seconds < 0) throw py::value_error("a timeout must not be negative");
  if (seconds > 1e9) return absl::InfiniteDuration();
  return absl::Seconds(seconds);
}

// A Python object held by C++ code that may drop it on a thread without the GIL.
class HeldObject {
 public:
  explicit HeldObject(py::object object) : object_(std::move(object)) {}
  HeldObject(const HeldObject&) = delete;
  HeldObject& operator=(const HeldObject&) = delete;
  ~HeldObject() {
    if (!object_) return;
    if (!Py_IsInitialized() || _Py_IsFinalizing()) {
      object_.release();  // the interpreter is going: nothing may touch it now
      return;
    }
    py::gil_scoped_acquire gil;
    object_ = py::object();
  }
  // With the GIL held.
  const py::object& get() const { return object_; }
  void Reset() { object_ = py::object(); }

 private:
  py::object object_;
};

// --- dtypes -------------------------------------------------------------------------------------

DataType DataTypeOf(const py::dtype& dtype) {
  const char kind = dtype.kind();
  const size_t size = static_cast<size_t>(dtype.itemsize());
  if (kind == 'b' && size == 1) return DataType::kBool;
  if (kind == 'f') {
    if (size == 2) return DataType::kFloat16;
    if (size == 4) return DataType::kFloat32;
    if (size == 8) return DataType::kFloat64;
  }
  if (kind == 'i') {
    if (size == 1) return DataType::kInt8;
    if (size == 2) return DataType::kInt16;
    if (size == 4) return DataType::kInt32;
    if (size == 8) return DataType::kInt64;
  }
  if (kind == 'u') {
    if (size == 1) return DataType::kUInt8;
    if (size == 2) return DataType::kUInt16;
    if (size == 4) return DataType::kUInt32;
    if (size == 8) return DataType::kUInt64;
  }
  if (kind == 'c') {
    if (size == 8) return DataType::kComplex64;
    if (size == 16) return DataType::kComplex128;
  }
  Raise(absl::InvalidArgumentError(
      absl::StrCat("NumPy dtype '", dtype.attr("name").cast<std::string>(),
                   "' has no tensor type: use bool, int8-64, uint8-64, float16-64 or "
                   "complex64/128 arrays, or a list of bytes/str for strings")));
}

py::dtype NumpyDtypeOf(DataType dtype) {
  switch (dtype) {
    case DataType::kBool:
      return py::dtype("bool");
    case DataType::kFloat16:
      return py::dtype("float16");
    case DataType::kFloat32:
      return py::dtype("float32");
    case DataType::kFloat64:
      return py::dtype("float64");
    case DataType::kInt8:
      return py::dtype("int8");
    case DataType::kInt16:
      return py::dtype("int16");
    case DataType::kInt32:
      return py::dtype("int32");
    case DataType::kInt64:
      return py::dtype("int64");
    case DataType::kUInt8:
      return py::dtype("uint8");
    case DataType::kUInt16:
      return py::dtype("uint16");
    case DataType::kUInt32:
      return py::dtype("uint32");
    case DataType::kUInt64:
      return py::dtype("uint64");
    case DataType::kComplex64:
      return py::dtype("complex64");
    case DataType::kComplex128:
      return py::dtype("complex128");
    case DataType::kBFloat16:
      return py::dtype("uint16");  // NumPy has none: its bits
    default:
      Raise(absl::InvalidArgumentError(
          absl::StrCat("a tensor of type ", DataTypeName(dtype), " has no NumPy form")));
  }
}

// --- tensors <-> arrays -------------------------------------------------------------------------

// The Tensor an array made by this module views, if it views all of one.
const Tensor* TensorBehind(const py::array& array) {
  py::handle base = array.base();
  if (!base || !PyCapsule_CheckExact(base.ptr())) return nullptr;
  if (std::strcmp(PyCapsule_GetName(base.ptr()), kCapsuleName) != 0) return nullptr;
  auto* tensor = static_cast<const Tensor*>(PyCapsule_GetPointer(base.ptr(), kCapsuleName));
  if (tensor == nullptr || tensor->data() != array.data() ||
      tensor->TotalBytes() != static_cast<size_t>(array.nbytes()) ||
      !(array.flags() & py::array::c_style)) {
    return nullptr;
  }
  return tensor;
}

// A POD tensor as an array over its own buffer; the capsule keeps the buffer alive.
py::array ArrayOf(const Tensor& tensor) {
  py::dtype dtype = NumpyDtypeOf(tensor.dtype());
  std::vector<py::ssize_t> shape(tensor.shape().dims().begin(), tensor.shape().dims().end());
  auto* owned = new Tensor(tensor);
  py::capsule base(owned, kCapsuleName, [](PyObject* capsule) {
    delete static_cast<Tensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  });
  if (tensor.TotalBytes() == 0) return py::array(dtype, shape, {}, nullptr, base);
  return py::array(dtype, shape, {}, owned->data(), base);
}

py::object ValueOf(const Tensor& tensor) {
  if (!tensor.IsInitialized()) return py::none();  // a dead tensor (TensorFlow's untaken branch)
  if (tensor.dtype() != DataType::kString) return ArrayOf(tensor);
  py::list out;
  for (int64_t i = 0; i < tensor.NumElements(); ++i) out.append(py::bytes(tensor.strings()[i]));
  return out;
}

// --- Task ---------------------------------------------------------------------------------------

class PyTask {
 public:
  PyTask(const std::string& cluster, const std::string& job, int task, const std::string& protocol,
         std::optional<double> recv_timeout) {
    TaskOptions options;
    options.cluster = ValueOrRaise(ClusterSpec::Parse(cluster));
    options.job = job;
    options.task = task;
    options.protocol = protocol;
    if (recv_timeout.has_value()) options.recv_timeout = Seconds(*recv_timeout);
    absl::StatusOr<std::unique_ptr<Task>> started;
    {
      py::gil_scoped_release nogil;
      started = Task::Start(std::move(options));
    }
    task_ = std::shared_ptr<Task>(ValueOrRaise(std::move(started)).release());
  }

  // Stopping the task waits for its callback threads, which may be waiting for the GIL.
  ~PyTask() {
    if (PyGILState_Check()) {
      py::gil_scoped_release nogil;
      task_.reset();
    } else {
      task_.reset();
    }
  }

  const std::shared_ptr<Task>& task() const { return task_; }
  std::atomic<int64_t>& staged() { return staged_; }
  std::atomic<int64_t>& staged_bytes() { return staged_bytes_; }

  void WaitForPeers(double timeout) {
    absl::Status s;
    {
      py::gil_scoped_release nogil;
      s = task_->WaitForPeers(Seconds(timeout));
    }
    OkOrRaise(s);
  }

  void Stop() {
    py::gil_scoped_release nogil;
    task_->Stop();
  }

  py::array Empty(const std::vector<int64_t>& dims, const py::dtype& dtype) {
    const DataType type = DataTypeOf(dtype);
    TensorShape shape = ValueOrRaise(TensorShape::Create(dims));
    return ArrayOf(ValueOrRaise(task_->Empty(type, shape)));
  }

  py::dict Stats() const {
    const TaskStats s = task_->stats();
    py::dict d;
    d["tensors"] = s.tensors;
    d["bytes"] = s.bytes;
    d["errors"] = s.errors;
    d["copies"] = s.copies;
    d["copied_bytes"] = s.copied_bytes;
    d["staged"] = staged_.load(std::memory_order_relaxed);
    d["staged_bytes"] = staged_bytes_.load(std::memory_order_relaxed);
    // And every counter `tensorverbs stats` shows for the task, under the same names.
    for (const auto& [name, value] : task_->counters()) d[py::str(name)] = value;
    return d;
  }

  // The tensor `value` is sent as: a pool array as it is, anything else staged once.
  Tensor TensorFor(const py::object& value) {
    if (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value)) {
      py::sequence items = value;
      const int64_t n = static_cast<int64_t>(items.size());
      Tensor t = ValueOrRaise(task_->Empty(DataType::kString, TensorShape::Of({n})));
      for (int64_t i = 0; i < n; ++i) {
        py::handle item = items[static_cast<size_t>(i)];
        if (py::isinstance<py::bytes>(item)) {
          t.strings()[i] = item.cast<std::string>();
        } else if (py::isinstance<py::str>(item)) {
          t.strings()[i] = item.cast<std::string>();  // UTF-8
        } else {
          throw py::type_error(
              absl::StrCat("a string tensor is a list of bytes or str; item ", i, " is a ",
                           std::string(py::str(item.get_type().attr("__name__")))));
        }
      }
      return t;
    }
    if (!py::isinstance<py::array>(value)) {
      throw py::type_error(absl::StrCat(
          "send takes a NumPy array, an object with __dlpack__ (a PyTorch CPU tensor) or a list "
          "of bytes/str, not a ",
          std::string(py::str(value.get_type().attr("__name__")))));
    }
    py::array array = py::reinterpret_borrow<py::array>(value);
    if (array.dtype().kind() == 'O' || array.dtype().kind() == 'S' || array.dtype().kind() == 'U') {
      throw py::type_error("send strings as a list of bytes or str, not a NumPy array of them");
    }
    const DataType type = DataTypeOf(array.dtype());
    if (array.dtype().byteorder() == '>') {
      throw py::value_error(
          "the array is big-endian: send array.astype(array.dtype.newbyteorder('='))");
    }
    if (!(array.flags() & py::array::c_style)) {
      throw py::value_error(
          "the array is not C-contiguous: send numpy.ascontiguousarray(array) (a copy)");
    }
    if (const Tensor* pooled = TensorBehind(array); pooled != nullptr && pooled->dtype() == type) {
      std::vector<int64_t> dims(array.shape(), array.shape() + array.ndim());
      if (absl::Span<const int64_t>(dims) == pooled->shape().dims()) return *pooled;
    }
    std::vector<int64_t> dims(array.shape(), array.shape() + array.ndim());
    TensorShape shape = ValueOrRaise(TensorShape::Create(dims));
    Tensor t = ValueOrRaise(task_->Empty(type, shape));
    if (t.TotalBytes() > 0) {
      std::memcpy(t.data(), array.data(), t.TotalBytes());
      staged_.fetch_add(1, std::memory_order_relaxed);
      staged_bytes_.fetch_add(static_cast<int64_t>(t.TotalBytes()), std::memory_order_relaxed);
    }
    return t;
  }

 private:
  std::shared_ptr<Task> task_;
  std::atomic<int64_t> staged_{0};
  std::atomic<int64_t> staged_bytes_{0};
};

// --- Step ---------------------------------------------------------------------------------------

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

  // `done(code, message, value)` runs once on a task callback thread, with the GIL.
  void RecvAsync(const std::string& src_task, const std::string& name, py::object done) {
    Step& step = Live();
    auto held = std::make_shared<HeldObject>(std::move(done));
    py::gil_scoped_release nogil;
    step.RecvAsync(src_task, name, [held](absl::StatusOr<Tensor> result) {
      if (!Py_IsInitialized() || _Py_IsFinalizing()) return;
      py::gil_scoped_acquire gil;
      int code = static_cast<int>(result.status().code());
      std::string message(result.status().message());
      py::object value = py::none();
      if (result.ok()) {
        try {
          value = ValueOf(*result);
        } catch (const std::exception& e) {  // a tensor with no Python form: still one answer
          code = static_cast<int>(absl::StatusCode::kInvalidArgument);
          message = e.what();
        }
      }
      try {
        held->get()(code, message, value);
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("tensorverbs recv callback");
      }
      held->Reset();
    });
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

  std::shared_ptr<PyTask> task_;
  std::unique_ptr<Step> step_;
  int64_t id_ = 0;
};

// Where an array made by this module keeps its tensor: (address, bytes) of the tensor's buffer,
// or None for any other array. Tests use it to show a received array is the buffer itself.
py::object TensorBufferOf(const py::array& array) {
  py::handle base = array.base();
  if (!base || !PyCapsule_CheckExact(base.ptr()) ||
      std::strcmp(PyCapsule_GetName(base.ptr()), kCapsuleName) != 0) {
    return py::none();
  }
  auto* tensor = static_cast<const Tensor*>(PyCapsule_GetPointer(base.ptr(), kCapsuleName));
  return py::make_tuple(reinterpret_cast<uintptr_t>(tensor->data()), tensor->TotalBytes());
}

}  // namespace
}  // namespace tensorverbs::python

namespace tvp = tensorverbs::python;

PYBIND11_MODULE(_tensorverbs, m) {
  m.doc() = "tensorverbs' C++ core; use the tensorverbs package";
  m.attr("__version__") = tensorverbs::Version();
  m.def("available_protocols", &tensorverbs::AvailableProtocols);
  m.def("tensor_buffer", &tvp::TensorBufferOf, py::arg("array"));
  m.def(
      "parse_cluster",
      [](const std::string& spec) {
        return tvp::ValueOrRaise(tensorverbs::ClusterSpec::Parse(spec)).ToString();
      },
      py::arg("spec"));

  py::class_<tvp::PyTask, std::shared_ptr<tvp::PyTask>>(m, "Task")
      .def(py::init<const std::string&, const std::string&, int, const std::string&,
                    std::optional<double>>(),
           py::arg("cluster"), py::arg("job"), py::arg("task"), py::arg("protocol"),
           py::arg("recv_timeout") = py::none())
      .def_property_readonly("name", [](const tvp::PyTask& t) { return t.task()->name(); })
      .def_property_readonly("protocol", [](const tvp::PyTask& t) { return t.task()->protocol(); })
      .def_property_readonly("incarnation",
                             [](const tvp::PyTask& t) { return t.task()->incarnation(); })
      .def("wait_for_peers", &tvp::PyTask::WaitForPeers, py::arg("timeout"))
      .def("stop", &tvp::PyTask::Stop)
      .def("empty", &tvp::PyTask::Empty, py::arg("shape"), py::arg("dtype"))
      .def("stats", &tvp::PyTask::Stats);

  py::class_<tvp::PyStep>(m, "Step")
      .def(py::init<std::shared_ptr<tvp::PyTask>, int64_t>(), py::arg("task"), py::arg("id"))
      .def_property_readonly("id", &tvp::PyStep::id)
      .def_property_readonly("ended", &tvp::PyStep::ended)
      .def("send", &tvp::PyStep::Send, py::arg("task"), py::arg("name"), py::arg("value"))
      .def("recv_async", &tvp::PyStep::RecvAsync, py::arg("task"), py::arg("name"), py::arg("done"))
      .def("wait_until_sends_taken", &tvp::PyStep::WaitUntilSendsTaken, py::arg("timeout"))
      .def("end", &tvp::PyStep::End);
}
