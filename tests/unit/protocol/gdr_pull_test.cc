// grpc+gdr's receiving side (GdrPull) over a real channel pair (channel_harness.h): a pull that
// reads nothing still tells the sender at once to drop the tensor it lent, so no tensor waits
// at the sender for its lease to end.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tests/unit/protocol/channel_harness.h"

namespace tensorverbs::protocol::channel_testing {
namespace {

class GdrPullTest : public ChannelTest {
 protected:
  void Configure(ChannelEnv* env) override { env->options.mode = VerbsMode::kGdr; }
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(ChannelTest::SetUp());
    acceptor_.on_release_lent = [this](const std::string& task, uint32_t tensor_key) {
      EXPECT_EQ(task, owner_.worker.task_name);
      released_.push_back(tensor_key);
    };
  }
  // What a RecvTensor answer names: a tensor of `bytes` lent under `tensor_key`. The reads it
  // would take never happen in these tests.
  static RemoteTensorRef Lent(uint32_t tensor_key, uint64_t bytes) {
    RemoteTensorRef ref;
    ref.addr = 4096;
    ref.tensor_key = tensor_key;
    ref.bytes = bytes;
    return ref;
  }
  // Starts a pull whose outcome lands in `*status` (and counts in `*calls`).
  void StartPull(const RemoteTensorRef& ref, Tensor dest, absl::Time deadline, absl::Status* status,
                 int* calls) {
    owner_.channel->receiving()->StartPull(ref, std::move(dest), deadline,
                                           [status, calls](const absl::Status& s) {
                                             *status = s;
                                             ++*calls;
                                           });
  }
  std::vector<uint32_t> released_;
};

class UnconnectedGdrPullTest : public GdrPullTest {
 protected:
  bool ConnectOnSetUp() const override { return false; }
};

TEST_F(UnconnectedGdrPullTest, APullWhoseDeadlinePassedWhileQueuedReleasesTheTensor) {
  absl::Status status;
  int calls = 0;
  const Tensor dest = Floats(&owner_.pool, 4, 0.0f);
  StartPull(Lent(7, dest.TotalBytes()), dest, absl::Now() + absl::Milliseconds(1), &status, &calls);
  absl::SleepFor(absl::Milliseconds(2));
  owner_.channel->receiving()->ExpireRequests(absl::Now());
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  // Issued when the channel connects: it reads nothing and releases the tensor at once.
  ASSERT_NO_FATAL_FAILURE(ConnectChannels());
  ASSERT_TRUE(Pump([&] { return !released_.empty(); }));
  Settle();
  EXPECT_EQ(released_, std::vector<uint32_t>{7});
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 0u);
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);
}

TEST_F(GdrPullTest, ADestinationOfAnotherSizeFailsThePullAndReleasesTheTensor) {
  absl::Status status;
  int calls = 0;
  StartPull(Lent(11, 64), Floats(&owner_.pool, 4, 0.0f), absl::InfiniteFuture(), &status, &calls);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(RowsTaken::Took(PullStateTable(), GdrPull::State::kQueued, GdrPull::Event::kIssue,
                              GdrPull::State::kDone));
  ASSERT_TRUE(Pump([&] { return !released_.empty(); }));
  EXPECT_EQ(released_, std::vector<uint32_t>{11});
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);
}

// An answer naming a tensor of no bytes: nothing is read (no read would ever complete), the
// pull ends at once, and the tensor is released.
TEST_F(GdrPullTest, ALentTensorOfNoBytesEndsAtOnceAndIsReleased) {
  absl::Status status;
  int calls = 0;
  StartPull(Lent(11, 0), Floats(&owner_.pool, 0, 0.0f), absl::InfiniteFuture(), &status, &calls);
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(status.ok()) << status;
  ASSERT_TRUE(Pump([&] { return !released_.empty(); }));
  Settle();
  EXPECT_EQ(released_, std::vector<uint32_t>{11});
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 0u);
  EXPECT_FALSE(owner_.channel->receiving()->awaiting_peer()) << "no record left waiting for a read";
}

class FullGdrPullTest : public GdrPullTest {
 protected:
  void Configure(ChannelEnv* env) override {
    GdrPullTest::Configure(env);
    env->options.max_pending_recvs = 0;  // every read is beyond the bound
  }
};

TEST_F(FullGdrPullTest, AReadBeyondTheBoundIsRefusedAndItsTensorReleased) {
  absl::Status read_status, release_status;
  int read_calls = 0, release_calls = 0;
  StartPull(Lent(3, 16), Floats(&owner_.pool, 4, 0.0f), absl::InfiniteFuture(), &read_status,
            &read_calls);
  EXPECT_EQ(read_calls, 1);
  EXPECT_EQ(read_status.code(), absl::StatusCode::kResourceExhausted) << read_status;
  // A refused tensor: no destination, only the release.
  StartPull(Lent(5, 16), Tensor(), absl::InfiniteFuture(), &release_status, &release_calls);
  ASSERT_TRUE(Pump([&] { return released_.size() == 2; }));
  Settle();
  EXPECT_EQ(read_calls, 1);
  EXPECT_EQ(release_calls, 1);
  EXPECT_TRUE(release_status.ok()) << release_status;
  EXPECT_EQ(released_, (std::vector<uint32_t>{3, 5}));
}

using PullState = GdrPull::State;

using PullEvent = GdrPull::Event;

TEST(GdrPullTableTest, EveryRowIsWalkedByATest) {
  const char* const kRead =
      "UnconnectedReadingGdrPullTest.QueuedThenReadingThenDoneReleasesTheTensor";
  ExpectEveryRowWalked(
      PullStateTable(),
      {
          Walk(PullState::kQueued, PullEvent::kIssue, PullState::kReading, kRead),
          Walk(PullState::kQueued, PullEvent::kIssue, PullState::kDone,
               "GdrPullTest.ADestinationOfAnotherSizeFailsThePullAndReleasesTheTensor"),
          Walk(PullState::kQueued, PullEvent::kClose, PullState::kDone,
               "UnconnectedReadingGdrPullTest.CloseInQueuedEndsThePullOnce"),
          Walk(PullState::kReading, PullEvent::kReadDone, PullState::kDone, kRead),
          Walk(PullState::kReading, PullEvent::kClose, PullState::kDone,
               "ReadingGdrPullTest.CloseInReadingEndsThePullOnceAndQuarantinesItsDestination"),
      });
}

::testing::AssertionResult Took(PullState from, PullEvent event, PullState to) {
  return RowsTaken::Took(PullStateTable(), from, event, to);
}

// A tensor the acceptor's task really lends: registered for remote reads on its domain.
class ReadingGdrPullTest : public GdrPullTest {
 protected:
  RemoteTensorRef LendReal(uint32_t tensor_key) {
    region_ = *acceptor_.domain->RegisterMemory(lent_.data(), lent_.TotalBytes(),
                                                fabric::kAccessRemoteRead);
    RemoteTensorRef ref;
    ref.addr = reinterpret_cast<uint64_t>(lent_.data());
    ref.key = region_->PackRemoteKey().ToString();
    ref.tensor_key = tensor_key;
    ref.bytes = lent_.TotalBytes();
    return ref;
  }
  size_t InState(PullState s) const { return owner_.channel->receiving()->CountPulls(s); }

  const Tensor lent_ = Floats(&acceptor_.pool, 256, 1.5f);
  std::unique_ptr<fabric::MemoryRegion> region_;
};

class UnconnectedReadingGdrPullTest : public ReadingGdrPullTest {
 protected:
  bool ConnectOnSetUp() const override { return false; }
};

// kQueued -> kReading -> kDone: queued until the channel is ready, read, then released.
TEST_F(UnconnectedReadingGdrPullTest, QueuedThenReadingThenDoneReleasesTheTensor) {
  absl::Status status;
  int calls = 0;
  const Tensor dest = Floats(&owner_.pool, 256, 0.0f);
  StartPull(LendReal(9), dest, absl::InfiniteFuture(), &status, &calls);
  EXPECT_EQ(InState(PullState::kQueued), 1u);
  ASSERT_NO_FATAL_FAILURE(ConnectChannels());
  EXPECT_EQ(InState(PullState::kReading), 1u) << "issued when the channel became ready";
  ASSERT_TRUE(Pump([&] { return calls > 0 && !released_.empty(); }));
  Settle();
  EXPECT_EQ(calls, 1);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_TRUE(dest.ContentEquals(lent_));
  EXPECT_EQ(released_, std::vector<uint32_t>{9});
  EXPECT_EQ(InState(PullState::kQueued) + InState(PullState::kReading), 0u);
  EXPECT_TRUE(Took(PullState::kQueued, PullEvent::kIssue, PullState::kReading));
  EXPECT_TRUE(Took(PullState::kReading, PullEvent::kReadDone, PullState::kDone));
}

TEST_F(UnconnectedReadingGdrPullTest, CloseInQueuedEndsThePullOnce) {
  absl::Status status;
  int calls = 0;
  StartPull(LendReal(9), Floats(&owner_.pool, 256, 0.0f), absl::InfiniteFuture(), &status, &calls);
  ASSERT_EQ(InState(PullState::kQueued), 1u);
  owner_.channel->Close(absl::UnavailableError("the test closed the channel"));
  Settle();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_EQ(InState(PullState::kQueued), 0u);
  EXPECT_TRUE(Took(PullState::kQueued, PullEvent::kClose, PullState::kDone));
}

TEST_F(ReadingGdrPullTest, CloseInReadingEndsThePullOnceAndQuarantinesItsDestination) {
  absl::Status status;
  int calls = 0;
  const Tensor dest = Floats(&owner_.pool, 256, 0.0f);
  StartPull(LendReal(9), dest, absl::InfiniteFuture(), &status, &calls);
  ASSERT_EQ(InState(PullState::kReading), 1u) << "posted, not yet polled";
  owner_.channel->Close(absl::UnavailableError("the test closed the channel"));
  Settle();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_EQ(InState(PullState::kReading), 0u);
  size_t quarantined = 0;
  for (const Side::Quarantined& q : owner_.quarantined) {
    for (const Tensor& t : q.memory) quarantined += t.data() == dest.data();
  }
  EXPECT_EQ(quarantined, 1u) << "a read still in flight may write the destination";
  EXPECT_TRUE(Took(PullState::kReading, PullEvent::kClose, PullState::kDone));
}

}  // namespace
}  // namespace tensorverbs::protocol::channel_testing
