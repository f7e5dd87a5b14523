#include "src/protocol/stripes.h"

#include <algorithm>
#include <cmath>

namespace tensorverbs::protocol {

LaneShares SharesFromRates(absl::Span<const double> rates) {
  LaneShares shares{};
  if (rates.size() < 2 || rates.size() > kMaxLanes) return shares;
  double sum = 0;
  for (double r : rates) {
    if (!(r > 0) || !std::isfinite(r)) return shares;
    sum += r;
  }
  const double round = static_cast<double>(kSharesPerLane * rates.size());
  for (size_t k = 0; k < rates.size(); ++k) {
    const double share = std::round(round * rates[k] / sum);
    shares[k] = static_cast<uint8_t>(std::clamp<double>(share, kMinLaneShare, kMaxLaneShare));
  }
  return shares;
}

StripePattern::StripePattern(size_t lanes, const LaneShares& shares) {
  lanes = std::clamp<size_t>(lanes, 1, kMaxLanes);
  LaneShares weights = shares;
  if (lanes < 2 || !CheckLaneShares(shares, lanes - 1).ok() || weights[0] == 0) {
    weights = {};
    for (size_t k = 0; k < lanes; ++k) weights[k] = 1;
  }
  // Smooth weighted round robin: each step every lane gains its share, the lane furthest ahead
  // takes the segment and pays the round back, so a lane's segments spread through the round.
  int total = 0;
  for (size_t k = 0; k < lanes; ++k) total += weights[k];
  std::array<int, kMaxLanes> credit{};
  period_ = static_cast<size_t>(total);
  for (size_t i = 0; i < period_; ++i) {
    size_t best = 0;
    for (size_t k = 0; k < lanes; ++k) {
      credit[k] += weights[k];
      if (credit[k] > credit[best]) best = k;
    }
    credit[best] -= total;
    pattern_[i] = static_cast<uint8_t>(best);
    ++per_round_[best];
  }
}

uint64_t StripePattern::Due(size_t lane, uint64_t segments) const {
  if (lane >= kMaxLanes) return 0;
  uint64_t due = segments / period_ * per_round_[lane];
  const uint64_t rest = segments % period_;
  for (uint64_t i = 0; i < rest; ++i) due += pattern_[i] == lane ? 1 : 0;
  return due;
}

}  // namespace tensorverbs::protocol
