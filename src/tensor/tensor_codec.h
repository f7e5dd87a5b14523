// Conversions between Tensor / TensorShape and their protobuf forms (proto/tensor.proto).
//
// Everything decoded is validated: an unknown dtype, a bad shape or content whose size does not
// match the shape is InvalidArgument, never a crash. Pure functions, any thread.
#ifndef TENSORVERBS_TENSOR_TENSOR_CODEC_H_
#define TENSORVERBS_TENSOR_TENSOR_CODEC_H_

#include "absl/status/statusor.h"
#include "proto/tensor.pb.h"
#include "src/tensor/tensor.h"

namespace tensorverbs {

void ShapeToProto(const TensorShape& shape, proto::TensorShapeProto* out);
absl::StatusOr<TensorShape> ShapeFromProto(const proto::TensorShapeProto& in);

// POD tensors fill tensor_content; string tensors fill string_val.
void TensorToProto(const Tensor& tensor, proto::TensorProto* out);
absl::StatusOr<Tensor> TensorFromProto(const proto::TensorProto& in, Allocator* allocator);

}  // namespace tensorverbs

#endif  // TENSORVERBS_TENSOR_TENSOR_CODEC_H_
