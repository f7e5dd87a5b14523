#include "src/transport/grpc/tensor_coding.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <climits>
#include <memory>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "proto/tensor.pb.h"
#include "proto/worker.pb.h"
#include "src/common/status_macros.h"
#include "src/rendezvous/remote_rendezvous.h"
#include "src/tensor/tensor_codec.h"

namespace tensorverbs::grpc_transport {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;
using google::protobuf::io::CodedOutputStream;
using google::protobuf::io::StringOutputStream;

// RecvTensorResponse field numbers (proto/worker.proto).
constexpr int kMetaField = 1;
constexpr int kIsDeadField = 2;
constexpr int kSendStartField = 3;
constexpr int kContentField = 4;
constexpr int kRemoteField = 5;

// A thread keeps the buffer its last meta-data was read into up to this size.
constexpr size_t kKeptMetaBytes = 64 << 10;
// The most a RemoteTensor reference may take on the wire (its packed key is tens of bytes).
constexpr uint32_t kMaxRemoteTensorBytes = 4 << 10;

void ReleaseBuffer(void* user_data) {
  delete static_cast<std::shared_ptr<TensorBuffer>*>(user_data);
}

absl::Status Malformed(absl::string_view why) {
  return absl::DataLossError(absl::StrCat("malformed RecvTensor response: ", why));
}

}  // namespace

void EncodeRecvTensorResponse(const Tensor& tensor, bool is_dead, int64_t send_start_micros,
                              grpc::ByteBuffer* out, const protocol::RemoteTensorRef* remote) {
  proto::TensorProto meta;
  if (!is_dead) {
    meta.set_dtype(static_cast<int32_t>(tensor.dtype()));
    ShapeToProto(tensor.shape(), meta.mutable_tensor_shape());
  }
  const bool pod = tensor.CanMemCopy();
  if (!pod && !is_dead) {
    for (int64_t i = 0; i < tensor.NumElements(); ++i) meta.add_string_val(tensor.strings()[i]);
  }
  const size_t content_bytes = (pod && !is_dead && remote == nullptr) ? tensor.TotalBytes() : 0;

  std::string header;
  {
    StringOutputStream stream(&header);
    CodedOutputStream coded(&stream);
    WireFormatLite::WriteTag(kMetaField, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, &coded);
    coded.WriteVarint32(static_cast<uint32_t>(meta.ByteSizeLong()));
    meta.SerializeWithCachedSizes(&coded);
    if (is_dead) WireFormatLite::WriteBool(kIsDeadField, true, &coded);
    if (send_start_micros != 0)
      WireFormatLite::WriteInt64(kSendStartField, send_start_micros, &coded);
    if (remote != nullptr) {
      proto::RemoteTensor r;
      r.set_addr(remote->addr);
      r.set_key(remote->key);
      r.set_tensor_key(remote->tensor_key);
      r.set_bytes(remote->bytes);
      WireFormatLite::WriteTag(kRemoteField, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, &coded);
      coded.WriteVarint32(static_cast<uint32_t>(r.ByteSizeLong()));
      r.SerializeWithCachedSizes(&coded);
    }
    if (content_bytes > 0) {
      WireFormatLite::WriteTag(kContentField, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, &coded);
      coded.WriteVarint64(content_bytes);
      if (content_bytes <= kInlineLimit)
        coded.WriteRaw(tensor.data(), static_cast<int>(content_bytes));
    }
  }
  if (content_bytes <= kInlineLimit) {
    grpc::Slice slice(header);
    *out = grpc::ByteBuffer(&slice, 1);
    return;
  }
  grpc::Slice slices[2] = {
      grpc::Slice(header),
      grpc::Slice(tensor.data(), content_bytes, &ReleaseBuffer,
                  new std::shared_ptr<TensorBuffer>(tensor.buffer())),
  };
  *out = grpc::ByteBuffer(slices, 2);
}

absl::Status ParseRecvTensorResponse(grpc::ByteBuffer* in, Allocator* allocator,
                                     uint64_t max_tensor_bytes, ParsedResponse* out) {
  // The whole response is here: a length field is believed only as far as bytes follow it.
  const uint64_t total = in->Length();
  grpc::ProtoBufferReader reader(in);
  CodedInputStream coded(&reader);
  coded.SetTotalBytesLimit(INT_MAX);
  bool have_meta = false;
  bool have_content = false;
  proto::TensorProto meta;
  *out = ParsedResponse();
  // Validates the meta-data into dtype and shape (dead tensors skip this: they carry none).
  DataType dtype = DataType::kInvalid;
  TensorShape shape;
  auto resolve_meta = [&]() -> absl::Status {
    if (!have_meta) return Malformed("no meta-data");
    absl::StatusOr<DataType> d = DataTypeFromInt(meta.dtype());
    if (!d.ok()) return Malformed(d.status().message());
    absl::StatusOr<TensorShape> s = ShapeFromProto(meta.tensor_shape());
    if (!s.ok()) return Malformed(s.status().message());
    dtype = *d;
    shape = *std::move(s);
    return absl::OkStatus();
  };
  // What the resolved meta-data makes this task allocate, checked against what the response
  // carries and the limit before any allocation: a peer's word costs nothing until it holds.
  auto announced_bytes = [&]() -> absl::StatusOr<uint64_t> {
    absl::StatusOr<uint64_t> bytes = Tensor::AllocationBytes(dtype, shape);
    if (!bytes.ok()) return Malformed(bytes.status().message());
    return bytes;
  };
  while (true) {
    uint32_t tag = coded.ReadTag();
    if (tag == 0) break;
    const int field = WireFormatLite::GetTagFieldNumber(tag);
    const auto wire = WireFormatLite::GetTagWireType(tag);
    if (field == kMetaField && wire == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      if (have_meta) return Malformed("meta-data twice");
      uint32_t len;
      if (!coded.ReadVarint32(&len)) return Malformed("truncated meta-data length");
      // String elements ride in the meta-data and cost an object each however short their
      // encoding: count them against the limit before the parse builds them. The buffer is
      // reused, so a recv does not allocate for this.
      static thread_local std::string encoded;
      absl::Cleanup trim = [] {
        if (encoded.capacity() > kKeptMetaBytes) {
          encoded = std::string();  // a large string tensor's encoding is not kept
        }
      };
      if (len > static_cast<uint32_t>(INT_MAX) ||
          !coded.ReadString(&encoded, static_cast<int>(len))) {
        return Malformed("truncated meta-data");
      }
      absl::StatusOr<EncodedTensorCounts> counts = CountEncodedTensor(encoded);
      if (!counts.ok()) return Malformed(counts.status().message());
      if (counts->dims > TensorShape::kMaxRank) {
        return Malformed(absl::StrCat("meta-data of ", counts->dims, " dimensions"));
      }
      RETURN_IF_ERROR(CheckReceivedTensorBytes(
          static_cast<uint64_t>(counts->strings) * sizeof(std::string), max_tensor_bytes));
      if (!meta.ParseFromString(encoded)) return Malformed("bad meta-data");
      have_meta = true;
    } else if (field == kIsDeadField && wire == WireFormatLite::WIRETYPE_VARINT) {
      uint64_t v;
      if (!coded.ReadVarint64(&v)) return Malformed("truncated is_dead");
      out->is_dead = v != 0;
    } else if (field == kSendStartField && wire == WireFormatLite::WIRETYPE_VARINT) {
      uint64_t v;
      if (!coded.ReadVarint64(&v)) return Malformed("truncated send_start_micros");
      out->send_start_micros = static_cast<int64_t>(v);
    } else if (field == kContentField && wire == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      if (have_content) return Malformed("tensor content twice");
      RETURN_IF_ERROR(resolve_meta());
      uint64_t len;
      if (!coded.ReadVarint64(&len)) return Malformed("truncated content length");
      if (!DataTypeCanMemCopy(dtype)) return Malformed("raw content for a string tensor");
      ASSIGN_OR_RETURN(const uint64_t expected, announced_bytes());
      if (len != expected) {
        return Malformed(absl::StrCat(len, " content bytes for ", DataTypeName(dtype),
                                      shape.DebugString(), " (", expected, " expected)"));
      }
      const uint64_t remaining = total - static_cast<uint64_t>(coded.CurrentPosition());
      if (len > remaining) {
        return Malformed(
            absl::StrCat(len, " content bytes announced and ", remaining, " left in the response"));
      }
      RETURN_IF_ERROR(CheckReceivedTensorBytes(expected, max_tensor_bytes));
      ASSIGN_OR_RETURN(Tensor t, Tensor::Allocate(allocator, dtype, shape));
      // ReadRaw takes an int: read in chunks so tensors of 2 GiB and more work.
      auto* dst = static_cast<char*>(t.data());
      uint64_t left = len;
      while (left > 0) {
        int chunk = static_cast<int>(std::min<uint64_t>(left, 1u << 30));
        if (!coded.ReadRaw(dst, chunk)) return Malformed("truncated tensor content");
        dst += chunk;
        left -= chunk;
      }
      out->tensor = std::move(t);
      have_content = true;
    } else if (field == kRemoteField && wire == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      uint32_t len;
      if (!coded.ReadVarint32(&len)) return Malformed("truncated remote tensor length");
      // A few fixed fields and a packed key: anything longer is not one.
      if (len > kMaxRemoteTensorBytes) {
        return Malformed(absl::StrCat("remote tensor reference of ", len, " bytes"));
      }
      auto limit = coded.PushLimit(static_cast<int>(len));
      proto::RemoteTensor r;
      if (!r.MergePartialFromCodedStream(&coded) || !coded.ConsumedEntireMessage()) {
        return Malformed("bad remote tensor");
      }
      coded.PopLimit(limit);
      out->has_remote = true;
      out->remote.addr = r.addr();
      out->remote.key = r.key();
      out->remote.tensor_key = r.tensor_key();
      out->remote.bytes = r.bytes();
    } else if (!WireFormatLite::SkipField(&coded, tag)) {
      return Malformed(absl::StrCat("cannot skip unknown field ", field));
    }
  }
  if (out->is_dead) {
    // A dead tensor is an uninitialized Tensor, as in TensorFlow.
    if (have_content || out->has_remote) return Malformed("content for a dead tensor");
    out->tensor = Tensor();
    return absl::OkStatus();
  }
  if (out->has_remote && have_content) return Malformed("both content and a remote tensor");
  if (have_content) return absl::OkStatus();
  RETURN_IF_ERROR(resolve_meta());
  if (out->has_remote) {
    // The destination of the read: the receiver checks what the sender says it will read.
    if (!DataTypeCanMemCopy(dtype)) return Malformed("a remote string tensor");
    ASSIGN_OR_RETURN(const uint64_t expected, announced_bytes());
    if (expected != out->remote.bytes || out->remote.bytes == 0 || out->remote.key.empty() ||
        out->remote.tensor_key > protocol::kMaxTensorKey) {
      return Malformed(absl::StrCat("remote tensor of ", out->remote.bytes, " bytes for ",
                                    DataTypeName(dtype), shape.DebugString()));
    }
    RETURN_IF_ERROR(CheckReceivedTensorBytes(expected, max_tensor_bytes));
    ASSIGN_OR_RETURN(out->tensor, Tensor::Allocate(allocator, dtype, shape));
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(const uint64_t expected, announced_bytes());
  if (DataTypeCanMemCopy(dtype)) {
    if (expected != 0) {
      return Malformed(absl::StrCat("no content for ", DataTypeName(dtype), shape.DebugString()));
    }
    ASSIGN_OR_RETURN(out->tensor, Tensor::Allocate(allocator, dtype, shape));
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(CheckReceivedTensorBytes(expected, max_tensor_bytes));
  absl::StatusOr<Tensor> t = TensorFromProto(meta, allocator);
  if (!t.ok()) return Malformed(t.status().message());
  out->tensor = *std::move(t);
  return absl::OkStatus();
}

}  // namespace tensorverbs::grpc_transport
