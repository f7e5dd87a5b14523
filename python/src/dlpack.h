// DLPack (https://dmlc.github.io/dlpack/latest/): the C structs by which PyTorch, CuPy, JAX and
// NumPy hand tensors between libraries without copies, declared here as the specification
// fixes their layout (the unversioned form every producer still speaks), and the two
// directions this package needs for GPU tensors: reading a producer's capsule, and making a
// capsule over a received tensor. No Python objects here beyond the capsule itself; the module
// calls these with the GIL held.
#ifndef TENSORVERBS_PYTHON_DLPACK_H_
#define TENSORVERBS_PYTHON_DLPACK_H_

#include <Python.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "tensorverbs/tensor.h"
#include "tensorverbs/types.h"

namespace tensorverbs::python {

// The specification's device types this package meets.
enum DlDeviceType : int32_t { kDlCpu = 1, kDlCuda = 2, kDlCudaHost = 3, kDlCudaManaged = 13 };

struct DlDevice {
  int32_t device_type;  // DlDeviceType
  int32_t device_id;
};
struct DlDataType {
  uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat, 5 complex, 6 bool
  uint8_t bits;
  uint16_t lanes;
};
struct DlTensor {
  void* data;
  DlDevice device;
  int32_t ndim;
  DlDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null: compact and row-major
  uint64_t byte_offset;
};
struct DlManagedTensor {
  DlTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DlManagedTensor* self);
};

// The capsule names of the protocol: a producer's, and the one a consumer renames it to once
// it owns the tensor (so the capsule's destructor leaves it alone).
inline constexpr char kDlpackCapsule[] = "dltensor";
inline constexpr char kUsedDlpackCapsule[] = "used_dltensor";

// A producer's GPU tensor, taken over from its capsule.
struct DlpackGpuTensor {
  int device = 0;
  void* data = nullptr;  // data + byte_offset
  DataType dtype = DataType::kInvalid;
  std::vector<int64_t> dims;
  // Runs the producer's deleter: exactly once, from any thread (the deleter's owner, PyTorch or
  // a Python producer, takes the GIL itself if it needs it).
  std::function<void()> release;
};

// Reads `capsule` (a producer's "dltensor") for a tensor in CUDA device memory and takes it
// over (renames the capsule). InvalidArgument, leaving the capsule to its producer, for another
// device, a dtype this package has no type for, vector lanes, or a layout that is not compact
// and row-major (DLPack strides count elements; a dimension of extent 1 may have any stride).
absl::StatusOr<DlpackGpuTensor> TakeDlpackGpuTensor(PyObject* capsule);

// A new "dltensor" capsule viewing `tensor` (a GPU tensor, on `device`), which it keeps alive
// until the consumer's deleter runs or, if no consumer takes it, the capsule goes.
// InvalidArgument for a dtype DLPack cannot carry.
absl::StatusOr<PyObject*> NewDlpackCapsule(const Tensor& tensor, int device);

// The DLPack dtype of `dtype`, and back (kInvalid where there is none).
absl::StatusOr<DlDataType> DlpackTypeOf(DataType dtype);
DataType DataTypeOfDlpack(DlDataType type);

}  // namespace tensorverbs::python

#endif  // TENSORVERBS_PYTHON_DLPACK_H_
