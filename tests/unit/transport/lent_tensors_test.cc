#include "src/transport/verbs/lent_tensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/time/time.h"
#include "src/fabric/fabric.h"
#include "src/protocol/channel_env.h"
#include "src/protocol/memory_mgr.h"
#include "src/tensor/allocator.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::verbs {
namespace {

using ::testing::HasSubstr;

// The one thing of its ChannelHost that LentTensors uses: quarantine, reported to `quarantine`.
class QuarantineHost final : public protocol::ChannelHost {
 public:
  void Post(absl::AnyInvocable<void() &&> task) override { ADD_FAILURE() << "unexpected Post"; }
  void Deliver(protocol::ProgressEngine::RecvDelivery delivery) override {
    ADD_FAILURE() << "unexpected Deliver";
  }
  void Quarantine(std::vector<Tensor> memory, absl::Time until) override {
    if (quarantine) quarantine(std::move(memory), until);
  }
  void ReleaseLent(const std::string& task, uint32_t tensor_key) override {}
  bool OnOwnerThread() const override { return true; }
  void Connect(const std::string& task, const std::string& address,
               const proto::ConnectRequest& request, ConnectAnswered answered) override {
    ADD_FAILURE() << "unexpected Connect";
  }

  std::function<void(std::vector<Tensor>, absl::Time)> quarantine;
};

// A grpc+gdr sender's memory (loopback fabric) and the ChannelEnv parts LentTensors reads.
class LentTensorsTest : public ::testing::Test {
 protected:
  LentTensorsTest()
      : domain_(*fabric::OpenDomain("loopback", {})),
        pool_("lending pool",
              PoolAllocator::Options{.region_bytes = size_t{1} << 20, .pretouch = false}),
        memory_(domain_.get(), &pool_, protocol::RemoteAccessFor(protocol::VerbsMode::kGdr)) {
    env_.memory = &memory_;
    env_.domain = domain_.get();
    env_.stats = &stats_;
    env_.transfer.max_responses = 64;
    env_.host = &host_;
  }

  Tensor PoolTensor() {
    return *Tensor::Allocate(&pool_, DataType::kFloat32, TensorShape::Of({256}));
  }

  const absl::Time lease_ = absl::Now() + absl::Hours(1);
  std::unique_ptr<fabric::Domain> domain_;
  PoolAllocator pool_;
  protocol::RdmaMemoryMgr memory_;
  protocol::VerbsStats stats_;
  QuarantineHost host_;
  protocol::ChannelEnv env_;
};

TEST_F(LentTensorsTest, KeysAreDrawnAtRandomSoAPeerCannotGuessTheNextLease) {
  absl::flat_hash_set<uint32_t> first, second;
  for (absl::flat_hash_set<uint32_t>* keys : {&first, &second}) {
    LentTensors lent(&env_);
    for (int i = 0; i < 32; ++i) {
      absl::StatusOr<protocol::RemoteTensorRef> ref =
          lent.Lend("/job:w/task:1", PoolTensor(), lease_);
      ASSERT_TRUE(ref.ok()) << ref.status();
      EXPECT_LE(ref->tensor_key, protocol::kMaxTensorKey);
      keys->insert(ref->tensor_key);
    }
    EXPECT_EQ(keys->size(), 32u) << "keys of live leases are distinct";
  }
  // Counted keys would be 0..31 in both runs; 32 random draws from 4 billion collide with a
  // probability of about 2^-22.
  int small = 0;
  for (uint32_t k : first) small += k < 1024 ? 1 : 0;
  EXPECT_LT(small, 4);
  int shared = 0;
  for (uint32_t k : first) shared += second.contains(k) ? 1 : 0;
  EXPECT_LT(shared, 4) << "a second sender does not repeat the first one's keys";
}

TEST_F(LentTensorsTest, OnlyTheRequesterEndsItsLease) {
  LentTensors lent(&env_);
  absl::StatusOr<protocol::RemoteTensorRef> ref = lent.Lend("/job:w/task:1", PoolTensor(), lease_);
  ASSERT_TRUE(ref.ok()) << ref.status();
  lent.Release("/job:w/task:2", ref->tensor_key);
  EXPECT_EQ(lent.size(), 1u) << "another task's release is ignored";
  EXPECT_EQ(stats_.dropped_imms.load(), 1);
  lent.Release("/job:w/task:1", ref->tensor_key ^ 1);
  EXPECT_EQ(lent.size(), 1u) << "a release of an unknown key is ignored";
  EXPECT_EQ(stats_.dropped_imms.load(), 2);
  lent.Release("/job:w/task:1", ref->tensor_key);
  EXPECT_EQ(lent.size(), 0u);
  lent.Release("/job:w/task:1", ref->tensor_key);
  EXPECT_EQ(stats_.dropped_imms.load(), 3) << "a second release finds nothing";
}

TEST_F(LentTensorsTest, AtMostMaxResponsesAreLentAndExpiredLeasesFreeTheirPlace) {
  LentTensors lent(&env_);
  const absl::Time soon = absl::Now() + absl::Seconds(1);
  for (int i = 0; i < env_.transfer.max_responses; ++i) {
    ASSERT_TRUE(lent.Lend("/job:w/task:1", PoolTensor(), i == 0 ? soon : lease_).ok());
  }
  absl::StatusOr<protocol::RemoteTensorRef> refused =
      lent.Lend("/job:w/task:1", PoolTensor(), lease_);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("TENSORVERBS_MAX_RESPONSES=64"));
  lent.Expire(soon);
  EXPECT_EQ(lent.size(), static_cast<size_t>(env_.transfer.max_responses - 1));
  EXPECT_TRUE(lent.Lend("/job:w/task:1", PoolTensor(), lease_).ok());
}

TEST_F(LentTensorsTest, ThePeerGoneEndsItsLeasesIntoQuarantineAndNoOneElses) {
  std::vector<Tensor> quarantined;
  absl::Time until;
  env_.transfer.peer_timeout = absl::Seconds(2);  // the quarantine
  host_.quarantine = [&](std::vector<Tensor> memory, absl::Time t) {
    for (Tensor& m : memory) quarantined.push_back(std::move(m));
    until = t;
  };
  LentTensors lent(&env_);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(lent.Lend("/job:w/task:1", PoolTensor(), lease_).ok());
  absl::StatusOr<protocol::RemoteTensorRef> other =
      lent.Lend("/job:w/task:2", PoolTensor(), lease_);
  ASSERT_TRUE(other.ok());
  EXPECT_TRUE(lent.Borrowers().contains("/job:w/task:1"));
  EXPECT_TRUE(lent.Borrowers().contains("/job:w/task:2"));
  EXPECT_FALSE(lent.Borrowers().contains("/job:w/task:3"));

  const absl::Time before = absl::Now();
  lent.EndLeasesOf("/job:w/task:1");
  EXPECT_EQ(lent.size(), 1u);
  EXPECT_FALSE(lent.Borrowers().contains("/job:w/task:1"));
  EXPECT_EQ(quarantined.size(), 3u) << "kept for a reader frozen mid-read, not freed";
  EXPECT_GE(until, before + absl::Seconds(2));
  lent.Release("/job:w/task:2", other->tensor_key);
  EXPECT_FALSE(lent.Borrowers().contains("/job:w/task:2"));
  EXPECT_TRUE(lent.empty());
}

TEST_F(LentTensorsTest, ALentTensorIsReadableAndNeverWritableByThePeer) {
  LentTensors lent(&env_);
  Tensor t = PoolTensor();
  absl::StatusOr<protocol::RemoteTensorRef> ref = lent.Lend("/job:w/task:1", t, lease_);
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(ref->addr, reinterpret_cast<uint64_t>(t.data())) << "pool memory is lent in place";
  EXPECT_EQ(ref->bytes, t.TotalBytes());

  std::unique_ptr<fabric::Domain> peer = *fabric::OpenDomain("loopback", {});
  std::unique_ptr<fabric::Endpoint> mine = *domain_->CreateEndpoint();
  std::unique_ptr<fabric::Endpoint> theirs = *peer->CreateEndpoint();
  ASSERT_TRUE(theirs->Connect(mine->LocalAddress()).ok());
  ASSERT_TRUE(mine->Connect(theirs->LocalAddress()).ok());
  std::vector<char> local(64);
  std::unique_ptr<fabric::MemoryRegion> local_region =
      *peer->RegisterMemory(local.data(), local.size(), fabric::kAccessLocal);
  const fabric::LocalBuffer buffer{local_region.get(), local.data(), local.size()};
  const fabric::RemoteBuffer remote{fabric::RemoteKey(ref->key), ref->addr, local.size()};
  EXPECT_EQ(theirs->PostWrite(buffer, remote, 1).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(theirs->PostRead(buffer, remote, 2).ok());
}

}  // namespace
}  // namespace tensorverbs::verbs
