// Received tensors as Python sees them, without a copy: a host tensor becomes a NumPy array
// whose base is a capsule that owns a Tensor, so the pooled buffer lives as long as any array
// viewing it; a GPU tensor becomes a DeviceTensor. While either lives its buffer is in the view
// table (PoolViews), found by address, so a PyTorch tensor made from it, which views the same
// memory but not the capsule, is sent as the pool tensor it is.
//
// Called by Task (empty, send), Step and RecvFuture (a recv's value) on the caller's thread
// with the GIL held. The table itself is for any thread: capsules die with the GIL, sends look
// up without it.
#ifndef TENSORVERBS_PYTHON_POOL_VIEWS_H_
#define TENSORVERBS_PYTHON_POOL_VIEWS_H_

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "absl/types/span.h"
#include "tensorverbs/tensor.h"
#include "tensorverbs/types.h"

namespace tensorverbs::python {

// The pool tensors arrays made by this module view, by buffer address, while the array's
// capsule lives. A PyTorch tensor made from such an array (torch.from_numpy, from_dlpack)
// views the same memory but not the capsule; sending it finds the pool tensor here and sends
// it without a copy. Any thread (capsules die with the GIL, sends look up without it).
class PoolViews {
 public:
  static PoolViews& Get();
  void Add(const Tensor* tensor);
  void Remove(const Tensor* tensor);
  // The pool tensor of exactly `bytes` at `data` with `dtype` and `dims`, if one is viewed.
  std::optional<Tensor> Find(const void* data, size_t bytes, DataType dtype,
                             absl::Span<const int64_t> dims);

 private:
  std::mutex mu_;
  std::unordered_multimap<const void*, const Tensor*> by_address_;  // under mu_
};

// The Tensor an array made by this module views, if it views all of one.
const Tensor* TensorBehind(const pybind11::array& array);

// A POD tensor as an array over its own buffer; the capsule keeps the buffer alive.
pybind11::array ArrayOf(const Tensor& tensor);

// A tensor in a GPU's memory, as Python sees it: what a recv into a GPU returns and
// Server.empty(..., device=) makes. It speaks DLPack (torch.from_dlpack, cupy.from_dlpack) and
// CUDA's array interface (CuPy, Numba, torch.as_tensor), both without a copy, and keeps the
// memory alive while any view made through them lives. Its memory is in the view table while
// it lives, so a PyTorch tensor made from it is sent as this tensor. With the GIL.
class DeviceTensor {
 public:
  explicit DeviceTensor(Tensor tensor);
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  ~DeviceTensor();

  const Tensor& tensor() const { return tensor_; }
  int device() const { return std::max(tensor_.placement().device, 0); }
  pybind11::tuple Shape() const;
  // NumPy's dtype, or the type's name where NumPy has none (bfloat16).
  pybind11::object Dtype() const;
  // The data is complete when a recv returns it, so a consumer's stream needs no wait: the
  // `stream` argument (and any newer keyword) is accepted and has nothing to order.
  pybind11::object Dlpack() const;
  pybind11::tuple DlpackDevice() const;
  pybind11::dict CudaArrayInterface() const;
  std::string Repr() const;

 private:
  Tensor tensor_;
};

// A received tensor as Python sees it: None for a dead tensor, a DeviceTensor for GPU memory,
// an array over the buffer for a POD tensor, a list of bytes for strings.
pybind11::object ValueOf(const Tensor& tensor);

// Where an array made by this module keeps its tensor: (address, bytes) of the tensor's buffer,
// or None for any other array. Tests use it to show a received array is the buffer itself.
pybind11::object TensorBufferOf(const pybind11::array& array);

// Registers DeviceTensor with `m`.
void BindPoolViews(pybind11::module_& m);

}  // namespace tensorverbs::python

#endif  // TENSORVERBS_PYTHON_POOL_VIEWS_H_
