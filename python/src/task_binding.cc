#include "python/src/task_binding.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "python/src/binding_util.h"
#include "python/src/dlpack.h"
#include "python/src/dtypes.h"
#include "python/src/pool_views.h"
#include "tensorverbs/allocator.h"
#include "tensorverbs/cluster_spec.h"
#include "tensorverbs/task.h"
#include "tensorverbs/tensor.h"
#include "tensorverbs/tensor_shape.h"
#include "tensorverbs/types.h"

namespace py = pybind11;

namespace tensorverbs::python {

PyTask::PyTask(const std::string& cluster, const std::string& job, int task,
               const std::string& protocol, std::optional<double> recv_timeout) {
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

PyTask::~PyTask() {
  if (PyGILState_Check()) {
    py::gil_scoped_release nogil;
    task_.reset();
  } else {
    task_.reset();
  }
}

void PyTask::WaitForPeers(double timeout, std::optional<std::vector<std::string>> tasks) {
  absl::Status s;
  {
    py::gil_scoped_release nogil;
    s = tasks.has_value() ? task_->WaitForPeers(*tasks, Seconds(timeout))
                          : task_->WaitForPeers(Seconds(timeout));
  }
  OkOrRaise(s);
}

void PyTask::Stop() {
  py::gil_scoped_release nogil;
  task_->Stop();
}

py::object PyTask::Empty(const std::vector<int64_t>& dims, const py::dtype& dtype,
                         std::optional<int> device) {
  const DataType type = DataTypeOf(dtype);
  TensorShape shape = ValueOrRaise(TensorShape::Create(dims));
  if (!device.has_value()) return ArrayOf(ValueOrRaise(task_->Empty(type, shape)));
  Allocator* gpu = ValueOrRaise(task_->DeviceAllocator(*device));
  return py::cast(std::make_shared<DeviceTensor>(ValueOrRaise(Tensor::Allocate(gpu, type, shape))));
}

Allocator* PyTask::RecvAllocator(std::optional<int> device) {
  if (!device.has_value()) return nullptr;
  return ValueOrRaise(task_->DeviceAllocator(*device));
}

py::dict PyTask::Stats() const {
  const TaskStats s = task_->stats();
  py::dict d;
  d["tensors"] = s.tensors;
  d["bytes"] = s.bytes;
  d["errors"] = s.errors;
  d["copies"] = s.copies;
  d["copied_bytes"] = s.copied_bytes;
  d["staged"] = staged_.load(std::memory_order_relaxed);
  d["staged_bytes"] = staged_bytes_.load(std::memory_order_relaxed);
  d["out_copies"] = out_copies_.load(std::memory_order_relaxed);
  d["out_copied_bytes"] = out_copied_bytes_.load(std::memory_order_relaxed);
  // And every counter `tensorverbs stats` shows for the task, under the same names.
  for (const auto& [name, value] : task_->counters()) d[py::str(name)] = value;
  return d;
}

Tensor PyTask::TensorFor(const py::object& value) {
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
        throw py::type_error(absl::StrCat("a string tensor is a list of bytes or str; item ", i,
                                          " is a ",
                                          std::string(py::str(item.get_type().attr("__name__")))));
      }
    }
    return t;
  }
  if (py::isinstance<DeviceTensor>(value)) {
    const DeviceTensor& d = value.cast<const DeviceTensor&>();
    WaitForDeviceWork(d.device());
    return d.tensor();
  }
  if (!py::isinstance<py::array>(value) && py::hasattr(value, "__dlpack_device__")) {
    return GpuTensorFor(value);
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
  std::vector<int64_t> dims(array.shape(), array.shape() + array.ndim());
  if (const Tensor* pooled = TensorBehind(array); pooled != nullptr && pooled->dtype() == type) {
    if (absl::Span<const int64_t>(dims) == pooled->shape().dims()) return *pooled;
  }
  if (array.nbytes() > 0) {
    // Another view of a pool array (a PyTorch tensor made from one): the pool tensor itself.
    std::optional<Tensor> pooled =
        PoolViews::Get().Find(array.data(), static_cast<size_t>(array.nbytes()), type, dims);
    if (pooled.has_value()) return *std::move(pooled);
  }
  TensorShape shape = ValueOrRaise(TensorShape::Create(dims));
  Tensor t = ValueOrRaise(task_->Empty(type, shape));
  if (t.TotalBytes() > 0) {
    std::memcpy(t.data(), array.data(), t.TotalBytes());
    staged_.fetch_add(1, std::memory_order_relaxed);
    staged_bytes_.fetch_add(static_cast<int64_t>(t.TotalBytes()), std::memory_order_relaxed);
  }
  return t;
}

void PyTask::WaitForDeviceWork(int device) {
  absl::Status s;
  {
    py::gil_scoped_release nogil;
    s = task_->WaitForDeviceWork(device);
  }
  OkOrRaise(s);
}

Tensor PyTask::GpuTensorFor(const py::object& value) {
  py::tuple where = value.attr("__dlpack_device__")();
  if (where.size() != 2 || where[0].cast<int>() != kDlCuda) {
    throw py::type_error(
        absl::StrCat("send takes GPU tensors in CUDA device memory (DLPack device type 2); this ",
                     std::string(py::str(value.get_type().attr("__name__"))), " is on device type ",
                     std::string(py::str(where[0]))));
  }
  // Stream 1, the legacy default stream (the DLPack protocol's name for it): the producer
  // orders its pending work before that stream (PyTorch records an event on its current
  // stream and makes the legacy one wait for it), which WaitForDeviceWork then waits for. A
  // producer that takes no stream argument is asked without one.
  py::object capsule;
  try {
    capsule = value.attr("__dlpack__")(py::arg("stream") = 1);
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_TypeError)) throw;
    capsule = value.attr("__dlpack__")();
  }
  absl::StatusOr<DlpackGpuTensor> taken = TakeDlpackGpuTensor(capsule.ptr());
  if (!taken.ok()) throw py::value_error(std::string(taken.status().message()));
  DlpackGpuTensor& t = *taken;
  // Ours since taken: given back to the producer on every way out but adoption.
  absl::Cleanup give_back = [&t] { t.release(); };
  WaitForDeviceWork(t.device);
  const TensorShape shape = ValueOrRaise(TensorShape::Create(t.dims));
  const uint64_t bytes = ValueOrRaise(Tensor::AllocationBytes(t.dtype, shape));
  if (bytes > 0) {
    std::optional<Tensor> pooled =
        PoolViews::Get().Find(t.data, static_cast<size_t>(bytes), t.dtype, t.dims);
    if (pooled.has_value() && pooled->placement() == MemoryPlacement::CudaDevice(t.device)) {
      return *std::move(pooled);
    }
  }
  std::move(give_back).Cancel();
  return ValueOrRaise(
      task_->AdoptDeviceMemory(t.device, t.data, t.dtype, shape, std::move(t.release)));
}

void BindTask(py::module_& m) {
  py::class_<PyTask, std::shared_ptr<PyTask>>(m, "Task")
      .def(py::init<const std::string&, const std::string&, int, const std::string&,
                    std::optional<double>>(),
           py::arg("cluster"), py::arg("job"), py::arg("task"), py::arg("protocol"),
           py::arg("recv_timeout") = py::none())
      .def_property_readonly("name", [](const PyTask& t) { return t.task()->name(); })
      .def_property_readonly("protocol", [](const PyTask& t) { return t.task()->protocol(); })
      .def_property_readonly("incarnation", [](const PyTask& t) { return t.task()->incarnation(); })
      .def("wait_for_peers", &PyTask::WaitForPeers, py::arg("timeout"),
           py::arg("tasks") = std::nullopt)
      .def("stop", &PyTask::Stop)
      .def("empty", &PyTask::Empty, py::arg("shape"), py::arg("dtype"),
           py::arg("device") = py::none())
      .def("stats", &PyTask::Stats);
}

}  // namespace tensorverbs::python
