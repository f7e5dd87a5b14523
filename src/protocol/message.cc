#include "src/protocol/message.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"

namespace tensorverbs::protocol {
namespace {

// Layout, all little-endian:
//   u8 version | u8 type | u16 sequence | u32 used_bytes
//   i64 step_id | u32 request_index | u8 flags (bit 0: is_dead) | u8 rank | u16 lane_shares
//   u64 remote_addr | u64 checksum | i32 dtype | u32 error_code | u64 tensor_bytes
//   u16 name_len | u8 key_len | u8 lane_keys | u16 error_len | u16 more | u32 name_index
//   u32 segment_bytes
//   name | remote key | lane_keys x remote key | rank x i64 dims | error message | zeros to a
//   multiple of 8
// `more`: how many messages follow this one in the same slot. Flags bit 1: name_index is set.
// `lane_shares`: lane k's share in bits 4k..4k+3.
constexpr size_t kHeaderSize = 8 + 16 + 8 + 8 + 4 + 4 + 8 + 8 + 8;
constexpr uint8_t kFlagDead = 1;
constexpr uint8_t kFlagNameIndex = 2;
static_assert(kHeaderSize + kMaxNameLength + kMaxLanes * kMaxRemoteKeyLength +
                      8 * TensorShape::kMaxRank + kMaxErrorMessageLength <=
                  kMessageSize,
              "the largest message must fit a slot");

class Writer {
 public:
  explicit Writer(absl::Span<uint8_t> out) : out_(out) {}
  template <typename T>
  void Put(T v) {
    using U = std::make_unsigned_t<T>;
    U u = static_cast<U>(v);
    for (size_t i = 0; i < sizeof(T); ++i) out_[pos_++] = static_cast<uint8_t>(u >> (8 * i));
  }
  void Bytes(absl::string_view s) {
    if (s.empty()) return;  // an empty view's data() may be null, which memcpy must not get
    std::memcpy(out_.data() + pos_, s.data(), s.size());
    pos_ += s.size();
  }
  size_t pos() const { return pos_; }

 private:
  absl::Span<uint8_t> out_;
  size_t pos_ = 0;
};

class Reader {
 public:
  explicit Reader(absl::Span<const uint8_t> in) : in_(in) {}
  template <typename T>
  bool Get(T* v) {
    if (in_.size() - pos_ < sizeof(T)) return false;
    std::make_unsigned_t<T> u = 0;
    for (size_t i = 0; i < sizeof(T); ++i) u |= static_cast<decltype(u)>(in_[pos_++]) << (8 * i);
    *v = static_cast<T>(u);
    return true;
  }
  bool Bytes(size_t n, std::string* s) {
    if (in_.size() - pos_ < n) return false;
    s->assign(reinterpret_cast<const char*>(in_.data() + pos_), n);
    pos_ += n;
    return true;
  }
  bool Bytes(size_t n, fabric::RemoteKey* k) {
    if (in_.size() - pos_ < n || n > fabric::RemoteKey::kCapacity) return false;
    k->assign(absl::string_view(reinterpret_cast<const char*>(in_.data() + pos_), n));
    pos_ += n;
    return true;
  }
  size_t pos() const { return pos_; }
  bool Skip(size_t n) {
    if (in_.size() - pos_ < n) return false;
    pos_ += n;
    return true;
  }

 private:
  absl::Span<const uint8_t> in_;
  size_t pos_ = 0;
};

absl::Status Malformed(absl::string_view why) {
  return absl::DataLossError(absl::StrCat("malformed control message: ", why));
}

bool KnownType(uint8_t t) { return t >= 1 && t <= 4; }

// Only a message that names a destination asks for segments, and none smaller than
// kMinSegmentBytes: a peer could otherwise make one tensor cost an immediate per byte.
absl::Status CheckSegmentBytes(MessageType type, uint32_t segment_bytes) {
  if (segment_bytes == 0) return absl::OkStatus();
  if (type != MessageType::kTensorRequest && type != MessageType::kTensorReRequest) {
    return absl::DataLossError(absl::StrCat(MessageTypeName(type), " carries a segment size"));
  }
  if (segment_bytes < kMinSegmentBytes) {
    return absl::DataLossError(absl::StrCat("content segments of ", segment_bytes,
                                            " bytes, under the ", kMinSegmentBytes,
                                            "-byte minimum"));
  }
  return absl::OkStatus();
}

// Lane keys only beside segments (the unit the lanes share) and a key of their own kind.
absl::Status CheckLaneKeys(uint32_t segment_bytes, size_t lane_keys, size_t key_len) {
  if (lane_keys == 0) return absl::OkStatus();
  if (lane_keys >= kMaxLanes) {
    return absl::DataLossError(
        absl::StrCat(lane_keys, " lane keys, more than the ", kMaxLanes - 1, " a channel may use"));
  }
  if (segment_bytes == 0 || key_len == 0) {
    return absl::DataLossError("lane keys without content segments or a remote key");
  }
  return absl::OkStatus();
}

uint16_t PackLaneShares(const LaneShares& shares) {
  uint16_t packed = 0;
  for (size_t k = 0; k < kMaxLanes; ++k)
    packed |= static_cast<uint16_t>((shares[k] & 0xF) << (4 * k));
  return packed;
}

LaneShares UnpackLaneShares(uint16_t packed) {
  LaneShares shares{};
  for (size_t k = 0; k < kMaxLanes; ++k)
    shares[k] = static_cast<uint8_t>((packed >> (4 * k)) & 0xF);
  return shares;
}

}  // namespace

absl::Status CheckLaneShares(const LaneShares& shares, size_t lane_keys) {
  bool any = false;
  for (uint8_t share : shares) any |= share != 0;
  if (!any) return absl::OkStatus();
  if (lane_keys == 0) return absl::InvalidArgumentError("lane shares without lane keys");
  for (size_t k = 0; k < kMaxLanes; ++k) {
    const bool used = k <= lane_keys;
    if (used && (shares[k] == 0 || shares[k] > kMaxLaneShare)) {
      return absl::InvalidArgumentError(absl::StrCat("lane ", k, "'s share is ", shares[k],
                                                     ", not 1..", kMaxLaneShare, " of ",
                                                     lane_keys + 1, " lanes"));
    }
    if (!used && shares[k] != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("a share for lane ", k, " of a request over ", lane_keys + 1, " lanes"));
    }
  }
  return absl::OkStatus();
}

const char* MessageTypeName(MessageType type) {
  switch (type) {
    case MessageType::kTensorRequest:
      return "RDMA_MESSAGE_TENSOR_REQUEST";
    case MessageType::kMetaDataResponse:
      return "RDMA_MESSAGE_META_DATA_RESPONSE";
    case MessageType::kTensorReRequest:
      return "RDMA_MESSAGE_TENSOR_RE_REQUEST";
    case MessageType::kErrorStatus:
      return "RDMA_MESSAGE_ERROR_STATUS";
  }
  return "unknown";
}

namespace {

// Checks the bounds and returns the used (unpadded) length.
absl::StatusOr<size_t> UsedBytes(const Message& m) {
  if (m.name.size() > kMaxNameLength) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rendezvous key of ", m.name.size(), " bytes is longer than the ", kMaxNameLength,
        "-byte limit of a control message: '", m.name.substr(0, 80), "...'"));
  }
  if (m.remote_key.size() > kMaxRemoteKeyLength) {
    return absl::InvalidArgumentError(absl::StrCat("remote key of ", m.remote_key.size(),
                                                   " bytes exceeds ", kMaxRemoteKeyLength));
  }
  if (!KnownType(static_cast<uint8_t>(m.type))) {
    return absl::InvalidArgumentError("unknown control message type");
  }
  if (m.type != MessageType::kTensorRequest && m.name_index != kNoNameIndex) {
    return absl::InvalidArgumentError(
        absl::StrCat(MessageTypeName(m.type), " cannot carry a name index"));
  }
  if (absl::Status s = CheckSegmentBytes(m.type, m.segment_bytes); !s.ok()) {
    return absl::InvalidArgumentError(s.message());
  }
  if (absl::Status s = CheckLaneKeys(m.segment_bytes, m.lane_keys.size(), m.remote_key.size());
      !s.ok()) {
    return absl::InvalidArgumentError(s.message());
  }
  RETURN_IF_ERROR(CheckLaneShares(m.lane_shares, m.lane_keys.size()));
  for (const fabric::RemoteKey& k : m.lane_keys) {
    if (k.size() != m.remote_key.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a lane key of ", k.size(), " bytes beside a remote key of ", m.remote_key.size()));
    }
  }
  return kHeaderSize + m.name.size() + m.remote_key.size() * (1 + m.lane_keys.size()) +
         8 * size_t(m.meta.shape.rank()) +
         std::min(m.error.message().size(), kMaxErrorMessageLength);
}

size_t Padded(size_t n) { return (n + 7) & ~size_t{7}; }

}  // namespace

absl::StatusOr<size_t> EncodedSize(const Message& m) {
  ASSIGN_OR_RETURN(size_t used, UsedBytes(m));
  return Padded(used);
}

absl::Status EncodeMessage(const Message& m, absl::Span<uint8_t> out, uint16_t more) {
  ASSIGN_OR_RETURN(const size_t used, UsedBytes(m));
  if (out.size() < Padded(used)) {
    return absl::InvalidArgumentError(absl::StrCat("a ", Padded(used), "-byte message does not fit ",
                                                   out.size(), " bytes of slot"));
  }
  const absl::string_view error_message(
      m.error.message().data(), std::min(m.error.message().size(), kMaxErrorMessageLength));
  const int rank = m.meta.shape.rank();
  Writer w(out);
  w.Put<uint8_t>(kWireVersion);
  w.Put<uint8_t>(static_cast<uint8_t>(m.type));
  w.Put<uint16_t>(m.sequence);
  w.Put<uint32_t>(static_cast<uint32_t>(used));
  w.Put<int64_t>(m.step_id);
  w.Put<uint32_t>(m.request_index);
  w.Put<uint8_t>((m.meta.is_dead ? kFlagDead : 0) |
                 (m.name_index != kNoNameIndex ? kFlagNameIndex : 0));
  w.Put<uint8_t>(static_cast<uint8_t>(rank));
  w.Put<uint16_t>(PackLaneShares(m.lane_shares));
  w.Put<uint64_t>(m.remote_addr);
  w.Put<uint64_t>(m.checksum);
  w.Put<int32_t>(static_cast<int32_t>(m.meta.dtype));
  w.Put<uint32_t>(static_cast<uint32_t>(m.error.code()));
  w.Put<uint64_t>(m.meta.tensor_bytes);
  w.Put<uint16_t>(static_cast<uint16_t>(m.name.size()));
  w.Put<uint8_t>(static_cast<uint8_t>(m.remote_key.size()));
  w.Put<uint8_t>(static_cast<uint8_t>(m.lane_keys.size()));
  w.Put<uint16_t>(static_cast<uint16_t>(error_message.size()));
  w.Put<uint16_t>(more);
  w.Put<uint32_t>(m.name_index != kNoNameIndex ? m.name_index : 0);
  w.Put<uint32_t>(m.segment_bytes);
  w.Bytes(m.name);
  w.Bytes(m.remote_key);
  for (const fabric::RemoteKey& k : m.lane_keys) w.Bytes(k);
  for (int64_t d : m.meta.shape.dims()) w.Put<int64_t>(d);
  w.Bytes(error_message);
  while (w.pos() < Padded(used)) w.Put<uint8_t>(0);
  return absl::OkStatus();
}

absl::StatusOr<Message> DecodeMessage(absl::Span<const uint8_t> in, uint16_t* more) {
  Reader r(in);
  uint8_t version, type, flags, rank, key_len;
  uint16_t shares, name_len, error_len, more_field;
  uint32_t used, error_code, name_index;
  int32_t dtype;
  Message m;
  if (!r.Get(&version) || !r.Get(&type) || !r.Get(&m.sequence) || !r.Get(&used)) {
    return Malformed("shorter than its header");
  }
  if (version != kWireVersion) {
    return Malformed(absl::StrCat("wire version ", version, ", this build speaks ", kWireVersion,
                                  "; are both ends the same tensorverbs version?"));
  }
  if (!KnownType(type)) return Malformed(absl::StrCat("unknown type ", type));
  m.type = static_cast<MessageType>(type);
  if (used < kHeaderSize || used > in.size()) {
    return Malformed(absl::StrCat("declares ", used, " bytes in a ", in.size(), "-byte slot"));
  }
  uint8_t lane_keys;
  if (!r.Get(&m.step_id) || !r.Get(&m.request_index) || !r.Get(&flags) || !r.Get(&rank) ||
      !r.Get(&shares) || !r.Get(&m.remote_addr) || !r.Get(&m.checksum) || !r.Get(&dtype) ||
      !r.Get(&error_code) || !r.Get(&m.meta.tensor_bytes) || !r.Get(&name_len) ||
      !r.Get(&key_len) || !r.Get(&lane_keys) || !r.Get(&error_len) || !r.Get(&more_field) ||
      !r.Get(&name_index) || !r.Get(&m.segment_bytes)) {
    return Malformed("truncated header");
  }
  if (flags > (kFlagDead | kFlagNameIndex)) return Malformed(absl::StrCat("unknown flags ", flags));
  m.meta.is_dead = flags & kFlagDead;
  if (flags & kFlagNameIndex) {
    if (name_index == kNoNameIndex) return Malformed("name index 4294967295");
    m.name_index = name_index;
  } else if (name_index != 0) {
    return Malformed(absl::StrCat("name index ", name_index, " without its flag"));
  }
  if (name_len > kMaxNameLength) return Malformed(absl::StrCat("name length ", name_len));
  if (key_len > kMaxRemoteKeyLength) return Malformed(absl::StrCat("remote key length ", key_len));
  if (error_len > kMaxErrorMessageLength) return Malformed(absl::StrCat("error length ", error_len));
  if (rank > TensorShape::kMaxRank) return Malformed(absl::StrCat("rank ", rank));
  if (absl::Status s = CheckLaneKeys(m.segment_bytes, lane_keys, key_len); !s.ok()) {
    return Malformed(s.message());
  }
  m.lane_shares = UnpackLaneShares(shares);
  if (absl::Status s = CheckLaneShares(m.lane_shares, lane_keys); !s.ok()) {
    return Malformed(s.message());
  }
  const size_t expected =
      kHeaderSize + name_len + key_len * (size_t{1} + lane_keys) + 8 * size_t{rank} + error_len;
  if (expected != used) {
    return Malformed(absl::StrCat("field lengths add up to ", expected, " bytes, header says ", used));
  }
  r = Reader(in.subspan(0, used));
  r.Skip(kHeaderSize);  // decoded above
  if (!r.Bytes(name_len, &m.name) || !r.Bytes(key_len, &m.remote_key)) return Malformed("truncated");
  m.lane_keys.resize(lane_keys);
  for (fabric::RemoteKey& k : m.lane_keys) {
    if (!r.Bytes(key_len, &k)) return Malformed("truncated lane key");
  }
  absl::InlinedVector<int64_t, 8> dims(rank);
  for (int64_t& d : dims) {
    if (!r.Get(&d)) return Malformed("truncated shape");
  }
  absl::StatusOr<TensorShape> shape = TensorShape::Create(dims);
  if (!shape.ok()) return Malformed(shape.status().message());
  m.meta.shape = *std::move(shape);
  std::string error_message;
  if (!r.Bytes(error_len, &error_message)) return Malformed("truncated error message");

  if (dtype != 0) {
    absl::StatusOr<DataType> d = DataTypeFromInt(dtype);
    if (!d.ok()) return Malformed(d.status().message());
    m.meta.dtype = *d;
    if (DataTypeCanMemCopy(m.meta.dtype) && !m.meta.is_dead) {
      uint64_t bytes;
      if (__builtin_mul_overflow(static_cast<uint64_t>(m.meta.shape.num_elements()),
                                 DataTypeSize(m.meta.dtype), &bytes) ||
          bytes != m.meta.tensor_bytes) {
        return Malformed(absl::StrCat(m.meta.tensor_bytes, " tensor bytes for ",
                                      DataTypeName(m.meta.dtype), m.meta.shape.DebugString()));
      }
    }
  }
  if (m.type == MessageType::kErrorStatus) {
    if (error_code == 0 || error_code > 16) {
      return Malformed(absl::StrCat("error status with code ", error_code));
    }
    m.error = absl::Status(static_cast<absl::StatusCode>(error_code), error_message);
  } else if (error_code != 0 || error_len != 0) {
    return Malformed(absl::StrCat(MessageTypeName(m.type), " carries an error status"));
  }
  if (m.type == MessageType::kTensorRequest && m.name.empty() && m.name_index == kNoNameIndex) {
    return Malformed(absl::StrCat(MessageTypeName(m.type), " without a rendezvous key or its index"));
  }
  if (m.type != MessageType::kTensorRequest && m.name_index != kNoNameIndex) {
    return Malformed(absl::StrCat(MessageTypeName(m.type), " carries a name index"));
  }
  if (absl::Status s = CheckSegmentBytes(m.type, m.segment_bytes); !s.ok()) {
    return Malformed(s.message());
  }
  if (more != nullptr) *more = more_field;
  return m;
}

size_t EncodedLength(absl::Span<const uint8_t> in) {
  Reader r(in);
  uint32_t version_type_sequence, used;
  if (!r.Get(&version_type_sequence) || !r.Get(&used)) return 0;
  return std::min<size_t>(Padded(used), in.size());
}

}  // namespace tensorverbs::protocol
