#include "src/protocol/imm.h"

#include <gtest/gtest.h>

#include <set>

namespace tensorverbs::protocol {
namespace {

TEST(Immediates, ReservedValues) {
  EXPECT_EQ(ClassifyImm(0xFFFFFFFF), ImmKind::kControlMessage);
  EXPECT_EQ(ClassifyImm(0xFFFFFFFE), ImmKind::kAck) << "the seed's ACK";
  EXPECT_EQ(ClassifyImm(0xFFFFFFFD), ImmKind::kAck);
  EXPECT_EQ(ClassifyImm(0xFFFFFBFF), ImmKind::kAck);
  EXPECT_EQ(ClassifyImm(0xFFFFFBFE), ImmKind::kRequest);
  EXPECT_EQ(kMaxRequestIndex, 0xFFFFFBFEu);
  EXPECT_EQ(ClassifyImm(0), ImmKind::kRequest);
}

TEST(Immediates, AcksCarryHowManySlotsTheyFree) {
  EXPECT_EQ(AckImm(1), kImmAck);
  EXPECT_EQ(AckImm(1), 0xFFFFFFFEu);
  for (uint32_t n : {1u, 2u, 8u, 1023u, kMaxAckCount}) {
    EXPECT_EQ(ClassifyImm(AckImm(n)), ImmKind::kAck) << n;
    EXPECT_EQ(AckCount(AckImm(n)), n);
  }
}

TEST(RequestIndexAllocator, WrapsWithoutReusingALiveIndex) {
  RequestIndexAllocator a(/*limit=*/8);
  std::vector<uint32_t> got;
  for (int i = 0; i < 8; ++i) got.push_back(*a.Allocate());
  EXPECT_EQ(got, (std::vector<uint32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(a.Allocate().status().code(), absl::StatusCode::kResourceExhausted);
  // Free 2 and 5; index 0 stays live across the wrap.
  EXPECT_TRUE(a.Release(2));
  EXPECT_TRUE(a.Release(5));
  EXPECT_EQ(*a.Allocate(), 2u);
  EXPECT_EQ(*a.Allocate(), 5u);
  EXPECT_FALSE(a.Allocate().ok());
  EXPECT_TRUE(a.IsLive(0));
}

TEST(RequestIndexAllocator, StaleAndUnknownIndexesAreReported) {
  RequestIndexAllocator a(16);
  uint32_t i = *a.Allocate();
  EXPECT_TRUE(a.Release(i));
  EXPECT_FALSE(a.Release(i)) << "released twice: stale";
  EXPECT_FALSE(a.Release(12)) << "never allocated: unknown";
  EXPECT_EQ(a.live(), 0u);
}

TEST(RequestIndexAllocator, LongRunsCycleThroughTheWholeSpace) {
  RequestIndexAllocator a(1000);
  std::set<uint32_t> seen;
  uint32_t held = *a.Allocate();  // one request that stays pending throughout
  for (int i = 0; i < 5000; ++i) {
    uint32_t x = *a.Allocate();
    ASSERT_NE(x, held);
    seen.insert(x);
    ASSERT_TRUE(a.Release(x));
  }
  EXPECT_EQ(seen.size(), 999u) << "every free index is used before any is reused";
  EXPECT_TRUE(a.IsLive(held));
}

TEST(RequestIndexAllocator, FullSpaceNeverHandsOutReservedImmediates) {
  RequestIndexAllocator a;  // 0 .. kMaxRequestIndex - 4
  for (int i = 0; i < 1000; ++i) {
    uint32_t x = *a.Allocate();
    ASSERT_LT(x, kMaxRequestIndex);
    ASSERT_TRUE(a.Release(x));
  }
  // The top request indexes are the lanes' probe and lane-down signals: never a request's.
  EXPECT_EQ(kImmLaneProbe, kMaxRequestIndex);
  EXPECT_EQ(a.limit(), uint64_t{LaneDownImm(kMaxLaneDown)});
  for (size_t lane = 1; lane <= kMaxLaneDown; ++lane) {
    EXPECT_EQ(LaneDownOf(LaneDownImm(lane)), lane);
  }
  EXPECT_EQ(LaneDownOf(kImmLaneProbe), 0u);
  EXPECT_EQ(LaneDownOf(LaneDownImm(kMaxLaneDown) - 1), 0u) << "a request index";
}

}  // namespace
}  // namespace tensorverbs::protocol
