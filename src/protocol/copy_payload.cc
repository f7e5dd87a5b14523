#include "src/protocol/copy_payload.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "proto/tensor.pb.h"
#include "src/common/status_macros.h"
#include "src/rendezvous/remote_rendezvous.h"
#include "src/tensor/tensor_codec.h"

namespace tensorverbs::protocol {
namespace {

constexpr uint32_t kMagic = 0x50435654;  // "TVCP" little-endian
constexpr uint8_t kVersion = 1;
constexpr uint8_t kDeadFlag = 1;

template <typename T>
void Put(uint8_t* out, size_t offset, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out[offset + i] = static_cast<uint8_t>(v >> (8 * i));
}

template <typename T>
T Get(const uint8_t* in, size_t offset) {
  T v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(in[offset + i]) << (8 * i);
  return v;
}

absl::Status Malformed(absl::string_view why) {
  return absl::DataLossError(absl::StrCat("malformed copy-mode tensor buffer: ", why));
}

}  // namespace

CopyPayload::CopyPayload(const Tensor& tensor, bool is_dead) : is_dead_(is_dead) {
  if (is_dead) return;
  tensor_ = tensor;
  proto::TensorProto header;
  if (tensor.CanMemCopy()) {
    header.set_dtype(static_cast<int32_t>(tensor.dtype()));
    ShapeToProto(tensor.shape(), header.mutable_tensor_shape());
    content_bytes_ = tensor.TotalBytes();
  } else {
    TensorToProto(tensor, &header);  // strings travel in the header
  }
  header_ = header.SerializeAsString();
}

void CopyPayload::WriteTo(uint8_t* out) const {
  Put<uint32_t>(out, 0, kMagic);
  out[4] = kVersion;
  out[5] = is_dead_ ? kDeadFlag : 0;
  Put<uint16_t>(out, 6, 0);
  Put<uint32_t>(out, 8, static_cast<uint32_t>(header_.size()));
  Put<uint32_t>(out, 12, 0);
  Put<uint64_t>(out, 16, content_bytes_);
  std::memcpy(out + kCopyPayloadHeaderBytes, header_.data(), header_.size());
  if (content_bytes_ > 0) {
    std::memcpy(out + kCopyPayloadHeaderBytes + header_.size(), tensor_.data(), content_bytes_);
  }
}

absl::StatusOr<ReadPayload> ReadCopyPayload(const uint8_t* in, size_t available,
                                            Allocator* allocator, uint64_t max_tensor_bytes) {
  if (available < kCopyPayloadHeaderBytes) return Malformed("shorter than its header");
  if (Get<uint32_t>(in, 0) != kMagic) return Malformed("bad magic");
  if (in[4] != kVersion) return Malformed(absl::StrCat("unknown version ", in[4]));
  const uint8_t flags = in[5];
  if ((flags & ~kDeadFlag) != 0 || Get<uint16_t>(in, 6) != 0 || Get<uint32_t>(in, 12) != 0) {
    return Malformed("reserved bits set");
  }
  const uint64_t header_len = Get<uint32_t>(in, 8);
  const uint64_t content_len = Get<uint64_t>(in, 16);
  if (header_len > available - kCopyPayloadHeaderBytes ||
      content_len > available - kCopyPayloadHeaderBytes - header_len) {
    return Malformed(absl::StrCat(header_len, " header and ", content_len,
                                  " content bytes in a buffer of ", available));
  }
  ReadPayload out;
  if (flags & kDeadFlag) {
    if (header_len != 0 || content_len != 0) return Malformed("a dead tensor with bytes");
    out.is_dead = true;
    return out;
  }
  const absl::string_view encoded(reinterpret_cast<const char*>(in + kCopyPayloadHeaderBytes),
                                  header_len);
  absl::StatusOr<EncodedTensorCounts> counts = CountEncodedTensor(encoded);
  if (!counts.ok()) return Malformed(counts.status().message());
  if (counts->strings > 0) {
    // Strings travel in the header: an element costs a string object whatever its encoding.
    if (content_len != 0) return Malformed("raw content for a string tensor");
    RETURN_IF_ERROR(CheckReceivedTensorBytes(
        static_cast<uint64_t>(counts->strings) * sizeof(std::string), max_tensor_bytes));
    absl::StatusOr<Tensor> t = TensorFromEncodedProto(encoded, *counts, allocator);
    if (!t.ok()) return Malformed(t.status().message());
    if (t->dtype() != DataType::kString) return Malformed("strings in a tensor of numbers");
    out.tensor = *std::move(t);
    return out;
  }
  if (counts->dims > TensorShape::kMaxRank) {
    return Malformed(absl::StrCat(counts->dims, " dimensions"));
  }
  proto::TensorProto header;
  if (!header.ParseFromArray(encoded.data(), static_cast<int>(encoded.size()))) {
    return Malformed("the TensorProto header does not parse");
  }
  absl::StatusOr<DataType> dtype = DataTypeFromInt(header.dtype());
  if (!dtype.ok()) return Malformed(dtype.status().message());
  if (!DataTypeCanMemCopy(*dtype)) {
    // An empty string tensor (no elements) or one with a shape its elements do not fill.
    if (content_len != 0) return Malformed("raw content for a string tensor");
    absl::StatusOr<Tensor> t = TensorFromEncodedProto(encoded, *counts, allocator);
    if (!t.ok()) return Malformed(t.status().message());
    out.tensor = *std::move(t);
    return out;
  }
  absl::StatusOr<TensorShape> shape = ShapeFromProto(header.tensor_shape());
  if (!shape.ok()) return Malformed(shape.status().message());
  // Checked before allocating: the header's shape must match the bytes that came with it.
  absl::StatusOr<uint64_t> expected = Tensor::AllocationBytes(*dtype, *shape);
  if (!expected.ok()) return Malformed(expected.status().message());
  if (*expected != content_len) {
    return Malformed(absl::StrCat(content_len, " content bytes for ", DataTypeName(*dtype),
                                  shape->DebugString()));
  }
  ASSIGN_OR_RETURN(Tensor t, Tensor::Allocate(allocator, *dtype, *shape));
  if (content_len > 0) {
    std::memcpy(t.data(), in + kCopyPayloadHeaderBytes + header_len, content_len);
  }
  out.tensor = std::move(t);
  return out;
}

}  // namespace tensorverbs::protocol
