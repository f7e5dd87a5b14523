// How the channel places memory, driven directly over two loopback domains
// (channel_harness.h): recvs queued before the channel connects, the registration strategies
// (pool, per transfer, copy) and their copies, and the bound on large destinations in flight.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/unit/protocol/channel_harness.h"

namespace tensorverbs::protocol::channel_testing {
namespace {

using ::testing::HasSubstr;

class UnconnectedChannelTest : public ChannelTest {
 protected:
  bool ConnectOnSetUp() const override { return false; }
};

TEST_F(UnconnectedChannelTest, RecvsStartedBeforeConnectWaitAndThoseThatEndedAreNeverSent) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  std::shared_ptr<RecvOutcome> waits = StartRecv(1, Key("a"));
  std::shared_ptr<RecvOutcome> aborted = StartRecv(2, Key("b"));
  std::shared_ptr<RecvOutcome> expired = StartRecv(3, Key("c"), deadline);
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 3u);

  owner_.channel->receiving()->AbortStep(2, absl::AbortedError("step 2 was aborted"));
  owner_.channel->receiving()->ExpireRequests(deadline + absl::Milliseconds(1));
  Settle();
  EXPECT_EQ(aborted->calls, 1);
  EXPECT_EQ(aborted->status.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(expired->calls, 1);
  EXPECT_EQ(expired->status.code(), absl::StatusCode::kUnavailable) << expired->status;
  EXPECT_THAT(std::string(expired->status.message()),
              HasSubstr("was not set up before the recv's deadline"));
  EXPECT_EQ(waits->calls, 0);
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 1u);

  const Tensor sent = Floats(&acceptor_.pool, 100, 1.0f);
  Send(1, Key("a"), sent);
  ASSERT_NO_FATAL_FAILURE(ConnectChannels());
  ASSERT_TRUE(Pump([&] { return waits->calls > 0; }));
  ASSERT_TRUE(waits->status.ok()) << waits->status;
  EXPECT_TRUE(waits->tensor.ContentEquals(sent));
  Settle();
  EXPECT_EQ(Get(owner_.stats.requests), 1) << "the recvs that ended while queued never went out";
  EXPECT_EQ(aborted->calls, 1);
  EXPECT_EQ(expired->calls, 1);
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 0u);
  // Nothing of theirs was left behind for a sender to write into.
  owner_.channel->Close(absl::CancelledError("test over"));
  EXPECT_TRUE(owner_.quarantined.empty());
}

TEST_F(ChannelTest, PoolRegistrationStagesMemoryOutsideThePoolOnceEachSide) {
  // Neither tensor is in a registered pool: the sender stages its source, the receiver lands
  // the content in a registered proxy and copies it out.
  const Tensor sent = Floats(CpuAllocator(), 5000, 0.5f);
  Send(1, Key("heap"), sent);
  std::shared_ptr<RecvOutcome> out =
      StartRecv(1, Key("heap"), absl::InfiniteFuture(), CpuAllocator());
  ASSERT_TRUE(Pump([&] { return out->calls > 0; }));
  ASSERT_TRUE(out->status.ok()) << out->status;
  EXPECT_TRUE(out->tensor.ContentEquals(sent));
  EXPECT_EQ(out->tensor.allocator(), CpuAllocator()) << "the caller's allocator, not the proxy's";
  EXPECT_EQ(Get(acceptor_.stats.copies), 1);
  EXPECT_EQ(Get(owner_.stats.copies), 1);
  EXPECT_EQ(Get(owner_.stats.copied_bytes), 5000 * static_cast<int64_t>(sizeof(float)));
  EXPECT_EQ(Get(owner_.transfer_stats.copies), 1) << "counted for the worker too";
}

// The designs a transport can run, with the copies and registrations each makes per recv of a
// float tensor (from and into pool memory).
struct Strategy {
  const char* name;
  VerbsMode mode;
  Registration registration;
  int64_t copies_per_side;
  int64_t transient_registrations_per_side;
};

void PrintTo(const Strategy& s, std::ostream* os) { *os << s.name; }

class StrategyTest : public ChannelTest, public ::testing::WithParamInterface<Strategy> {
 protected:
  void Configure(ChannelEnv* env) override {
    env->options.mode = GetParam().mode;
    env->options.registration = GetParam().registration;
  }
};

TEST_P(StrategyTest, DeliversIntactTensorsWithTheDesignsCopies) {
  const Strategy& strategy = GetParam();
  const ParsedKey key = Key("layer");
  constexpr int64_t kElements = 20000;
  constexpr int64_t kBytes = kElements * sizeof(float);
  for (int64_t step = 1; step <= 2; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    const Tensor sent = Floats(&acceptor_.pool, kElements, static_cast<float>(step));
    std::shared_ptr<RecvOutcome> out = Transfer(step, key, sent);
    ASSERT_TRUE(out->status.ok()) << out->status;
    EXPECT_FALSE(out->is_dead);
    EXPECT_TRUE(out->tensor.ContentEquals(sent));
    for (const Side* side : {&owner_, &acceptor_}) {
      SCOPED_TRACE(side == &owner_ ? "receiver" : "sender");
      EXPECT_EQ(Get(side->stats.copies), step * strategy.copies_per_side);
      EXPECT_EQ(Get(side->stats.copied_bytes), step * strategy.copies_per_side * kBytes);
      EXPECT_EQ(Get(side->stats.transient_registrations),
                step * strategy.transient_registrations_per_side);
    }
  }
  // The second step reused what the first learned (the cached meta-data, or in copy mode the
  // receiver's buffer for the name): one META_DATA_RESPONSE in all.
  EXPECT_EQ(Get(acceptor_.stats.meta_responses), 1);
  EXPECT_EQ(Get(owner_.stats.re_requests), 1);

  // Strings and dead tensors go through every design too.
  Tensor strings = Tensor::Make(DataType::kString, TensorShape::Of({2}));
  strings.strings()[0] = "first";
  strings.strings()[1] = std::string(9000, 'y');
  std::shared_ptr<RecvOutcome> got_strings = Transfer(3, Key("names"), strings);
  ASSERT_TRUE(got_strings->status.ok()) << got_strings->status;
  EXPECT_TRUE(got_strings->tensor.ContentEquals(strings));
  Send(3, Key("nothing"), Tensor(), /*is_dead=*/true);
  std::shared_ptr<RecvOutcome> dead = StartRecv(3, Key("nothing"));
  ASSERT_TRUE(Pump([&] { return dead->calls > 0; }));
  ASSERT_TRUE(dead->status.ok()) << dead->status;
  EXPECT_TRUE(dead->is_dead);

  Settle();
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 0u);
  EXPECT_EQ(acceptor_.channel->sending()->responses_in_progress(), 0u);
  EXPECT_EQ(Get(owner_.stats.channel_errors) + Get(acceptor_.stats.channel_errors), 0);
}

INSTANTIATE_TEST_SUITE_P(
    Designs, StrategyTest,
    ::testing::Values(
        Strategy{"ZeroCopyPool", VerbsMode::kZeroCopy, Registration::kPool, 0, 0},
        // Seed 002: laid out in the sender's buffer, copied out of the receiver's.
        Strategy{"CopyMode", VerbsMode::kCopy, Registration::kPool, 1, 0},
        // Each buffer pinned for its transfer: no copies, one registration a side.
        Strategy{"PerTransfer", VerbsMode::kZeroCopy, Registration::kPerTransfer, 0, 1},
        // Nothing but staging buffers is registered: one staging copy a side.
        Strategy{"CopyRegistration", VerbsMode::kZeroCopy, Registration::kCopy, 1, 0}),
    [](const ::testing::TestParamInfo<Strategy>& info) { return info.param.name; });

TEST_F(ChannelTest, PerTransferRegistrationMovesMemoryOutsideThePoolWithoutCopies) {
  owner_.env.options.registration = Registration::kPerTransfer;
  acceptor_.env.options.registration = Registration::kPerTransfer;
  const Tensor sent = Floats(CpuAllocator(), 5000, 0.75f);
  Send(1, Key("heap"), sent);
  std::shared_ptr<RecvOutcome> out =
      StartRecv(1, Key("heap"), absl::InfiniteFuture(), CpuAllocator());
  ASSERT_TRUE(Pump([&] { return out->calls > 0; }));
  ASSERT_TRUE(out->status.ok()) << out->status;
  EXPECT_TRUE(out->tensor.ContentEquals(sent));
  EXPECT_EQ(Get(owner_.stats.copies) + Get(acceptor_.stats.copies), 0);
  EXPECT_EQ(Get(owner_.stats.transient_registrations), 1);
  EXPECT_EQ(Get(acceptor_.stats.transient_registrations), 1);
}

// Large destinations (ChannelEnv::large_in_flight): 128 KiB counts as large here, and a
// channel hands its sender one such destination for a ready tensor at a time (plus one named
// in a REQUEST from the cached meta-data).
class LargeDestinationTest : public ChannelTest {
 protected:
  static constexpr int64_t kElements = 32768;  // 128 KiB of floats
  void Configure(ChannelEnv* env) override {
    env->options.large_bytes = uint64_t{64} << 10;
    env->options.large_in_flight = 1;
  }

  // Sends `count` large tensors in `step` and receives them all at once. Each callback checks
  // its tensor and lets go of it, so the owner's live pool allocations are the destinations
  // the sender may write plus results not yet handed to their callback. Returns the peak.
  size_t ReceiveAtOnce(int64_t step, int count) {
    std::vector<ParsedKey> keys;
    for (int i = 0; i < count; ++i) {
      keys.push_back(Key(absl::StrCat("layer", i)));
      Send(step, keys.back(), Floats(&acceptor_.pool, kElements, static_cast<float>(step + i)));
    }
    auto landed = std::make_shared<int>(0);
    for (int i = 0; i < count; ++i) {
      const Tensor expected = Floats(CpuAllocator(), kElements, static_cast<float>(step + i));
      owner_.channel->receiving()->StartRecv(
          step, keys_.Intern(keys[i]), &owner_.pool, RecvLanding(), absl::InfiniteFuture(),
          [landed, expected, i](const absl::Status& s, const Tensor& t, bool) {
            EXPECT_TRUE(s.ok()) << "recv " << i << ": " << s;
            EXPECT_TRUE(t.ContentEquals(expected)) << "recv " << i;
            ++*landed;
          });
    }
    size_t peak = 0;
    EXPECT_TRUE(Pump([&] {
      peak = std::max(peak, owner_.pool.GetStats().allocations);
      return *landed == count;
    }));
    Settle();
    EXPECT_EQ(*landed, count);
    EXPECT_EQ(owner_.pool.GetStats().allocations, 0u);
    return peak;
  }
};

TEST_F(LargeDestinationTest, ManyLargeRecvsHoldAFewDestinationsAtATimeAndAllLand) {
  constexpr int kRecvs = 8;
  // No meta-data cached: every REQUEST goes without a destination, and the sender's answers
  // get one each as the one before lands (one live destination, and one result on its way to
  // its callback).
  EXPECT_LE(ReceiveAtOnce(1, kRecvs), 2u);
  EXPECT_EQ(Get(owner_.stats.re_requests), kRecvs);
  // Cached: the first REQUEST names its destination, the other seven ask and wait.
  EXPECT_LE(ReceiveAtOnce(2, kRecvs), 3u);
  EXPECT_EQ(Get(owner_.stats.meta_cache_hits), 1);
  EXPECT_EQ(Get(owner_.stats.re_requests), 2 * kRecvs - 1);
  // Without the limit, every cached REQUEST names its destination at once.
  owner_.env.options.large_in_flight = 0;
  EXPECT_GE(ReceiveAtOnce(3, kRecvs), static_cast<size_t>(kRecvs));
  EXPECT_EQ(Get(owner_.stats.meta_cache_hits), 1 + kRecvs);
  EXPECT_EQ(Get(owner_.stats.channel_errors) + Get(acceptor_.stats.channel_errors), 0);
}

// The sender produces C, then B once C has arrived, then A once B has: a limit that counted
// A's destination (named in its REQUEST before A existed) against B and C would never let
// them land.
TEST_F(LargeDestinationTest, ALargeRecvWhoseTensorComesLaterNeverHoldsUpOnesThatAreReady) {
  const ParsedKey a = Key("a"), b = Key("b"), c = Key("c");
  for (const ParsedKey* key : {&a, &b, &c}) {  // caches their meta-data
    ASSERT_TRUE(Transfer(1, *key, Floats(&acceptor_.pool, kElements, 1.0f))->status.ok());
  }
  std::shared_ptr<RecvOutcome> got_a = StartRecv(2, a);
  std::shared_ptr<RecvOutcome> got_b = StartRecv(2, b);
  std::shared_ptr<RecvOutcome> got_c = StartRecv(2, c);
  Settle();
  const Tensor sent_c = Floats(&acceptor_.pool, kElements, 3.0f);
  Send(2, c, sent_c);
  ASSERT_TRUE(Pump([&] { return got_c->calls > 0; }));
  EXPECT_TRUE(got_c->status.ok()) << got_c->status;
  EXPECT_TRUE(got_c->tensor.ContentEquals(sent_c));
  const Tensor sent_b = Floats(&acceptor_.pool, kElements, 2.0f);
  Send(2, b, sent_b);
  ASSERT_TRUE(Pump([&] { return got_b->calls > 0; }));
  EXPECT_TRUE(got_b->status.ok()) << got_b->status;
  EXPECT_TRUE(got_b->tensor.ContentEquals(sent_b));
  const Tensor sent_a = Floats(&acceptor_.pool, kElements, 1.5f);
  Send(2, a, sent_a);
  ASSERT_TRUE(Pump([&] { return got_a->calls > 0; }));
  EXPECT_TRUE(got_a->status.ok()) << got_a->status;
  EXPECT_TRUE(got_a->tensor.ContentEquals(sent_a));
  Settle();
  EXPECT_EQ(got_a->calls + got_b->calls + got_c->calls, 3);
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 0u);
}

// A recv that ends while it waits for a large destination answers the sender at once, without
// a destination, so the sender lets go of its tensor; the recv it waited behind still lands.
TEST_F(LargeDestinationTest, ARecvAbortedWhileWaitingForADestinationReleasesTheSendersTensor) {
  const ParsedKey first = Key("first"), second = Key("second");
  const Tensor sent_first = Floats(&acceptor_.pool, kElements, 1.0f);
  Send(1, first, sent_first);
  Send(2, second, Floats(&acceptor_.pool, kElements, 2.0f));
  std::shared_ptr<RecvOutcome> got_first = StartRecv(1, first);
  std::shared_ptr<RecvOutcome> waiting = StartRecv(2, second);
  // Both answers came in one batch: the first got the grant, the second waits for it.
  ASSERT_TRUE(Pump([&] { return Get(owner_.stats.re_requests) > 0; }));
  EXPECT_EQ(Get(acceptor_.stats.meta_responses), 2);
  EXPECT_EQ(Get(owner_.stats.re_requests), 1);
  owner_.channel->receiving()->AbortStep(2, absl::AbortedError("step 2 was aborted"));
  EXPECT_EQ(Get(owner_.stats.re_requests), 2) << "released at once, not behind the first";
  Settle();
  EXPECT_EQ(waiting->calls, 1);
  EXPECT_EQ(waiting->status.code(), absl::StatusCode::kAborted) << waiting->status;
  ASSERT_EQ(got_first->calls, 1);
  EXPECT_TRUE(got_first->status.ok()) << got_first->status;
  EXPECT_TRUE(got_first->tensor.ContentEquals(sent_first));
  EXPECT_EQ(Get(acceptor_.stats.content_bytes), kElements * static_cast<int64_t>(sizeof(float)));
  EXPECT_FALSE(acceptor_.channel->sending()->holds_state_for_peer()) << "the sender let go of both";
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 0u);
}

}  // namespace
}  // namespace tensorverbs::protocol::channel_testing
