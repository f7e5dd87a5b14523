// The 32-bit immediate space of grpc+verbs writes (seed 000): 0xFFFFFFFF marks a control
// message, the values just below it ACKs, every other value names a pending request by its
// index, but the top four, which are the lanes' probe and lane-down signals. The seed has one ACK
// value (0xFFFFFFFE) that frees one message slot; here an ACK frees `count` slots at once (imm =
// 0xFFFFFFFF - count, count 1 .. kMaxAckCount), so a receiver that decoded several slots in one
// turn answers them with one write. 0xFFFFFFFE is still "one".
//
// RequestIndexAllocator hands out indexes for a channel's pending requests: it wraps around
// the index space and never hands out an index that is still live, so a late content write can
// never be taken for a newer request's. Release tells an unknown or stale index (to be counted
// and dropped) from a live one. Used on the channel's progress thread only.
#ifndef TENSORVERBS_PROTOCOL_IMM_H_
#define TENSORVERBS_PROTOCOL_IMM_H_

#include <cstddef>
#include <cstdint>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"

namespace tensorverbs::protocol {

inline constexpr uint32_t kImmControlMessage = 0xFFFFFFFF;
// A message buffer has at most 1024 slots, so one ACK never frees more.
inline constexpr uint32_t kMaxAckCount = 1024;
inline constexpr uint32_t kImmAck = kImmControlMessage - 1;  // frees one slot
inline constexpr uint32_t kMaxRequestIndex = kImmControlMessage - kMaxAckCount - 1;
// Over a further lane (only content and probes go there), the probe that proves the lane
// (Channel::ProbeLanes): the top request index, which RequestIndexAllocator never hands out.
inline constexpr uint32_t kImmLaneProbe = kMaxRequestIndex;
// Over lane 0, from a sender whose write over further lane `lane` (1 .. kMaxLaneDown) failed:
// it took that lane out, and so does the receiver (Channel::TakeLanesOut). The request indexes
// just below the probe, which the allocator never hands out either.
inline constexpr uint32_t kMaxLaneDown = 3;
inline uint32_t LaneDownImm(size_t lane) { return kImmLaneProbe - static_cast<uint32_t>(lane); }
// The lane a lane-down immediate names, or 0 when `imm` is none.
inline size_t LaneDownOf(uint32_t imm) {
  return imm < kImmLaneProbe && imm >= kImmLaneProbe - kMaxLaneDown ? kImmLaneProbe - imm : 0;
}

enum class ImmKind { kControlMessage, kAck, kRequest };

inline ImmKind ClassifyImm(uint32_t imm) {
  if (imm == kImmControlMessage) return ImmKind::kControlMessage;
  if (imm > kMaxRequestIndex) return ImmKind::kAck;
  return ImmKind::kRequest;
}

// The immediate of an ACK that frees `count` slots (1 .. kMaxAckCount) and back.
inline uint32_t AckImm(uint32_t count) { return kImmControlMessage - count; }
inline uint32_t AckCount(uint32_t imm) { return kImmControlMessage - imm; }

class RequestIndexAllocator {
 public:
  // Indexes 0 .. limit-1 (tests use a small limit to exercise wrapping); by default every
  // request index but the lanes' (kImmLaneProbe and the lane-down immediates).
  explicit RequestIndexAllocator(uint64_t limit = kImmLaneProbe - kMaxLaneDown);

  // ResourceExhausted when every index is live.
  absl::StatusOr<uint32_t> Allocate();
  // False for an index that is not live (unknown or stale): the caller counts and drops it.
  bool Release(uint32_t index);
  bool IsLive(uint32_t index) const { return live_.contains(index); }
  uint64_t limit() const { return limit_; }
  size_t live() const { return live_.size(); }

 private:
  const uint64_t limit_;
  uint64_t next_ = 0;
  absl::flat_hash_set<uint32_t> live_;
};

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_IMM_H_
