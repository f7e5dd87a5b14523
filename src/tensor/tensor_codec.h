// Conversions between Tensor / TensorShape and their protobuf forms (proto/tensor.proto).
//
// Everything decoded is validated: an unknown dtype, a bad shape or content whose size does not
// match the shape is InvalidArgument, never a crash. Pure functions, any thread.
#ifndef TENSORVERBS_TENSOR_TENSOR_CODEC_H_
#define TENSORVERBS_TENSOR_TENSOR_CODEC_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/tensor.pb.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs {

void ShapeToProto(const TensorShape& shape, proto::TensorShapeProto* out);
absl::StatusOr<TensorShape> ShapeFromProto(const proto::TensorShapeProto& in);

// POD tensors fill tensor_content; string tensors fill string_val.
void TensorToProto(const Tensor& tensor, proto::TensorProto* out);
absl::StatusOr<Tensor> TensorFromProto(const proto::TensorProto& in, Allocator* allocator);

// What parsing an encoded TensorProto would build, counted without building it. Parsing costs
// tens of bytes per string element or dimension whatever the encoding's size (an empty string
// is two bytes on the wire), so a receiver checks these counts against what it expects, and
// its limits, before it parses a peer's encoding. Malformed encodings are DataLoss.
struct EncodedTensorCounts {
  int64_t strings = 0;  // string_val elements
  int64_t dims = 0;     // tensor_shape dimensions
};
absl::StatusOr<EncodedTensorCounts> CountEncodedTensor(absl::string_view encoded);

// Parses an encoded TensorProto whose `counts` (from CountEncodedTensor) the caller has checked
// against what it expects: string elements against the announced shape or its limit. The rank
// is checked here, before parsing.
absl::StatusOr<Tensor> TensorFromEncodedProto(absl::string_view encoded,
                                              const EncodedTensorCounts& counts,
                                              Allocator* allocator);

}  // namespace tensorverbs

#endif  // TENSORVERBS_TENSOR_TENSOR_CODEC_H_
