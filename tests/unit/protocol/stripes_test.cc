// StripePattern and SharesFromRates: which lane each segment of a spread tensor goes over, the
// same at both ends, and the shares the receiver asks for from the lanes' measured rates.
#include "src/protocol/stripes.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace tensorverbs::protocol {
namespace {

TEST(StripePatternTest, EvenSharesGoRoundTheLanes) {
  for (size_t lanes = 1; lanes <= kMaxLanes; ++lanes) {
    const StripePattern pattern(lanes, LaneShares{});
    EXPECT_EQ(pattern.period(), lanes);
    for (uint64_t i = 0; i < 50; ++i) EXPECT_EQ(pattern.LaneOf(i), i % lanes) << i;
    for (size_t lane = 0; lane < lanes; ++lane) {
      // Segments i < 10 with i mod lanes == lane.
      EXPECT_EQ(pattern.Due(lane, 10), (10 - lane + lanes - 1) / lanes) << lane;
    }
  }
}

TEST(StripePatternTest, EachLaneCarriesItsShareOfARoundInterleaved) {
  const LaneShares shares = {11, 5, 0, 0};
  const StripePattern pattern(2, shares);
  ASSERT_EQ(pattern.period(), 16u);
  std::vector<uint64_t> counted(kMaxLanes);
  size_t longest_run = 0;
  size_t run = 0;
  for (uint64_t i = 0; i < 3 * pattern.period() + 7; ++i) {
    const size_t lane = pattern.LaneOf(i);
    ASSERT_LT(lane, 2u);
    ++counted[lane];
    run = lane == 0 && i > 0 && pattern.LaneOf(i - 1) == 0 ? run + 1 : 1;
    longest_run = std::max(longest_run, run);
    // Due agrees with LaneOf over every prefix: what the receiver counts on is what goes.
    for (size_t l = 0; l < 2; ++l) EXPECT_EQ(pattern.Due(l, i + 1), counted[l]) << i;
  }
  EXPECT_EQ(pattern.Due(0, 16), 11u);
  EXPECT_EQ(pattern.Due(1, 16), 5u);
  EXPECT_EQ(pattern.Due(2, 16), 0u);
  EXPECT_LE(longest_run, 3u) << "lane 1's segments are spread through the round";
  EXPECT_EQ(pattern.LaneOf(0), 0u);

  const StripePattern four(4, {2, 3, 4, 5});
  EXPECT_EQ(four.period(), 14u);
  for (size_t lane = 0; lane < 4; ++lane) EXPECT_EQ(four.Due(lane, 14), lane + 2u);
}

TEST(StripePatternTest, SharesThatDoNotFitTheLanesAreTakenAsEven) {
  // A share for a lane beyond those given, a zero share, or one too many lanes.
  for (const LaneShares& bad : {LaneShares{3, 4, 5, 0}, LaneShares{3, 0, 0, 0}}) {
    const StripePattern pattern(2, bad);
    EXPECT_EQ(pattern.period(), 2u);
    EXPECT_EQ(pattern.LaneOf(3), 1u);
  }
  EXPECT_EQ(StripePattern(9, LaneShares{}).period(), kMaxLanes);
  EXPECT_EQ(StripePattern(0, LaneShares{}).period(), 1u);
}

TEST(SharesFromRatesTest, SharesFollowTheRatesWithinTheirBounds) {
  const std::vector<double> alike = {1e9, 1e9};
  EXPECT_EQ(SharesFromRates(alike), (LaneShares{kSharesPerLane, kSharesPerLane, 0, 0}));
  const std::vector<double> twice = {2e9, 1e9};
  EXPECT_EQ(SharesFromRates(twice), (LaneShares{11, 5, 0, 0}));
  const std::vector<double> three = {1e9, 1e9, 2e9};
  EXPECT_EQ(SharesFromRates(three), (LaneShares{6, 6, 12, 0}));
  // A lane far slower keeps two segments a round, so that it is measured again.
  const std::vector<double> far = {100e9, 1e6};
  EXPECT_EQ(SharesFromRates(far), (LaneShares{kMaxLaneShare, kMinLaneShare, 0, 0}));
  // A lane not measured yet, one lane, or a rate that is no number: even.
  const std::vector<double> unmeasured = {2e9, 0};
  EXPECT_EQ(SharesFromRates(unmeasured), LaneShares{});
  const std::vector<double> one = {2e9};
  EXPECT_EQ(SharesFromRates(one), LaneShares{});
  const std::vector<double> nan = {2e9, std::numeric_limits<double>::quiet_NaN()};
  EXPECT_EQ(SharesFromRates(nan), LaneShares{});
  // What it gives, a REQUEST carries.
  EXPECT_TRUE(CheckLaneShares(SharesFromRates(three), 2).ok());
  EXPECT_TRUE(CheckLaneShares(SharesFromRates(far), 1).ok());
}

}  // namespace
}  // namespace tensorverbs::protocol
