#include "src/protocol/message_buffer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "src/fabric/loopback/loopback.h"
#include "src/protocol/imm.h"
#include "src/protocol/memory_mgr.h"

namespace tensorverbs::protocol {
namespace {

using fabric::Completion;
using fabric::CompletionKind;

// Two message buffers joined by loopback endpoints; the test plays both progress threads.
class MessageBufferTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    a_ = *fabric::loopback::OpenLoopbackDomain({});
    b_ = *fabric::loopback::OpenLoopbackDomain({});
    ea_ = *a_->CreateEndpoint();
    eb_ = *b_->CreateEndpoint();
    ASSERT_TRUE(ea_->Connect(eb_->LocalAddress()).ok());
    ASSERT_TRUE(eb_->Connect(ea_->LocalAddress()).ok());
    ma_ = *MessageBuffer::Create(a_.get(), GetParam());
    mb_ = *MessageBuffer::Create(b_.get(), GetParam());
    ASSERT_TRUE(ma_->Connect(ea_.get(), mb_->rx_addr(), mb_->rx_key(), mb_->rx_slots()).ok());
    ASSERT_TRUE(mb_->Connect(eb_.get(), ma_->rx_addr(), ma_->rx_key(), ma_->rx_slots()).ok());
  }

  // Drives both sides once; returns the messages B decoded.
  std::vector<Message> Progress() {
    std::vector<Message> got;
    Completion c[64];
    size_t n = *a_->Poll(absl::MakeSpan(c));
    for (size_t i = 0; i < n; ++i) Handle(c[i], *ma_, nullptr);
    n = *b_->Poll(absl::MakeSpan(c));
    for (size_t i = 0; i < n; ++i) Handle(c[i], *mb_, &got);
    return got;
  }

  void Handle(const Completion& c, MessageBuffer& m, std::vector<Message>* got) {
    ASSERT_TRUE(c.status.ok()) << c.status;
    if (c.kind == CompletionKind::kRemoteWriteImm) {
      if (c.imm == kImmAck) {
        ASSERT_TRUE(m.OnAck().ok());
      } else {
        ASSERT_EQ(c.imm, kImmControlMessage);
        absl::StatusOr<Message> msg = m.OnControlMessage();
        ASSERT_TRUE(msg.ok()) << msg.status();
        ASSERT_TRUE(m.Acknowledge().ok());
        ASSERT_NE(got, nullptr);
        got->push_back(*msg);
      }
    } else if (ContextTag(c.context) == OpTag::kMessage) {
      ASSERT_TRUE(m.OnMessageWritten(ContextValue(c.context)).ok());
    }
  }

  Message Request(int i) {
    Message m;
    m.type = MessageType::kTensorRequest;
    m.name = absl::StrCat("key", i);
    m.step_id = i;
    m.request_index = static_cast<uint32_t>(i);
    return m;
  }

  std::unique_ptr<fabric::Domain> a_, b_;
  std::unique_ptr<fabric::Endpoint> ea_, eb_;
  std::unique_ptr<MessageBuffer> ma_, mb_;
};

TEST_P(MessageBufferTest, MessagesArriveInOrderWithAtMostSlotsInFlight) {
  const int slots = GetParam();
  constexpr int kMessages = 300;
  for (int i = 0; i < kMessages; ++i) ASSERT_TRUE(ma_->Send(Request(i)).ok());
  EXPECT_EQ(ma_->pending(), static_cast<size_t>(kMessages));
  EXPECT_EQ(ma_->sent(), static_cast<uint64_t>(slots)) << "only free slots are written";
  std::vector<Message> received;
  for (int round = 0; round < 10 * kMessages && received.size() < kMessages; ++round) {
    EXPECT_LE(ma_->sent() - mb_->received(), static_cast<uint64_t>(slots));
    for (Message& m : Progress()) received.push_back(std::move(m));
  }
  ASSERT_EQ(received.size(), static_cast<size_t>(kMessages));
  for (int i = 0; i < kMessages; ++i) {
    EXPECT_EQ(received[i].name, absl::StrCat("key", i));
    EXPECT_EQ(received[i].request_index, static_cast<uint32_t>(i));
    EXPECT_EQ(received[i].sequence, static_cast<uint16_t>(i));
  }
  for (int round = 0; round < 10 && ma_->pending() > 0; ++round) Progress();
  EXPECT_EQ(ma_->pending(), 0u) << "every message was acknowledged";
}

TEST_P(MessageBufferTest, AnAckForNothingAndAnOutOfOrderMessageAreChannelErrors) {
  EXPECT_EQ(ma_->OnAck().code(), absl::StatusCode::kDataLoss);
  // Two messages; B's first decode reads slot 0. Corrupt the sequence expectation by decoding
  // the same slot twice (as a duplicated immediate would).
  ASSERT_TRUE(ma_->Send(Request(1)).ok());
  std::vector<Message> got;
  for (int round = 0; round < 10 && got.empty(); ++round) got = Progress();
  ASSERT_EQ(got.size(), 1u);
  absl::StatusOr<Message> again = mb_->OnControlMessage();
  EXPECT_EQ(again.status().code(), absl::StatusCode::kDataLoss) << "a consumed slot is zeroed";
  EXPECT_EQ(mb_->Acknowledge().code(), absl::StatusCode::kInternal)
      << "only received messages are acknowledged";
}

INSTANTIATE_TEST_SUITE_P(Slots, MessageBufferTest, ::testing::Values(1, 2, 8));

TEST(MessageBuffer, RejectsBadSlotCountsAndPeerDescriptions) {
  auto d = *fabric::loopback::OpenLoopbackDomain({});
  EXPECT_FALSE(MessageBuffer::Create(d.get(), 0).ok());
  EXPECT_FALSE(MessageBuffer::Create(d.get(), 1025).ok());
  auto m = *MessageBuffer::Create(d.get(), 4);
  auto ep = *d->CreateEndpoint();
  EXPECT_EQ(m->Connect(ep.get(), 0, "key", 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m->Connect(ep.get(), 4096, "", 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m->Connect(ep.get(), 4096, "key", 0).code(), absl::StatusCode::kInvalidArgument);
}

TEST(RdmaMemoryMgr, RegistersEachPoolRegionOnceAndForgetsReleasedOnes) {
  auto d = *fabric::loopback::OpenLoopbackDomain({});
  PoolAllocator::Options options;
  options.region_bytes = 1 << 20;
  options.pretouch = false;
  PoolAllocator pool("test", options);
  RdmaMemoryMgr mgr(d.get(), &pool);
  void* p = pool.AllocateRaw(4096);
  void* q = pool.AllocateRaw(8192);
  absl::StatusOr<const fabric::MemoryRegion*> r1 = mgr.FindRegistered(p, 4096);
  absl::StatusOr<const fabric::MemoryRegion*> r2 = mgr.FindRegistered(q, 8192);
  ASSERT_TRUE(r1.ok() && r2.ok());
  ASSERT_NE(*r1, nullptr);
  EXPECT_EQ(*r1, *r2) << "one registration per region";
  EXPECT_TRUE((*r1)->Contains(q, 8192));
  EXPECT_EQ(mgr.registered_regions(), 1u);
  int heap = 0;
  EXPECT_EQ(*mgr.FindRegistered(&heap, sizeof(heap)), nullptr) << "heap memory is not pool memory";
  pool.DeallocateRaw(p, 4096);
  pool.DeallocateRaw(q, 8192);
  EXPECT_EQ(pool.ReleaseFreeRegions(), 1u);
  void* z = pool.AllocateRaw(4096);
  ASSERT_TRUE(mgr.FindRegistered(z, 4096).ok());
  EXPECT_EQ(mgr.registered_regions(), 1u) << "the released region's registration was dropped";
  pool.DeallocateRaw(z, 4096);

  TensorMetaData meta;
  meta.dtype = DataType::kFloat32;
  EXPECT_EQ(mgr.CachedMeta("k"), nullptr);
  mgr.CacheMeta("k", meta);
  ASSERT_NE(mgr.CachedMeta("k"), nullptr);
  EXPECT_EQ(*mgr.CachedMeta("k"), meta);
}

}  // namespace
}  // namespace tensorverbs::protocol
