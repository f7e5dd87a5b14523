// The torch backend's landing machines (python/src/torch/landings.h), without torch: every row
// of both tables walked and seen taken (the tables' tap), and the join raced from two threads:
// whichever order the release and the recv's end come in, the work completes exactly once, and
// a failed recv's only after the release.
#include "python/src/torch/landings.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "tests/support/state_rows.h"

namespace tensorverbs::torch_backend {
namespace {

using ::tensorverbs::testing::ExpectEveryRowWalked;
using ::tensorverbs::testing::RowsTaken;
using ::tensorverbs::testing::Walk;
using In = InPlaceLanding;
using Co = CollectiveLanding;

class LandingsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    RowsTaken::Clear();
    SetTransitionTap(&RowsTaken::Tap);
  }
  void TearDown() override {
    EXPECT_THAT(RowsTaken::Refused(), ::testing::IsEmpty()) << "moves that are no row";
    SetTransitionTap(nullptr);
  }
  static ::testing::AssertionResult Took(In::State from, In::Event event, In::State to) {
    return RowsTaken::Took(InPlaceLandingTable(), from, event, to);
  }
  static ::testing::AssertionResult Took(Co::State from, Co::Event event, Co::State to) {
    return RowsTaken::Took(CollectiveLandingTable(), from, event, to);
  }
};

TEST(LandingTables, EveryRowIsWalkedByATest) {
  const char* const kLanded = "LandingsTest.ARecvThatLandsCompletesAtOnceAndTheReleaseDrops";
  const char* const kEarly = "LandingsTest.AReleaseBeforeTheEndDropsAndTheEndCompletes";
  const char* const kFailed = "LandingsTest.AFailedRecvWaitsForTheReleaseWhichCompletesIt";
  ExpectEveryRowWalked(
      InPlaceLandingTable(),
      {
          Walk(In::State::kLent, In::Event::kReleased, In::State::kReleased, kEarly),
          Walk(In::State::kLent, In::Event::kRecvEnded, In::State::kLanded, kLanded),
          Walk(In::State::kLent, In::Event::kRecvEnded, In::State::kFailedHeld, kFailed),
          Walk(In::State::kReleased, In::Event::kRecvEnded, In::State::kDone, kEarly),
          Walk(In::State::kLanded, In::Event::kReleased, In::State::kDone, kLanded),
          Walk(In::State::kFailedHeld, In::Event::kReleased, In::State::kDone, kFailed),
      });
  auto co = [](Co::State from, Co::Event event, Co::State to) {
    return Walk(from, event, to,
                "LandingsTest.ACollectiveDestinationSettlesOnceWhicheverComesFirst");
  };
  ExpectEveryRowWalked(CollectiveLandingTable(),
                       {
                           co(Co::State::kWaiting, Co::Event::kLanded, Co::State::kSettled),
                           co(Co::State::kWaiting, Co::Event::kReleased, Co::State::kSettled),
                           co(Co::State::kSettled, Co::Event::kLanded, Co::State::kSettled),
                           co(Co::State::kSettled, Co::Event::kReleased, Co::State::kSettled),
                       });
}

TEST_F(LandingsTest, ARecvThatLandsCompletesAtOnceAndTheReleaseDrops) {
  In landing;
  EXPECT_EQ(landing.RecvEnded(absl::OkStatus()), In::Action::kLand);
  EXPECT_EQ(landing.Released(), In::Action::kDrop);
  EXPECT_EQ(landing.state(), In::State::kDone);
  EXPECT_TRUE(Took(In::State::kLent, In::Event::kRecvEnded, In::State::kLanded));
  EXPECT_TRUE(Took(In::State::kLanded, In::Event::kReleased, In::State::kDone));
}

TEST_F(LandingsTest, AReleaseBeforeTheEndDropsAndTheEndCompletes) {
  In landing;  // the task refused the memory, or let go of it early
  EXPECT_EQ(landing.Released(), In::Action::kDrop);
  EXPECT_EQ(landing.RecvEnded(absl::UnavailableError("gone")), In::Action::kLand)
      << "nothing writes the tensor any more: the failure completes the work at once";
  EXPECT_TRUE(Took(In::State::kLent, In::Event::kReleased, In::State::kReleased));
  EXPECT_TRUE(Took(In::State::kReleased, In::Event::kRecvEnded, In::State::kDone));
}

TEST_F(LandingsTest, AFailedRecvWaitsForTheReleaseWhichCompletesIt) {
  In landing;
  EXPECT_EQ(landing.RecvEnded(absl::UnavailableError("from rank 1: gone")), In::Action::kWatch);
  EXPECT_EQ(landing.Released(), In::Action::kFail);
  EXPECT_EQ(landing.failure().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(landing.failure().message(), "from rank 1: gone");
  EXPECT_TRUE(Took(In::State::kLent, In::Event::kRecvEnded, In::State::kFailedHeld));
  EXPECT_TRUE(Took(In::State::kFailedHeld, In::Event::kReleased, In::State::kDone));
}

TEST_F(LandingsTest, ACollectiveDestinationSettlesOnceWhicheverComesFirst) {
  Co landed_first, released_first;
  EXPECT_TRUE(landed_first.Settle(Co::Event::kLanded));
  EXPECT_FALSE(landed_first.Settle(Co::Event::kReleased));
  EXPECT_TRUE(released_first.Settle(Co::Event::kReleased));
  EXPECT_FALSE(released_first.Settle(Co::Event::kLanded));
  EXPECT_TRUE(Took(Co::State::kWaiting, Co::Event::kLanded, Co::State::kSettled));
  EXPECT_TRUE(Took(Co::State::kWaiting, Co::Event::kReleased, Co::State::kSettled));
  EXPECT_TRUE(Took(Co::State::kSettled, Co::Event::kLanded, Co::State::kSettled));
  EXPECT_TRUE(Took(Co::State::kSettled, Co::Event::kReleased, Co::State::kSettled));
}

// The release and the recv's end from two threads at once, many times: the work completes once
// (kLand, or kFail after a kWatch), and never at kWatch alone. What each thread was told is
// compared after both joined: a thread's own record of its answer may come after the other
// thread already acted on the machine.
TEST_F(LandingsTest, RacedFromTwoThreadsTheWorkCompletesExactlyOnce) {
  for (int round = 0; round < 2000; ++round) {
    In landing;
    const bool fails = round % 2 == 1;
    In::Action released = In::Action::kDrop, ended = In::Action::kLand;
    std::thread release([&] { released = landing.Released(); });
    std::thread end([&] {
      ended = landing.RecvEnded(fails ? absl::UnavailableError("gone") : absl::OkStatus());
    });
    release.join();
    end.join();
    const int completions =
        (ended == In::Action::kLand ? 1 : 0) + (released == In::Action::kFail ? 1 : 0);
    ASSERT_EQ(completions, 1) << "round " << round;
    if (released == In::Action::kFail) {
      ASSERT_EQ(ended, In::Action::kWatch) << "failed only after the end asked to wait";
    }
    ASSERT_EQ(landing.state(), In::State::kDone);
  }
}

}  // namespace
}  // namespace tensorverbs::torch_backend
