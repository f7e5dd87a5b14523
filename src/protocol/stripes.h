// How a tensor spread over a channel's lanes is cut. The receiver, which names the destination,
// gives each lane a share of the segments in proportion to the rate it last measured the lane
// at (SharesFromRates; the REQUEST carries the shares), and both ends go round the same
// pattern (StripePattern): the sender to choose each segment's lane, the receiver to know what
// each lane still owes when it checks for a stalled one. A lane twice as fast carries twice
// the bytes, so the lanes finish together instead of the fast one idling while the slow one
// ends the tensor. Pure values and functions; any thread.
#ifndef TENSORVERBS_PROTOCOL_STRIPES_H_
#define TENSORVERBS_PROTOCOL_STRIPES_H_

#include <array>
#include <cstddef>
#include <cstdint>

#include "absl/types/span.h"
#include "src/protocol/message.h"

namespace tensorverbs::protocol {

// Every lane carries at least two segments a round, so that its rate is measured again (the
// time between its first and last segment) and a lane that sped up wins its share back.
inline constexpr uint8_t kMinLaneShare = 2;
// Shares of a round per lane when the lanes are alike: a sixteenth of a tensor's bytes per
// share over two lanes, fine enough to follow a 2:1 difference to within 3%.
inline constexpr int kSharesPerLane = 8;

// Shares for lanes measured at `rates` (bytes per second, lane 0 first): about kSharesPerLane
// a lane on average, each in [kMinLaneShare, kMaxLaneShare]. All zero (even) when a rate is
// missing (<= 0), or for fewer than two lanes.
LaneShares SharesFromRates(absl::Span<const double> rates);

// The lane of each segment. Over `lanes` lanes with all-zero shares: segment i over lane
// i mod lanes. With shares: rounds of sum(shares) segments, lane k carrying shares[k] of each,
// interleaved (smooth weighted round robin), so that the lanes start together and a sender
// staging its source in parts feeds them all as the parts come.
class StripePattern {
 public:
  // `shares` must pass CheckLaneShares for `lanes` (1..kMaxLanes); else it is taken as even.
  StripePattern(size_t lanes, const LaneShares& shares);

  size_t LaneOf(uint64_t segment) const { return pattern_[segment % period_]; }
  // How many of segments 0 .. `segments` - 1 go over lane `lane`.
  uint64_t Due(size_t lane, uint64_t segments) const;
  // Segments in one round.
  size_t period() const { return period_; }

 private:
  size_t period_ = 1;
  std::array<uint8_t, kMaxLanes * kMaxLaneShare> pattern_{};
  std::array<uint8_t, kMaxLanes> per_round_{};
};

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_STRIPES_H_
