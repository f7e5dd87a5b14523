#include "src/tensor/tensor_codec.h"

#include <climits>
#include <cstring>
#include <vector>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>

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

namespace {

using google::protobuf::io::CodedInputStream;
using google::protobuf::internal::WireFormatLite;

// TensorProto, TensorShapeProto and Dim field numbers (proto/tensor.proto).
constexpr int kDtypeField = 1;
constexpr int kShapeField = 2;
constexpr int kContentField = 4;
constexpr int kStringValField = 8;
constexpr int kDimField = 2;
constexpr int kDimSizeField = 1;

absl::Status BadEncoding(absl::string_view why) {
  return absl::DataLossError(absl::StrCat("malformed TensorProto: ", why));
}

// A field this project never writes. Parsing keeps every unknown field (tens of bytes each for
// a few bytes of wire), and a group has no length to check, so the counter refuses them: what
// a peer may make the receiver build is exactly what it counted.
absl::Status UnexpectedField(absl::string_view message, uint32_t tag) {
  return BadEncoding(absl::StrCat("unexpected field ", WireFormatLite::GetTagFieldNumber(tag),
                                  " (wire type ", WireFormatLite::GetTagWireType(tag), ") in ",
                                  message));
}

bool IsVarint(uint32_t tag) {
  return WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_VARINT;
}
bool IsDelimited(uint32_t tag) {
  return WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED;
}

// Reads a length-delimited field's length and limits `in` to it; the length must fit in what is
// left of the enclosing message (PushLimit alone would keep the wider outer limit).
absl::StatusOr<CodedInputStream::Limit> EnterDelimited(CodedInputStream* in,
                                                       absl::string_view what) {
  uint32_t len;
  if (!in->ReadVarint32(&len)) return BadEncoding(absl::StrCat("truncated ", what, " length"));
  if (static_cast<int64_t>(len) > in->BytesUntilLimit()) {
    return BadEncoding(absl::StrCat(what, " of ", len, " bytes runs past its message"));
  }
  return in->PushLimit(static_cast<int>(len));
}

absl::Status SkipVarint(CodedInputStream* in, absl::string_view what) {
  uint64_t ignored;
  if (!in->ReadVarint64(&ignored)) return BadEncoding(absl::StrCat("truncated ", what));
  return absl::OkStatus();
}

absl::Status CheckDim(CodedInputStream* in) {
  while (uint32_t tag = in->ReadTag()) {
    if (WireFormatLite::GetTagFieldNumber(tag) != kDimSizeField || !IsVarint(tag)) {
      return UnexpectedField("a dimension", tag);
    }
    RETURN_IF_ERROR(SkipVarint(in, "dimension size"));
  }
  if (!in->ConsumedEntireMessage()) return BadEncoding("bad dimension");
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CountDims(CodedInputStream* in) {
  int64_t dims = 0;
  while (uint32_t tag = in->ReadTag()) {
    if (WireFormatLite::GetTagFieldNumber(tag) != kDimField || !IsDelimited(tag)) {
      return UnexpectedField("the shape", tag);
    }
    ASSIGN_OR_RETURN(const CodedInputStream::Limit limit, EnterDelimited(in, "dimension"));
    RETURN_IF_ERROR(CheckDim(in));
    in->PopLimit(limit);
    ++dims;
  }
  if (!in->ConsumedEntireMessage()) return BadEncoding("bad shape");
  return dims;
}

}  // namespace

absl::StatusOr<EncodedTensorCounts> CountEncodedTensor(absl::string_view encoded) {
  if (encoded.size() > static_cast<size_t>(INT_MAX)) {
    return BadEncoding(absl::StrCat(encoded.size(), " bytes: a TensorProto stays under 2 GiB"));
  }
  CodedInputStream in(reinterpret_cast<const uint8_t*>(encoded.data()),
                      static_cast<int>(encoded.size()));
  EncodedTensorCounts counts;
  while (uint32_t tag = in.ReadTag()) {
    const int field = WireFormatLite::GetTagFieldNumber(tag);
    if (field == kDtypeField && IsVarint(tag)) {
      RETURN_IF_ERROR(SkipVarint(&in, "dtype"));
    } else if (field == kShapeField && IsDelimited(tag)) {
      // Parsing merges repeated occurrences of the shape, so their dimensions add up.
      ASSIGN_OR_RETURN(const CodedInputStream::Limit limit, EnterDelimited(&in, "shape"));
      ASSIGN_OR_RETURN(const int64_t dims, CountDims(&in));
      in.PopLimit(limit);
      counts.dims += dims;
    } else if ((field == kContentField || field == kStringValField) && IsDelimited(tag)) {
      ASSIGN_OR_RETURN(const CodedInputStream::Limit limit,
                       EnterDelimited(&in, field == kContentField ? "content" : "string"));
      if (!in.Skip(in.BytesUntilLimit())) return BadEncoding("truncated field");
      in.PopLimit(limit);
      if (field == kStringValField) ++counts.strings;
    } else {
      return UnexpectedField("the TensorProto", tag);
    }
  }
  if (!in.ConsumedEntireMessage()) return BadEncoding("a stray end-group tag");
  return counts;
}

absl::StatusOr<Tensor> TensorFromEncodedProto(absl::string_view encoded,
                                              const EncodedTensorCounts& counts,
                                              Allocator* allocator) {
  if (counts.dims > TensorShape::kMaxRank) {
    return BadEncoding(absl::StrCat(counts.dims, " dimensions; the maximum rank is ",
                                    TensorShape::kMaxRank));
  }
  proto::TensorProto proto;
  if (!proto.ParseFromArray(encoded.data(), static_cast<int>(encoded.size()))) {
    return BadEncoding("does not parse");
  }
  if (proto.string_val_size() != counts.strings) {
    return absl::InvalidArgumentError("the TensorProto is not the one that was counted");
  }
  return TensorFromProto(proto, allocator);
}

}  // namespace tensorverbs
