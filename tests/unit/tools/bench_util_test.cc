#include "tools/bench_util.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace tensorverbs::tools {
namespace {

TEST(BenchUtil, SizeAndCountListsParseInOrderAndRejectBadItemsByName) {
  EXPECT_EQ(*ParseSizeList("4B, 4KiB,1MiB"), (std::vector<size_t>{4, 4096, 1 << 20}));
  EXPECT_FALSE(ParseSizeList("").ok());
  EXPECT_EQ(*ParseCountList("1,8, 32", "--slots", 1, 1024), (std::vector<int>{1, 8, 32}));
  EXPECT_TRUE(ParseCountList("", "--slots", 1, 1024)->empty());
  for (const char* bad : {"0", "1025", "x", "8,-1"}) {
    absl::StatusOr<std::vector<int>> got = ParseCountList(bad, "--slots", 1, 1024);
    ASSERT_FALSE(got.ok()) << bad;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(got.status().message()),
                ::testing::AllOf(::testing::HasSubstr("--slots: bad count"),
                                 ::testing::HasSubstr("(1..1024)")));
  }
}

TEST(BenchUtil, SpreadIsTheMedianAndRangeOfTheRepetitions) {
  Spread odd = SpreadOf({5.0, 1.0, 3.0});
  EXPECT_DOUBLE_EQ(odd.median, 3.0);
  EXPECT_DOUBLE_EQ(odd.min, 1.0);
  EXPECT_DOUBLE_EQ(odd.max, 5.0);
  Spread even = SpreadOf({4.0, 1.0, 2.0, 10.0});
  EXPECT_DOUBLE_EQ(even.median, 3.0);  // the mean of the middle two
  EXPECT_DOUBLE_EQ(even.max, 10.0);
  Spread none = SpreadOf({});
  EXPECT_DOUBLE_EQ(none.median, 0.0);
  EXPECT_EQ(FormatSpread(odd, 1, 3), "3.0 [1.0-5.0]");
  EXPECT_EQ(FormatSpread(odd, 2, 1), "3.00");  // one repetition has no range
}

}  // namespace
}  // namespace tensorverbs::tools
