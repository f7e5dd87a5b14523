#include "python/src/dlpack.h"

#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tensorverbs::python {

absl::StatusOr<DlDataType> DlpackTypeOf(DataType dtype) {
  auto of = [](uint8_t code, uint8_t bits) { return DlDataType{code, bits, 1}; };
  switch (dtype) {
    case DataType::kInt8:
      return of(0, 8);
    case DataType::kInt16:
      return of(0, 16);
    case DataType::kInt32:
      return of(0, 32);
    case DataType::kInt64:
      return of(0, 64);
    case DataType::kUInt8:
      return of(1, 8);
    case DataType::kUInt16:
      return of(1, 16);
    case DataType::kUInt32:
      return of(1, 32);
    case DataType::kUInt64:
      return of(1, 64);
    case DataType::kFloat16:
      return of(2, 16);
    case DataType::kFloat32:
      return of(2, 32);
    case DataType::kFloat64:
      return of(2, 64);
    case DataType::kBFloat16:
      return of(4, 16);
    case DataType::kComplex64:
      return of(5, 64);
    case DataType::kComplex128:
      return of(5, 128);
    case DataType::kBool:
      return of(6, 8);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("a tensor of type ", DataTypeName(dtype), " has no DLPack form"));
  }
}

DataType DataTypeOfDlpack(DlDataType type) {
  if (type.lanes != 1) return DataType::kInvalid;
  for (DataType candidate :
       {DataType::kInt8, DataType::kInt16, DataType::kInt32, DataType::kInt64, DataType::kUInt8,
        DataType::kUInt16, DataType::kUInt32, DataType::kUInt64, DataType::kFloat16,
        DataType::kFloat32, DataType::kFloat64, DataType::kBFloat16, DataType::kComplex64,
        DataType::kComplex128, DataType::kBool}) {
    const DlDataType t = *DlpackTypeOf(candidate);
    if (t.code == type.code && t.bits == type.bits) return candidate;
  }
  return DataType::kInvalid;
}

absl::StatusOr<DlpackGpuTensor> TakeDlpackGpuTensor(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, kDlpackCapsule)) {
    return absl::InvalidArgumentError(
        "__dlpack__ did not return a \"dltensor\" capsule (one already consumed, or a "
        "versioned one this package does not read)");
  }
  auto* managed = static_cast<DlManagedTensor*>(PyCapsule_GetPointer(capsule, kDlpackCapsule));
  const DlTensor& t = managed->dl_tensor;
  if (t.device.device_type != kDlCuda) {
    return absl::InvalidArgumentError(
        absl::StrCat("the DLPack tensor is on device type ", t.device.device_type,
                     ", not CUDA (2); host tensors are sent through NumPy"));
  }
  DlpackGpuTensor out;
  out.device = t.device.device_id;
  out.dtype = DataTypeOfDlpack(t.dtype);
  if (out.dtype == DataType::kInvalid) {
    return absl::InvalidArgumentError(absl::StrCat("the DLPack tensor's dtype (code ", t.dtype.code,
                                                   ", ", t.dtype.bits, " bits, ", t.dtype.lanes,
                                                   " lanes) has no tensorverbs type"));
  }
  if (t.ndim < 0 || (t.ndim > 0 && t.shape == nullptr)) {
    return absl::InvalidArgumentError("the DLPack tensor has no shape");
  }
  out.dims.assign(t.shape, t.shape + t.ndim);
  if (t.strides != nullptr) {
    int64_t expected = 1;
    for (int i = t.ndim - 1; i >= 0; --i) {
      if (out.dims[i] != 1 && t.strides[i] != expected) {
        return absl::InvalidArgumentError(
            "the GPU tensor is not contiguous (row-major): send tensor.contiguous() (a copy on "
            "the GPU)");
      }
      expected *= out.dims[i];
    }
  }
  out.data = static_cast<char*>(t.data) + t.byte_offset;
  // Ours now: the capsule's destructor no longer calls the deleter, the release does.
  PyCapsule_SetName(capsule, kUsedDlpackCapsule);
  out.release = [managed] {
    if (managed->deleter != nullptr) managed->deleter(managed);
  };
  return out;
}

namespace {

// What a capsule of ours owns: the tensor (so its memory lives) and the shape the DLTensor
// points into.
struct Owned {
  DlManagedTensor managed;
  Tensor tensor;
  std::vector<int64_t> shape;
};

void DeleteOwned(DlManagedTensor* self) { delete static_cast<Owned*>(self->manager_ctx); }

// A capsule no consumer took still owns its tensor.
void DestroyCapsule(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, kDlpackCapsule)) return;  // consumed: the consumer deletes
  auto* managed = static_cast<DlManagedTensor*>(PyCapsule_GetPointer(capsule, kDlpackCapsule));
  managed->deleter(managed);
}

}  // namespace

absl::StatusOr<PyObject*> NewDlpackCapsule(const Tensor& tensor, int device) {
  absl::StatusOr<DlDataType> type = DlpackTypeOf(tensor.dtype());
  if (!type.ok()) return type.status();
  auto* owned = new Owned;
  owned->tensor = tensor;
  owned->shape.assign(tensor.shape().dims().begin(), tensor.shape().dims().end());
  DlTensor& t = owned->managed.dl_tensor;
  t.data = tensor.data();
  t.device = DlDevice{kDlCuda, device};
  t.ndim = static_cast<int32_t>(owned->shape.size());
  t.dtype = *type;
  t.shape = owned->shape.data();
  t.strides = nullptr;
  t.byte_offset = 0;
  owned->managed.manager_ctx = owned;
  owned->managed.deleter = DeleteOwned;
  PyObject* capsule = PyCapsule_New(&owned->managed, kDlpackCapsule, DestroyCapsule);
  if (capsule == nullptr) {
    delete owned;
    return absl::ResourceExhaustedError("could not make a DLPack capsule");
  }
  return capsule;
}

}  // namespace tensorverbs::python
