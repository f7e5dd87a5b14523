// The grpc+verbs control messages (seed 000, "Message structure") and their wire codec.
//
// RDMA_MESSAGE_TENSOR_REQUEST, _META_DATA_RESPONSE, _TENSOR_RE_REQUEST and _ERROR_STATUS travel
// as RDMA writes into the peer's message buffer, so everything here is untrusted input on
// receipt. Unlike TensorFlow's layout (a memcpy'd C++ TensorShape, an unchecked 512-byte name,
// host byte order, uninitialised padding) the codec is explicit: a version byte, little-endian
// fixed-width fields, rank plus int64 dims, bounded lengths checked on both sides, and padding
// zeroed (the receiver zeroes what it consumed, so the unused rest of a slot stays zero). A
// malformed message decodes to DataLoss naming the problem; it never crashes. Pure functions;
// any thread.
#ifndef TENSORVERBS_PROTOCOL_MESSAGE_H_
#define TENSORVERBS_PROTOCOL_MESSAGE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "src/fabric/fabric.h"
#include "src/fabric/rails.h"
#include "src/protocol/imm.h"
#include "tensorverbs/parsed_key.h"
#include "tensorverbs/tensor_shape.h"
#include "tensorverbs/types.h"

namespace tensorverbs::protocol {

// 2: a slot may carry a batch of messages (the `more` header field) and an ACK may free several
// slots (imm.h). 3: a REQUEST may name its key by a per-channel index (`name_index`), and only
// REQUESTs carry names. 4: a REQUEST or RE_REQUEST may ask for the content in segments, each
// ending with the immediate (`segment_bytes`). 5: a REQUEST or RE_REQUEST spreading the content
// over lanes gives each lane a share of the segments (`lane_shares`).
inline constexpr uint8_t kWireVersion = 5;
// Message::name_index when the message does not use one.
inline constexpr uint32_t kNoNameIndex = 0xFFFFFFFF;
// One message-buffer slot. The largest message (limits below, rank 254) fits alone.
inline constexpr size_t kMessageSize = 8192;
inline constexpr size_t kMaxNameLength = ParsedKey::kMaxKeyLength;  // rendezvous key bytes
inline constexpr size_t kMaxRemoteKeyLength = 64;       // opaque fabric key bytes
static_assert(kMaxRemoteKeyLength == fabric::RemoteKey::kCapacity);
inline constexpr size_t kMaxErrorMessageLength = 2048;  // longer messages are truncated
// The smallest content segment a receiver may ask for: it bounds the immediates one tensor
// costs (a segment is one more completion at the receiver).
inline constexpr uint32_t kMinSegmentBytes = 64 << 10;
// The most segments one tensor may be asked for in: a receiver asks for larger ones where its
// chunks would make more, and a sender refuses more.
inline constexpr uint64_t kMaxContentSegments = 16384;
// The most lanes one channel has (lane 0, which carries the control messages, and up to three
// more, each over a device or interface of its own): a REQUEST carries a key per further lane.
inline constexpr size_t kMaxLanes = 4;
static_assert(kMaxLanes - 1 == fabric::kMaxRails);
static_assert(kMaxLanes - 1 <= kMaxLaneDown, "a lane-down immediate per further lane");
// Message::lane_shares: lane k's share of each round of segments (stripes.h), lane 0 first;
// all zero: the segments go round the lanes evenly. A share fits a nibble of the header.
using LaneShares = std::array<uint8_t, kMaxLanes>;
inline constexpr uint8_t kMaxLaneShare = 15;
// Shares for a REQUEST with `lane_keys` further lanes: all zero, or lanes 0..lane_keys each
// 1..kMaxLaneShare and the rest zero. InvalidArgument naming the share otherwise.
absl::Status CheckLaneShares(const LaneShares& shares, size_t lane_keys);

enum class MessageType : uint8_t {
  kTensorRequest = 1,     // receiver -> sender
  kMetaDataResponse = 2,  // sender -> receiver
  kTensorReRequest = 3,   // receiver -> sender
  kErrorStatus = 4,       // sender -> receiver
};

const char* MessageTypeName(MessageType type);

// What the receiver needs to allocate the destination: dtype and shape for POD tensors, the
// serialized TensorProto size for strings, deadness.
struct TensorMetaData {
  DataType dtype = DataType::kInvalid;
  TensorShape shape;
  bool is_dead = false;
  uint64_t tensor_bytes = 0;

  friend bool operator==(const TensorMetaData& a, const TensorMetaData& b) {
    return a.dtype == b.dtype && a.shape == b.shape && a.is_dead == b.is_dead &&
           a.tensor_bytes == b.tensor_bytes;
  }
  friend bool operator!=(const TensorMetaData& a, const TensorMetaData& b) { return !(a == b); }
};

// Every field of the seed's table. Which fields matter depends on the type; the codec carries
// them all so the layout never depends on the type.
struct Message {
  MessageType type = MessageType::kTensorRequest;
  // Set by the message buffer: the sender's count of messages on this channel direction,
  // modulo 2^16. The receiver checks it to detect a fabric that broke posting order.
  uint16_t sequence = 0;
  std::string name;            // REQUEST: the rendezvous key (empty when name_index refers to it)
  // REQUEST: the key's index on this channel (seed 001's "names to indexes"). With a name, the
  // message defines the index (the next one, in order); without, it refers to a defined one.
  uint32_t name_index = kNoNameIndex;
  int64_t step_id = 0;
  uint32_t request_index = 0;
  uint64_t remote_addr = 0;    // REQUEST / RE_REQUEST: where the content goes
  fabric::RemoteKey remote_key;  // REQUEST / RE_REQUEST: the fabric's packed key for it
  uint64_t checksum = 0;       // META_DATA_RESPONSE in data-validation mode
  TensorMetaData meta;         // REQUEST: the receiver's cached copy; META_DATA_RESPONSE: current
  absl::Status error;          // ERROR_STATUS
  // REQUEST / RE_REQUEST with a destination: write the content in segments of this many bytes
  // (0, or at least kMinSegmentBytes), each ending with the immediate, so the receiver sees it
  // land piece by piece (ContentSegments). 0: one immediate, after the last byte.
  uint32_t segment_bytes = 0;
  // REQUEST / RE_REQUEST with segments, on a channel with lanes: the destination's key for lanes
  // 1, 2, ... (remote_key is lane 0's), each as long as remote_key. The sender spreads the
  // segments over them. Sent only to a peer that set up lanes, so an older peer never sees one.
  absl::InlinedVector<fabric::RemoteKey, kMaxLanes - 1> lane_keys;
  // With lane_keys: each lane's share of the segments (CheckLaneShares); all zero: even.
  LaneShares lane_shares{};
};

// How many content immediates a tensor of `tensor_bytes` written in segments of
// `segment_bytes` (0: one) costs: both sides count them alike.
inline uint64_t ContentSegments(uint64_t tensor_bytes, uint32_t segment_bytes) {
  if (segment_bytes == 0 || tensor_bytes <= segment_bytes) return 1;
  return (tensor_bytes + segment_bytes - 1) / segment_bytes;
}

// A slot holds one message or, batched, several back to back: each starts at a multiple of 8
// bytes and its header's `more` field counts the messages after it in the slot (0 for the last).
// The seed's layout is the one-message case.

// The bytes `m` takes in a slot (a multiple of 8). InvalidArgument if a field exceeds its bound,
// naming it.
absl::StatusOr<size_t> EncodedSize(const Message& m);

// Encodes `m` at the start of `out`, which must hold EncodedSize(m) bytes: exactly those are
// written, padding zero. `more`: the messages that follow it in the slot. InvalidArgument if a
// field exceeds its bound or `out` is too small.
absl::Status EncodeMessage(const Message& m, absl::Span<uint8_t> out, uint16_t more = 0);

// Decodes the message at the start of `in`; `*more` (if given) receives its `more` field.
// DataLoss naming what is wrong for anything malformed.
absl::StatusOr<Message> DecodeMessage(absl::Span<const uint8_t> in, uint16_t* more = nullptr);

// The bytes of the encoded message at the start of `in` (its header's used length rounded up to
// 8 and capped at `in`): where the next message of a batch starts, and what a receiver clears.
size_t EncodedLength(absl::Span<const uint8_t> in);

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_MESSAGE_H_
