#include "src/tensor/tensor_codec.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"

namespace tensorverbs {

void ShapeToProto(const TensorShape& shape, proto::TensorShapeProto* out) {
  out->Clear();
  for (int64_t d : shape.dims()) out->add_dim()->set_size(d);
}

absl::StatusOr<TensorShape> ShapeFromProto(const proto::TensorShapeProto& in) {
  std::vector<int64_t> dims;
  dims.reserve(in.dim_size());
  for (const auto& d : in.dim()) dims.push_back(d.size());
  return TensorShape::Create(dims);
}

void TensorToProto(const Tensor& tensor, proto::TensorProto* out) {
  out->Clear();
  out->set_dtype(static_cast<int32_t>(tensor.dtype()));
  ShapeToProto(tensor.shape(), out->mutable_tensor_shape());
  if (tensor.CanMemCopy()) {
    out->set_tensor_content(tensor.data(), tensor.TotalBytes());
  } else {
    for (int64_t i = 0; i < tensor.NumElements(); ++i) out->add_string_val(tensor.strings()[i]);
  }
}

absl::StatusOr<Tensor> TensorFromProto(const proto::TensorProto& in, Allocator* allocator) {
  ASSIGN_OR_RETURN(DataType dtype, DataTypeFromInt(in.dtype()));
  ASSIGN_OR_RETURN(TensorShape shape, ShapeFromProto(in.tensor_shape()));
  if (DataTypeCanMemCopy(dtype)) {
    int64_t expected;
    if (__builtin_mul_overflow(shape.num_elements(), static_cast<int64_t>(DataTypeSize(dtype)),
                               &expected) ||
        static_cast<size_t>(expected) != in.tensor_content().size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("TensorProto for ", DataTypeName(dtype), shape.DebugString(), " carries ",
                       in.tensor_content().size(), " content bytes, expected ",
                       shape.num_elements(), " x ", DataTypeSize(dtype)));
    }
    ASSIGN_OR_RETURN(Tensor t, Tensor::Allocate(allocator, dtype, shape));
    if (expected > 0) std::memcpy(t.data(), in.tensor_content().data(), expected);
    return t;
  }
  if (in.string_val_size() != shape.num_elements()) {
    return absl::InvalidArgumentError(absl::StrCat("TensorProto for string", shape.DebugString(),
                                                   " carries ", in.string_val_size(),
                                                   " strings, expected ", shape.num_elements()));
  }
  ASSIGN_OR_RETURN(Tensor t, Tensor::Allocate(allocator, dtype, shape));
  for (int64_t i = 0; i < shape.num_elements(); ++i) t.strings()[i] = in.string_val(i);
  return t;
}

}  // namespace tensorverbs
