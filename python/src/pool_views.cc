#include "python/src/pool_views.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "python/src/binding_util.h"
#include "python/src/dlpack.h"
#include "python/src/dtypes.h"
#include "tensorverbs/tensor.h"
#include "tensorverbs/types.h"

namespace py = pybind11;

namespace tensorverbs::python {
namespace {

constexpr char kCapsuleName[] = "tensorverbs.Tensor";

}  // namespace

// --- PoolViews ----------------------------------------------------------------------------------

PoolViews& PoolViews::Get() {
  static auto* const views = new PoolViews();  // capsules may die at interpreter exit
  return *views;
}

void PoolViews::Add(const Tensor* tensor) {
  std::lock_guard<std::mutex> lock(mu_);
  by_address_.emplace(tensor->data(), tensor);
}

void PoolViews::Remove(const Tensor* tensor) {
  std::lock_guard<std::mutex> lock(mu_);
  auto [begin, end] = by_address_.equal_range(tensor->data());
  for (auto it = begin; it != end; ++it) {
    if (it->second == tensor) {
      by_address_.erase(it);
      return;
    }
  }
}

std::optional<Tensor> PoolViews::Find(const void* data, size_t bytes, DataType dtype,
                                      absl::Span<const int64_t> dims) {
  std::lock_guard<std::mutex> lock(mu_);
  auto [begin, end] = by_address_.equal_range(data);
  for (auto it = begin; it != end; ++it) {
    const Tensor& t = *it->second;
    if (t.TotalBytes() == bytes && t.dtype() == dtype && t.shape().dims() == dims) return t;
  }
  return std::nullopt;
}

// --- arrays -------------------------------------------------------------------------------------

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

// --- DeviceTensor -------------------------------------------------------------------------------

DeviceTensor::DeviceTensor(Tensor tensor) : tensor_(std::move(tensor)) {
  if (tensor_.TotalBytes() > 0) PoolViews::Get().Add(&tensor_);
}

DeviceTensor::~DeviceTensor() {
  if (tensor_.TotalBytes() > 0) PoolViews::Get().Remove(&tensor_);
}

py::tuple DeviceTensor::Shape() const {
  py::tuple out(tensor_.shape().dims().size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = tensor_.shape().dims()[i];
  return out;
}

py::object DeviceTensor::Dtype() const {
  if (tensor_.dtype() == DataType::kBFloat16) return py::str("bfloat16");
  return NumpyDtypeOf(tensor_.dtype());
}

py::object DeviceTensor::Dlpack() const {
  absl::StatusOr<PyObject*> capsule = NewDlpackCapsule(tensor_, device());
  if (!capsule.ok()) Raise(capsule.status());
  return py::reinterpret_steal<py::object>(*capsule);
}

py::tuple DeviceTensor::DlpackDevice() const {
  return py::make_tuple(static_cast<int>(kDlCuda), device());
}

py::dict DeviceTensor::CudaArrayInterface() const {
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

std::string DeviceTensor::Repr() const {
  return absl::StrCat("<tensorverbs.DeviceTensor ", tensor_.DebugString(), " on cuda:", device(),
                      ">");
}

// --- values -------------------------------------------------------------------------------------

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

py::object TensorBufferOf(const py::array& array) {
  py::handle base = array.base();
  if (!base || !PyCapsule_CheckExact(base.ptr()) ||
      std::strcmp(PyCapsule_GetName(base.ptr()), kCapsuleName) != 0) {
    return py::none();
  }
  auto* tensor = static_cast<const Tensor*>(PyCapsule_GetPointer(base.ptr(), kCapsuleName));
  return py::make_tuple(reinterpret_cast<uintptr_t>(tensor->data()), tensor->TotalBytes());
}

void BindPoolViews(py::module_& m) {
  py::class_<DeviceTensor, std::shared_ptr<DeviceTensor>>(m, "DeviceTensor")
      .def(
          "__dlpack__",
          [](const DeviceTensor& t, const py::object&, const py::kwargs&) { return t.Dlpack(); },
          py::arg("stream") = py::none())
      .def("__dlpack_device__", &DeviceTensor::DlpackDevice)
      .def_property_readonly("__cuda_array_interface__", &DeviceTensor::CudaArrayInterface)
      .def_property_readonly("shape", &DeviceTensor::Shape)
      .def_property_readonly("dtype", &DeviceTensor::Dtype)
      .def_property_readonly(
          "device", [](const DeviceTensor& t) { return absl::StrCat("cuda:", t.device()); })
      .def_property_readonly("nbytes",
                             [](const DeviceTensor& t) { return t.tensor().TotalBytes(); })
      .def_property_readonly(
          "data_ptr",
          [](const DeviceTensor& t) { return reinterpret_cast<uintptr_t>(t.tensor().data()); })
      .def("__repr__", &DeviceTensor::Repr);
}

}  // namespace tensorverbs::python
