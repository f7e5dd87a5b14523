// A channel with a second lane (channel_harness.h's AddLane: a loopback domain per lane on each
// side, as VerbsTransport opens one per rail): a large tensor is spread over both lanes and
// lands whole once the lane's probe came back, a lane whose probe does not never carries one,
// and a lane that fails is taken out while the channel goes on over lane 0. Two
// ways a lane fails: the receiver hears nothing over it while segments are due (a link that
// went down under writes the sender's kernel had taken), or a write over it fails at the
// sender. Either way the tensor that was landing ends once with an error naming the lane,
// its destination is quarantined, and the next tensors arrive intact over lane 0.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "src/fabric/loopback/loopback.h"
#include "tests/unit/protocol/channel_harness.h"

namespace tensorverbs::protocol::channel_testing {
namespace {

using ::testing::HasSubstr;
using LaneState = RdmaTensorRequest::State;
using LaneEvent = RdmaTensorRequest::Event;

// 1.5 MiB of floats: above the 1 MiB stripe threshold, so asked for in eight segments, and two
// of them fit one of the harness's 4 MiB pool regions.
constexpr int64_t kLaneFloats = 3 << 17;

class LaneTest : public ChannelTest {
 protected:
  void Configure(ChannelEnv* env) override {
    if (env == &owner_.env) {
      owner_.AddLane();
    } else {
      acceptor_.AddLane();
    }
  }

  // Sends a striped tensor of `key` from the acceptor's pool and starts its recv.
  std::shared_ptr<RecvOutcome> SendAndRecv(int64_t step, const ParsedKey& key, float scale) {
    sent_ = Floats(&acceptor_.pool, kLaneFloats, scale);
    Send(step, key, sent_);
    return StartRecv(step, key);
  }

  void ExpectArrivedWhole(const RecvOutcome& out) {
    ASSERT_EQ(out.calls, 1);
    ASSERT_TRUE(out.status.ok()) << out.status;
    ASSERT_EQ(out.tensor.TotalBytes(), sent_.TotalBytes());
    EXPECT_EQ(std::memcmp(out.tensor.data(), sent_.data(), sent_.TotalBytes()), 0);
  }

  // Sends and receives a tensor of `key`, which must arrive whole.
  void TransferWhole(int64_t step, const ParsedKey& key, float scale) {
    std::shared_ptr<RecvOutcome> out = SendAndRecv(step, key, scale);
    ASSERT_TRUE(Pump([&] { return out->calls > 0; }));
    Settle();
    ASSERT_NO_FATAL_FAILURE(ExpectArrivedWhole(*out));
  }

  static void ExpectEndedNamingTheLane(const RecvOutcome& out, absl::string_view why) {
    EXPECT_EQ(out.calls, 1);
    EXPECT_EQ(out.status.code(), absl::StatusCode::kUnavailable) << out.status;
    EXPECT_THAT(std::string(out.status.message()), HasSubstr("lane 1 (loopback lane"));
    EXPECT_THAT(std::string(out.status.message()), HasSubstr(why));
  }

  size_t QuarantinedAtOwner() const {
    size_t n = 0;
    for (const Side::Quarantined& q : owner_.quarantined) n += q.memory.size();
    return n;
  }

  // The owner's housekeeping, the peer timeout after now: a lane that owes segments and was
  // silent that long is taken out.
  void CheckLanesLater() {
    owner_.channel->CheckLanes(absl::Now() + owner_.env.transfer.peer_timeout + absl::Seconds(1));
  }

  static ::testing::AssertionResult TookLaneRow(LaneState from, LaneEvent event, LaneState to) {
    return RowsTaken::Took(RequestStateTable(), from, event, to);
  }

  Tensor sent_;
};

TEST_F(LaneTest, ALargeTensorIsSpreadOverBothLanesAndLandsWhole) {
  ASSERT_NO_FATAL_FAILURE(TransferWhole(1, Key("spread"), 0.5f));
  EXPECT_EQ(Get(owner_.stats.striped_requests), 1);
  EXPECT_GT(Get(owner_.channel->counters().lane_segments_received[0]), 0);
  EXPECT_GT(Get(owner_.channel->counters().lane_segments_received[1]), 0);
  EXPECT_GT(Get(acceptor_.channel->counters().lane_bytes_sent[1]), 0);
  EXPECT_EQ(Get(acceptor_.channel->counters().lane_bytes_sent[0]) +
                Get(acceptor_.channel->counters().lane_bytes_sent[1]),
            static_cast<int64_t>(sent_.TotalBytes()));
}

// The receiver measured lane 0 at three times lane 1's rate: it asks for three quarters of the
// segments over lane 0, and the sender writes them so; the tensor lands whole.
TEST_F(LaneTest, EachLaneCarriesTheShareItsMeasuredRateEarns) {
  owner_.channel->NoteLaneRates({3e9, 1e9, 0, 0});
  ASSERT_EQ(owner_.channel->StripeShares(2), (LaneShares{12, 4, 0, 0}));
  ASSERT_NO_FATAL_FAILURE(TransferWhole(1, Key("shares"), 0.5f));
  const int64_t lane0 = Get(acceptor_.channel->counters().lane_bytes_sent[0]);
  const int64_t lane1 = Get(acceptor_.channel->counters().lane_bytes_sent[1]);
  EXPECT_EQ(lane0 + lane1, static_cast<int64_t>(sent_.TotalBytes()));
  // 1.5 MiB in 12 segments of 128 KiB, lane 1 taking 4 of each 16: 3 of these 12.
  EXPECT_EQ(lane1, 3 * (128 << 10));
  EXPECT_EQ(Get(owner_.channel->counters().lane_segments_received[1]), 3);
  EXPECT_EQ(owner_.channel->StripeShares(2), (LaneShares{12, 4, 0, 0}))
      << "a tensor that landed within kLaneRateMinSpan (loopback lanes) teaches nothing";

  // With TENSORVERBS_STRIPE_SHARES=even, the segments go round the lanes alike.
  owner_.env.options.stripe_by_rate = false;
  EXPECT_EQ(owner_.channel->StripeShares(2), LaneShares{});
  ASSERT_NO_FATAL_FAILURE(TransferWhole(2, Key("shares"), 1.5f));
  EXPECT_EQ(Get(acceptor_.channel->counters().lane_bytes_sent[1]) - lane1,
            static_cast<int64_t>(sent_.TotalBytes() / 2));
}

// A lane that owes its share (lane 1, measured the faster, carrying most segments) and falls
// silent is found by the same pattern the sender followed.
TEST_F(LaneTest, ASilentLaneIsFoundByItsShareOfTheSegments) {
  owner_.channel->NoteLaneRates({1e9, 3e9, 0, 0});
  fabric::loopback::SetFaults(owner_.lane_domain.get(), {.stalled = true});
  std::shared_ptr<RecvOutcome> out = SendAndRecv(1, Key("weighted"), 1.5f);
  ASSERT_TRUE(Pump([&] { return Get(owner_.channel->counters().lane_segments_received[0]) > 2; }));
  Settle();
  EXPECT_EQ(Get(owner_.channel->counters().lane_segments_received[0]), 3) << "lane 0's share";
  EXPECT_EQ(out->calls, 0);
  CheckLanesLater();
  Settle();
  ASSERT_NO_FATAL_FAILURE(ExpectEndedNamingTheLane(*out, "brought nothing"));
  EXPECT_EQ(owner_.channel->lanes(), 1u);
  ASSERT_NO_FATAL_FAILURE(TransferWhole(2, Key("weighted"), 2.5f));
}

// A lane whose probe never comes back (its link was down when the channel was made) carries
// no tensor: the large one goes over lane 0 alone and arrives whole.
class UnprobedLaneTest : public LaneTest {
 protected:
  bool ConnectOnSetUp() const override { return false; }
};

TEST_F(UnprobedLaneTest, ALaneWhoseProbeDoesNotComeBackCarriesNoTensor) {
  fabric::loopback::SetFaults(owner_.lane_domain.get(), {.stalled = true});
  wait_for_probes_ = false;
  ASSERT_NO_FATAL_FAILURE(ConnectChannels());
  Settle();
  EXPECT_EQ(owner_.channel->lanes(), 2u);
  EXPECT_EQ(owner_.channel->striping_lanes(), 1u) << "no echo came over lane 1";
  ASSERT_NO_FATAL_FAILURE(TransferWhole(1, Key("unprobed"), 0.25f));
  EXPECT_EQ(Get(owner_.stats.striped_requests), 0);
  EXPECT_EQ(Get(acceptor_.channel->counters().lane_bytes_sent[1]), 0);
  EXPECT_EQ(Get(acceptor_.channel->counters().lane_bytes_sent[0]),
            static_cast<int64_t>(sent_.TotalBytes()))
      << "lane 0 carried it all, and says so";
}

// A probe that cannot be written (the peer's probe word refused on lane 1) takes the lane out
// at once.
TEST_F(UnprobedLaneTest, AProbeWhoseWriteFailsTakesTheLaneOut) {
  fabric::loopback::SetFaults(owner_.lane_domain.get(), {.error_completion_nth = 1});
  wait_for_probes_ = false;
  ASSERT_NO_FATAL_FAILURE(ConnectChannels());
  Settle();
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);
  EXPECT_EQ(owner_.channel->lanes(), 1u);
  EXPECT_EQ(Get(owner_.stats.lanes_taken_out), 1);
  ASSERT_NO_FATAL_FAILURE(TransferWhole(1, Key("unprobed"), 0.75f));
}

// kReRequested --LaneLost--> kDone: the first tensor of a key takes the meta-data round trip,
// and its segments over lane 1 never show at the receiver.
TEST_F(LaneTest, ALaneSilentWhileSegmentsAreDueIsTakenOutAndTheChannelGoesOn) {
  fabric::loopback::SetFaults(owner_.lane_domain.get(), {.stalled = true});
  std::shared_ptr<RecvOutcome> out = SendAndRecv(1, Key("silent"), 1.5f);
  ASSERT_TRUE(Pump([&] { return Get(owner_.channel->counters().lane_segments_received[0]) > 0; }));
  Settle();
  EXPECT_EQ(out->calls, 0) << "lane 1's segments are still due";
  CheckLanesLater();
  Settle();
  ASSERT_NO_FATAL_FAILURE(ExpectEndedNamingTheLane(*out, "brought nothing"));
  EXPECT_TRUE(TookLaneRow(LaneState::kReRequested, LaneEvent::kLaneLost, LaneState::kDone));
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);
  EXPECT_EQ(owner_.channel->lanes(), 1u);
  EXPECT_EQ(owner_.channel->lane_endpoint(1), nullptr) << "nothing more lands over lane 1";
  EXPECT_EQ(Get(owner_.stats.lanes_taken_out), 1);
  EXPECT_EQ(QuarantinedAtOwner(), 1u) << "lane 0 may still write the destination";
  EXPECT_EQ(owner_.channel->receiving()->held_indexes(), 0u);

  // The next tensor asks for lane 0 alone, and arrives whole over the same channel.
  const int64_t lane1_before = Get(acceptor_.channel->counters().lane_bytes_sent[1]);
  ASSERT_NO_FATAL_FAILURE(TransferWhole(2, Key("silent"), 2.5f));
  EXPECT_EQ(Get(acceptor_.channel->counters().lane_bytes_sent[1]), lane1_before);
  EXPECT_EQ(Get(owner_.stats.channel_errors), 0);
  EXPECT_EQ(Get(acceptor_.stats.channel_errors), 0);
}

// A lane comes back only with a new channel (its endpoints made afresh and probed): once the
// back-off after the failure ran out, the owner gives its channel back while it is quiet, and
// the next recv sets one up with every lane.
TEST_F(LaneTest, AChannelThatLostALaneIsGivenBackOnceTheBackOffRanOut) {
  fabric::loopback::SetFaults(owner_.lane_domain.get(), {.stalled = true});
  std::shared_ptr<RecvOutcome> out = SendAndRecv(1, Key("back"), 1.5f);
  ASSERT_TRUE(Pump([&] { return Get(owner_.channel->counters().lane_segments_received[0]) > 0; }));
  Settle();
  CheckLanesLater();
  Settle();
  ASSERT_EQ(out->calls, 1);
  ASSERT_EQ(owner_.channel->lanes(), 1u);
  const auto keep = [](uint64_t) { return true; };  // the harness holds the channels
  const absl::Duration quiet = Channel::kLanesBackQuiet + absl::Milliseconds(50);
  // While the back-off runs (twice the peer timeout), the channel stays, quiet or not.
  const absl::Time soon = absl::Now();
  owner_.table.Housekeeping(soon, keep);
  owner_.table.Housekeeping(soon + quiet, keep);
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);
  // After it: given back, quiet since `soon` (for kLanesBackQuiet at least), not counted as a
  // failure.
  const absl::Time later = soon + 2 * owner_.env.transfer.peer_timeout + absl::Seconds(1);
  owner_.table.Housekeeping(later, keep);
  ASSERT_EQ(owner_.channel->state(), Channel::State::kClosed);
  EXPECT_EQ(owner_.channel->close_status().code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(std::string(owner_.channel->close_status().message()),
              HasSubstr("so that lane 1 comes back"));
  EXPECT_EQ(Get(owner_.stats.channels_renewed_for_lanes), 1);
  EXPECT_EQ(Get(owner_.stats.channel_errors), 0);
  // The acceptor's channel, which never lost its lane at its end, is not given back by it.
  acceptor_.table.Housekeeping(later, keep);
  acceptor_.table.Housekeeping(later + quiet, keep);
  EXPECT_EQ(acceptor_.channel->state(), Channel::State::kReady);
}

// A channel that lost no lane is never given back for one.
TEST_F(LaneTest, AChannelWithAllItsAgreedLanesIsKept) {
  ASSERT_NO_FATAL_FAILURE(TransferWhole(1, Key("kept"), 1.0f));
  const auto keep = [](uint64_t) { return true; };
  const absl::Time later = absl::Now() + absl::Minutes(1);
  owner_.table.Housekeeping(later, keep);
  owner_.table.Housekeeping(later + absl::Seconds(1), keep);
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);
  EXPECT_EQ(Get(owner_.stats.channels_renewed_for_lanes), 0);
}

// kRequested --LaneLost--> kDone: with the meta-data cached, REQUEST names the destination and
// its keys at once.
TEST_F(LaneTest, ALaneThatFallsSilentAfterServingIsTakenOutMidTensor) {
  ASSERT_NO_FATAL_FAILURE(TransferWhole(1, Key("later"), 1.0f));
  EXPECT_GT(Get(owner_.channel->counters().lane_segments_received[1]), 0);

  fabric::loopback::SetFaults(owner_.lane_domain.get(), {.stalled = true});
  const int64_t lane0 = Get(owner_.channel->counters().lane_segments_received[0]);
  std::shared_ptr<RecvOutcome> out = SendAndRecv(2, Key("later"), 3.0f);
  ASSERT_TRUE(
      Pump([&] { return Get(owner_.channel->counters().lane_segments_received[0]) > lane0; }));
  Settle();
  CheckLanesLater();
  Settle();
  ASSERT_NO_FATAL_FAILURE(ExpectEndedNamingTheLane(*out, "brought nothing"));
  EXPECT_TRUE(TookLaneRow(LaneState::kRequested, LaneEvent::kLaneLost, LaneState::kDone));
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);

  ASSERT_NO_FATAL_FAILURE(TransferWhole(3, Key("later"), 4.0f));
}

// A recv given a key for the lane that fails, whose tensor the sender does not hold yet, ends
// at once with the others; its record keeps the destination until the sender answers, which it
// does with ERROR_STATUS when its write over the lane the receiver dropped fails.
TEST_F(LaneTest, ARecvNotYetLandingEndsAtOnceAndItsRecordWaitsForItsSender) {
  ASSERT_NO_FATAL_FAILURE(TransferWhole(1, Key("waiting"), 1.0f));

  fabric::loopback::SetFaults(owner_.lane_domain.get(), {.stalled = true});
  // Its meta-data cached, the recv names its destination and lane keys at once; the sender
  // has no tensor for it yet.
  std::shared_ptr<RecvOutcome> waiting = StartRecv(2, Key("waiting"));
  const int64_t lane0 = Get(owner_.channel->counters().lane_segments_received[0]);
  std::shared_ptr<RecvOutcome> landing = SendAndRecv(2, Key("landing"), 2.0f);
  ASSERT_TRUE(
      Pump([&] { return Get(owner_.channel->counters().lane_segments_received[0]) > lane0; }));
  Settle();
  CheckLanesLater();
  Settle();
  ASSERT_NO_FATAL_FAILURE(ExpectEndedNamingTheLane(*landing, "brought nothing"));
  ASSERT_NO_FATAL_FAILURE(ExpectEndedNamingTheLane(*waiting, "brought nothing"));
  EXPECT_EQ(owner_.channel->receiving()->held_indexes(), 1u) << "the waiting recv's record";
  EXPECT_EQ(QuarantinedAtOwner(), 1u) << "the landing one's destination";

  // Its tensor comes: the sender's write over lane 1 fails, and its ERROR_STATUS ends the record.
  Send(2, Key("waiting"), Floats(&acceptor_.pool, kLaneFloats, 3.0f));
  ASSERT_TRUE(Pump([&] { return owner_.channel->receiving()->held_indexes() == 0; }));
  Settle();
  EXPECT_EQ(waiting->calls, 1) << "ended once";
  EXPECT_EQ(acceptor_.channel->lanes(), 1u);
  EXPECT_EQ(QuarantinedAtOwner(), 2u);
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);
  EXPECT_EQ(acceptor_.channel->state(), Channel::State::kReady);
}

// The sender sees a write over lane 1 fail (an error completion, as a queue pair whose port went
// down reports): it takes the lane out and tells the receiver over lane 0, and once its other
// writes are done the receiver hears ERROR_STATUS naming the lane. Both keep to lane 0.
TEST_F(LaneTest, AWriteThatFailsOverALaneEndsThatTensorAndTheSenderKeepsToLaneZero) {
  fabric::loopback::SetFaults(acceptor_.lane_domain.get(), {.error_completion_nth = 1});
  std::shared_ptr<RecvOutcome> out = SendAndRecv(1, Key("refused"), 1.0f);
  ASSERT_TRUE(Pump([&] { return out->calls > 0; }));
  Settle();
  ASSERT_NO_FATAL_FAILURE(ExpectEndedNamingTheLane(*out, "failed there"));
  EXPECT_EQ(acceptor_.channel->state(), Channel::State::kReady);
  EXPECT_EQ(acceptor_.channel->lanes(), 1u);
  EXPECT_EQ(Get(acceptor_.stats.lanes_taken_out), 1);
  EXPECT_EQ(Get(acceptor_.channel->counters().errors_sent), 1);
  EXPECT_EQ(acceptor_.channel->sending()->responses(), 0u);
  EXPECT_EQ(QuarantinedAtOwner(), 1u) << "lane 0's segments may be behind the ERROR_STATUS";
  // The sender said so over lane 0: the receiver took the lane out too.
  EXPECT_EQ(owner_.channel->lanes(), 1u);
  EXPECT_EQ(Get(owner_.stats.lanes_taken_out), 1);

  const int64_t lane1_before = Get(acceptor_.channel->counters().lane_bytes_sent[1]);
  ASSERT_NO_FATAL_FAILURE(TransferWhole(2, Key("refused"), 2.0f));
  EXPECT_EQ(Get(acceptor_.channel->counters().lane_bytes_sent[1]), lane1_before);
  EXPECT_EQ(Get(owner_.stats.striped_requests), 1) << "the second asked for lane 0 alone";
  EXPECT_EQ(Get(owner_.stats.channel_errors), 0);
  EXPECT_EQ(Get(acceptor_.stats.channel_errors), 0);
}

}  // namespace
}  // namespace tensorverbs::protocol::channel_testing
