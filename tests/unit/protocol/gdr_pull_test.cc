// grpc+gdr's receiving side (GdrPull) over a real channel pair (channel_harness.h): a pull that
// reads nothing still tells the sender at once to drop the tensor it lent, so no tensor waits
// at the sender for its lease to end.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "tests/unit/protocol/channel_harness.h"

namespace tensorverbs::protocol::channel_testing {
namespace {

class GdrPullTest : public ChannelTest {
 protected:
  void Configure(ChannelEnv* env) override { env->mode = VerbsMode::kGdr; }
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
    owner_.channel->StartPull(ref, std::move(dest), deadline,
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
  owner_.channel->ExpireRequests(absl::Now());
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  // Issued when the channel connects: it reads nothing and releases the tensor at once.
  ASSERT_NO_FATAL_FAILURE(ConnectChannels());
  ASSERT_TRUE(Pump([&] { return !released_.empty(); }));
  Settle();
  EXPECT_EQ(released_, std::vector<uint32_t>{7});
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(owner_.channel->pending_requests(), 0u);
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);
}

TEST_F(GdrPullTest, ADestinationOfAnotherSizeFailsThePullAndReleasesTheTensor) {
  absl::Status status;
  int calls = 0;
  StartPull(Lent(11, 64), Floats(&owner_.pool, 4, 0.0f), absl::InfiniteFuture(), &status, &calls);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  ASSERT_TRUE(Pump([&] { return !released_.empty(); }));
  EXPECT_EQ(released_, std::vector<uint32_t>{11});
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);
}

class FullGdrPullTest : public GdrPullTest {
 protected:
  void Configure(ChannelEnv* env) override {
    GdrPullTest::Configure(env);
    env->max_pending_recvs = 0;  // every read is beyond the bound
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

}  // namespace
}  // namespace tensorverbs::protocol::channel_testing
