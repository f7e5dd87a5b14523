// _tensorverbs: the C++ half of the `tensorverbs` Python package (python/tensorverbs/), over the
// public API of include/tensorverbs/ only.
//
// It exposes Task and Step as thin objects, the conversions between tensors and NumPy arrays,
// and the recv paths whole: a blocking recv, a batch of recvs and a RecvFuture are waited for
// and converted here, so a received tensor costs no Python frame, no Python future and no
// GIL hand-over between threads. The Python half adds context managers, asyncio and the
// exception classes. Received tensors become arrays without a copy: the array's base is a
// capsule that owns a Tensor, so the pooled buffer lives as long as any array viewing it, and
// while it does the buffer is found by address (PoolViews), so a PyTorch tensor viewing it is
// sent as the pool tensor it is. Arrays made by Task.empty() are pool tensors too and are sent
// as they are; any other array is staged once into the pool.
//
// Threads: every call that may wait (start, wait_for_peers, stop, ending a step, the recvs,
// send) releases the GIL while it is in the task, because a RecvFuture's Python done-callbacks
// run on the task's callback threads with the GIL, and a caller holding it while the task
// waits for them would deadlock. Without done-callbacks a completion takes no GIL at all: it
// stores the tensor and wakes the waiter, which converts it. Waits wake every 50 ms to let
// Ctrl-C (KeyboardInterrupt) through. Python objects held by C++ are released with the GIL
// held, or leaked if the interpreter is already finalizing.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "python/src/dlpack.h"
#include "tensorverbs/tensorverbs.h"

namespace py = pybind11;

namespace tensorverbs::python {
namespace {

constexpr char kCapsuleName[] = "tensorverbs.Tensor";

// The Python exception tensorverbs._errors maps `status` to (its code and message).
py::object ErrorOf(const absl::Status& status) {
  return py::module_::import("tensorverbs._errors")
      .attr("error_from_status")(static_cast<int>(status.code()), std::string(status.message()));
}

[[noreturn]] void Raise(const absl::Status& status) {
  py::object error = ErrorOf(status);
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

// When a wait of `timeout` seconds (None: no limit) started now ends.
absl::Time DeadlineAfter(const std::optional<double>& timeout) {
  return timeout.has_value() ? absl::Now() + Seconds(*timeout) : absl::InfiniteFuture();
}

// Waits, without the GIL, until `event` is notified or `deadline` passes; returns whether it
// was. Meanwhile the thread drives `task`'s progress (Task::Wait), so the recvs it waits for
// complete on it. Every 50 ms it lets progress go and takes the GIL to let signals through:
// Ctrl-C raises KeyboardInterrupt here (the recvs it waits for stay asked for, and another
// thread drives the task from then on).
bool WaitWithoutGil(Task& task, Event& event, absl::Time deadline) {
  while (true) {
    bool notified;
    {
      py::gil_scoped_release nogil;
      notified = task.Wait(event, std::min(deadline, absl::Now() + absl::Milliseconds(50)));
    }
    if (notified) return true;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (absl::Now() >= deadline) return false;
  }
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

py::dtype NumpyDtypeByName(DataType dtype) {
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

// NumPy's dtype for `dtype`, made once per type: parsing a dtype's name costs about a
// microsecond, a noticeable share of a small tensor's recv. With the GIL.
py::dtype NumpyDtypeOf(DataType dtype) {
  static auto* const cache = new std::unordered_map<int, py::dtype>();  // never destroyed
  auto it = cache->find(static_cast<int>(dtype));
  if (it != cache->end()) return it->second;
  py::dtype made = NumpyDtypeByName(dtype);
  cache->emplace(static_cast<int>(dtype), made);
  return made;
}

// --- tensors <-> arrays -------------------------------------------------------------------------

// The pool tensors arrays made by this module view, by buffer address, while the array's
// capsule lives. A PyTorch tensor made from such an array (torch.from_numpy, from_dlpack)
// views the same memory but not the capsule; sending it finds the pool tensor here and sends
// it without a copy. Any thread (capsules die with the GIL, sends look up without it).
class PoolViews {
 public:
  static PoolViews& Get() {
    static auto* const views = new PoolViews();  // capsules may die at interpreter exit
    return *views;
  }
  void Add(const Tensor* tensor) {
    std::lock_guard<std::mutex> lock(mu_);
    by_address_.emplace(tensor->data(), tensor);
  }
  void Remove(const Tensor* tensor) {
    std::lock_guard<std::mutex> lock(mu_);
    auto [begin, end] = by_address_.equal_range(tensor->data());
    for (auto it = begin; it != end; ++it) {
      if (it->second == tensor) {
        by_address_.erase(it);
        return;
      }
    }
  }
  // The pool tensor of exactly `bytes` at `data` with `dtype` and `dims`, if one is viewed.
  std::optional<Tensor> Find(const void* data, size_t bytes, DataType dtype,
                             absl::Span<const int64_t> dims) {
    std::lock_guard<std::mutex> lock(mu_);
    auto [begin, end] = by_address_.equal_range(data);
    for (auto it = begin; it != end; ++it) {
      const Tensor& t = *it->second;
      if (t.TotalBytes() == bytes && t.dtype() == dtype && t.shape().dims() == dims) return t;
    }
    return std::nullopt;
  }

 private:
  std::mutex mu_;
  std::unordered_multimap<const void*, const Tensor*> by_address_;  // under mu_
};

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
  const bool viewed = tensor.TotalBytes() > 0;
  if (viewed) PoolViews::Get().Add(owned);
  py::capsule base(owned, kCapsuleName, [](PyObject* capsule) {
    auto* t = static_cast<Tensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
    if (t->TotalBytes() > 0) PoolViews::Get().Remove(t);
    delete t;
  });
  if (!viewed) return py::array(dtype, shape, {}, nullptr, base);
  return py::array(dtype, shape, {}, owned->data(), base);
}

// A tensor in a GPU's memory, as Python sees it: what a recv into a GPU returns and
// Server.empty(..., device=) makes. It speaks DLPack (torch.from_dlpack, cupy.from_dlpack) and
// CUDA's array interface (CuPy, Numba, torch.as_tensor), both without a copy, and keeps the
// memory alive while any view made through them lives. Its memory is in the view table while
// it lives, so a PyTorch tensor made from it is sent as this tensor. With the GIL.
class DeviceTensor {
 public:
  explicit DeviceTensor(Tensor tensor) : tensor_(std::move(tensor)) {
    if (tensor_.TotalBytes() > 0) PoolViews::Get().Add(&tensor_);
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  ~DeviceTensor() {
    if (tensor_.TotalBytes() > 0) PoolViews::Get().Remove(&tensor_);
  }

  const Tensor& tensor() const { return tensor_; }
  int device() const { return std::max(tensor_.placement().device, 0); }
  py::tuple Shape() const {
    py::tuple out(tensor_.shape().dims().size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = tensor_.shape().dims()[i];
    return out;
  }
  // NumPy's dtype, or the type's name where NumPy has none (bfloat16).
  py::object Dtype() const {
    if (tensor_.dtype() == DataType::kBFloat16) return py::str("bfloat16");
    return NumpyDtypeOf(tensor_.dtype());
  }
  // The data is complete when a recv returns it, so a consumer's stream needs no wait: the
  // `stream` argument (and any newer keyword) is accepted and has nothing to order.
  py::object Dlpack() const {
    absl::StatusOr<PyObject*> capsule = NewDlpackCapsule(tensor_, device());
    if (!capsule.ok()) Raise(capsule.status());
    return py::reinterpret_steal<py::object>(*capsule);
  }
  py::tuple DlpackDevice() const { return py::make_tuple(static_cast<int>(kDlCuda), device()); }
  py::dict CudaArrayInterface() const {
    if (tensor_.dtype() == DataType::kBFloat16) {
      throw py::attribute_error("CUDA's array interface has no bfloat16: use __dlpack__");
    }
    py::dict d;
    d["shape"] = Shape();
    d["typestr"] = NumpyDtypeOf(tensor_.dtype()).attr("str");
    d["data"] = py::make_tuple(reinterpret_cast<uintptr_t>(tensor_.data()), false);
    d["strides"] = py::none();
    d["stream"] = py::none();  // complete: nothing to wait for
    d["version"] = 3;
    return d;
  }
  std::string Repr() const {
    return absl::StrCat("<tensorverbs.DeviceTensor ", tensor_.DebugString(), " on cuda:", device(),
                        ">");
  }

 private:
  Tensor tensor_;
};

py::object ValueOf(const Tensor& tensor) {
  if (!tensor.IsInitialized()) return py::none();  // a dead tensor (TensorFlow's untaken branch)
  if (!tensor.placement().host_accessible()) {
    return py::cast(std::make_shared<DeviceTensor>(tensor));
  }
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
  // A recv into `out` that landed elsewhere (the same-host fabric) and was copied in.
  void CountOutCopy(uint64_t bytes) {
    out_copies_.fetch_add(1, std::memory_order_relaxed);
    out_copied_bytes_.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  }

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

  // In the pool, or with `device` in that GPU's pool (a DeviceTensor).
  py::object Empty(const std::vector<int64_t>& dims, const py::dtype& dtype,
                   std::optional<int> device) {
    const DataType type = DataTypeOf(dtype);
    TensorShape shape = ValueOrRaise(TensorShape::Create(dims));
    if (!device.has_value()) return ArrayOf(ValueOrRaise(task_->Empty(type, shape)));
    Allocator* gpu = ValueOrRaise(task_->DeviceAllocator(*device));
    return py::cast(
        std::make_shared<DeviceTensor>(ValueOrRaise(Tensor::Allocate(gpu, type, shape))));
  }

  // The allocator of a recv into GPU `device`, or null for host memory.
  Allocator* RecvAllocator(std::optional<int> device) {
    if (!device.has_value()) return nullptr;
    return ValueOrRaise(task_->DeviceAllocator(*device));
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
    d["out_copies"] = out_copies_.load(std::memory_order_relaxed);
    d["out_copied_bytes"] = out_copied_bytes_.load(std::memory_order_relaxed);
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

 private:
  // Memory the caller's kernels may still be writing is complete before a send reads it.
  void WaitForDeviceWork(int device) {
    absl::Status s;
    {
      py::gil_scoped_release nogil;
      s = task_->WaitForDeviceWork(device);
    }
    OkOrRaise(s);
  }

  // A producer's CUDA tensor (a PyTorch CUDA tensor, a CuPy array) by DLPack: one viewing all of
  // a GPU pool tensor of this module is that tensor; any other is adopted as it is, held until
  // the send's device-to-host copy is done. Either way without a copy here.
  Tensor GpuTensorFor(const py::object& value) {
    py::tuple where = value.attr("__dlpack_device__")();
    if (where.size() != 2 || where[0].cast<int>() != kDlCuda) {
      throw py::type_error(
          absl::StrCat("send takes GPU tensors in CUDA device memory (DLPack device type 2); this ",
                       std::string(py::str(value.get_type().attr("__name__"))),
                       " is on device type ", std::string(py::str(where[0]))));
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

  std::shared_ptr<Task> task_;
  std::atomic<int64_t> staged_{0};
  std::atomic<int64_t> staged_bytes_{0};
  std::atomic<int64_t> out_copies_{0};
  std::atomic<int64_t> out_copied_bytes_{0};
};

// --- RecvFuture ---------------------------------------------------------------------------------

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
  static void Complete(const std::shared_ptr<RecvState>& state, absl::StatusOr<Tensor> result) {
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

  bool Done() {
    std::lock_guard<std::mutex> lock(mu);
    return done;
  }

  // Waits (GIL released, `task`'s progress driven, Ctrl-C let through) for the end, or raises
  // DeadlineExceededError naming `what` after `timeout` seconds (None: no limit). With the GIL.
  void Wait(Task& task, const std::optional<double>& timeout, const std::string& what) {
    if (event.HasBeenNotified()) return;
    if (!WaitWithoutGil(task, event, DeadlineAfter(timeout))) {
      Raise(absl::DeadlineExceededError(
          absl::StrFormat("%s took over %g s", what, timeout.value_or(0))));
    }
  }

  // The received tensor once the recv ended, or raises its error (or the timeout's).
  const Tensor& Received(Task& task, const std::optional<double>& timeout,
                         const std::string& what) {
    Wait(task, timeout, what);
    if (!result.ok()) Raise(result.status());
    return *result;
  }
};

// What recv_async returns: one recv's result, with concurrent.futures.Future's methods
// (result, exception, done, running, cancelled, cancel, add_done_callback). The task completes
// it on a callback thread without the GIL (it stores the tensor and wakes a waiter); result()
// converts the tensor on the caller's thread. Only done-callbacks added before the recv ended
// run on the callback thread, with the GIL. Made and dropped with the GIL (it is Python's).
class RecvFuture : public std::enable_shared_from_this<RecvFuture> {
 public:
  // `what` names the recv in a timeout's message ("recv of 'x' from worker:1 in step 3").
  RecvFuture(std::shared_ptr<RecvState> state, std::string what, std::shared_ptr<PyTask> task)
      : state_(std::move(state)), what_(std::move(what)), task_(std::move(task)) {}

  // The tensor, or raises the recv's error; DeadlineExceededError (a TimeoutError) after
  // `timeout` seconds, the recv still asked for.
  py::object Result(std::optional<double> timeout) {
    const Tensor& tensor = state_->Received(*task_->task(), timeout, what_);
    if (!value_) value_ = ValueOf(tensor);  // result() may be called again
    return value_;
  }

  // The recv's error as an exception object, or None if it succeeded.
  py::object Exception(std::optional<double> timeout) {
    state_->Wait(*task_->task(), timeout, what_);
    return state_->result.ok() ? py::none() : ErrorOf(state_->result.status());
  }

  bool Done() { return state_->Done(); }

  // `fn(future)` once the recv ended: at once if it has.
  void AddDoneCallback(py::object fn) {
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

 private:
  const std::shared_ptr<RecvState> state_;
  const std::string what_;
  const std::shared_ptr<PyTask> task_;  // whose progress a wait drives
  py::object value_;
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
      "placement_from_environment",
      [](const std::string& source) {
        absl::StatusOr<tensorverbs::TaskPlacement> p =
            tensorverbs::PlacementFromEnvironment(source);
        if (!p.ok()) tvp::Raise(p.status());
        return py::make_tuple(p->cluster.ToString(), p->job, p->task);
      },
      py::arg("source"));
  m.def(
      "pick_free_ports",
      [](int count, const std::string& host) {
        return tvp::ValueOrRaise(tensorverbs::PickFreePorts(count, host));
      },
      py::arg("count"), py::arg("host"));
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
      .def("empty", &tvp::PyTask::Empty, py::arg("shape"), py::arg("dtype"),
           py::arg("device") = py::none())
      .def("stats", &tvp::PyTask::Stats);

  py::class_<tvp::DeviceTensor, std::shared_ptr<tvp::DeviceTensor>>(m, "DeviceTensor")
      .def(
          "__dlpack__",
          [](const tvp::DeviceTensor& t, const py::object&, const py::kwargs&) {
            return t.Dlpack();
          },
          py::arg("stream") = py::none())
      .def("__dlpack_device__", &tvp::DeviceTensor::DlpackDevice)
      .def_property_readonly("__cuda_array_interface__", &tvp::DeviceTensor::CudaArrayInterface)
      .def_property_readonly("shape", &tvp::DeviceTensor::Shape)
      .def_property_readonly("dtype", &tvp::DeviceTensor::Dtype)
      .def_property_readonly(
          "device", [](const tvp::DeviceTensor& t) { return absl::StrCat("cuda:", t.device()); })
      .def_property_readonly("nbytes",
                             [](const tvp::DeviceTensor& t) { return t.tensor().TotalBytes(); })
      .def_property_readonly(
          "data_ptr",
          [](const tvp::DeviceTensor& t) { return reinterpret_cast<uintptr_t>(t.tensor().data()); })
      .def("__repr__", &tvp::DeviceTensor::Repr);

  py::class_<tvp::RecvFuture, std::shared_ptr<tvp::RecvFuture>>(m, "RecvFuture")
      .def("result", &tvp::RecvFuture::Result, py::arg("timeout") = py::none())
      .def("exception", &tvp::RecvFuture::Exception, py::arg("timeout") = py::none())
      .def("done", &tvp::RecvFuture::Done)
      .def("running", [](tvp::RecvFuture& f) { return !f.Done(); })
      .def("cancelled", [](const tvp::RecvFuture&) { return false; })
      .def("cancel", [](const tvp::RecvFuture&) { return false; })
      .def("add_done_callback", &tvp::RecvFuture::AddDoneCallback, py::arg("fn"));

  py::class_<tvp::PyStep>(m, "Step")
      .def(py::init<std::shared_ptr<tvp::PyTask>, int64_t>(), py::arg("task"), py::arg("id"))
      .def_property_readonly("id", &tvp::PyStep::id)
      .def_property_readonly("ended", &tvp::PyStep::ended)
      .def("send", &tvp::PyStep::Send, py::arg("task"), py::arg("name"), py::arg("value"))
      .def("send_many", &tvp::PyStep::SendMany, py::arg("items"))
      .def("recv", &tvp::PyStep::Recv, py::arg("task"), py::arg("name"),
           py::arg("timeout") = py::none(), py::arg("device") = py::none())
      .def("recv_into", &tvp::PyStep::RecvInto, py::arg("task"), py::arg("name"),
           py::arg("timeout") = py::none(), py::arg("out"))
      .def("recv_async", &tvp::PyStep::RecvAsync, py::arg("task"), py::arg("name"),
           py::arg("device") = py::none())
      .def("recv_many", &tvp::PyStep::RecvMany, py::arg("keys"), py::arg("timeout") = py::none(),
           py::arg("device") = py::none())
      .def("wait_until_sends_taken", &tvp::PyStep::WaitUntilSendsTaken, py::arg("timeout"))
      .def("end", &tvp::PyStep::End);
}
