#include "src/common/recurrence_filter.h"

#include <gtest/gtest.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "src/common/split_exact.h"

namespace tensorverbs {
namespace {

TEST(RecurrenceFilter, SaysANameWasSeenFromItsSecondSightingOn) {
  RecurrenceFilter filter(1024);
  EXPECT_FALSE(filter.SeenBefore("weights"));
  EXPECT_TRUE(filter.SeenBefore("weights"));
  EXPECT_TRUE(filter.SeenBefore("weights"));
  EXPECT_FALSE(filter.SeenBefore("bias"));
  EXPECT_TRUE(filter.SeenBefore("weights"));
  filter.Clear();
  EXPECT_FALSE(filter.SeenBefore("weights"));
}

// A stream of names used once each is (nearly) never taken for a repeated one, and names a loop
// repeats, fewer than the slots, are recognised again a step later despite that stream.
TEST(RecurrenceFilter, OneOffNamesAreNotTakenForRepeatedOnes) {
  RecurrenceFilter filter(1 << 14);
  int false_repeats = 0;
  for (int i = 0; i < 100000; ++i) {
    if (filter.SeenBefore(absl::StrCat("p2p/0/1/0/", i))) ++false_repeats;
  }
  // Two names share a slot and a 31-bit fingerprint with odds of about 1 in 2^31 each.
  EXPECT_LE(false_repeats, 1);
  int recognised = 0;
  for (int step = 0; step < 2; ++step) {
    for (int t = 0; t < 200; ++t) {
      if (filter.SeenBefore(absl::StrCat("layer", t, "/grad")) && step == 1) ++recognised;
    }
  }
  EXPECT_GE(recognised, 190) << "of 200, with 2^14 slots";
}

TEST(SplitExact, SplitsIntoExactlyTheCountAsked) {
  absl::string_view parts[3];
  ASSERT_TRUE(SplitExact("a;;c", ';', parts, 3));
  EXPECT_EQ(parts[0], "a");
  EXPECT_EQ(parts[1], "");
  EXPECT_EQ(parts[2], "c");
  ASSERT_TRUE(SplitExact(";;", ';', parts, 3));
  EXPECT_EQ(parts[2], "");
  EXPECT_FALSE(SplitExact("a;b", ';', parts, 3));
  EXPECT_FALSE(SplitExact("a;b;c;d", ';', parts, 3));
  EXPECT_FALSE(SplitExact("", ';', parts, 3));
  ASSERT_TRUE(SplitExact("", ';', parts, 1));
  EXPECT_EQ(parts[0], "");
}

}  // namespace
}  // namespace tensorverbs
