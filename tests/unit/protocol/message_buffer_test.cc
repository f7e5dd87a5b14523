#include "src/protocol/message_buffer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <tuple>

#include "absl/strings/str_cat.h"
#include "src/fabric/loopback/loopback.h"
#include "src/protocol/imm.h"
#include "src/protocol/memory_mgr.h"

namespace tensorverbs::protocol {
namespace {

using fabric::Completion;
using fabric::CompletionKind;
using ::testing::HasSubstr;

Message Request(int i) {
  Message m;
  m.type = MessageType::kTensorRequest;
  m.name = absl::StrCat("key", i);
  m.step_id = i;
  m.request_index = static_cast<uint32_t>(i);
  return m;
}

// Two loopback domains with an endpoint each, connected to each other.
struct LoopbackPair {
  LoopbackPair() {
    a = *fabric::loopback::OpenLoopbackDomain({});
    b = *fabric::loopback::OpenLoopbackDomain({});
    ea = *a->CreateEndpoint();
    eb = *b->CreateEndpoint();
    EXPECT_TRUE(ea->Connect(eb->LocalAddress()).ok());
    EXPECT_TRUE(eb->Connect(ea->LocalAddress()).ok());
  }
  std::unique_ptr<fabric::Domain> a, b;
  std::unique_ptr<fabric::Endpoint> ea, eb;
};

// Two message buffers joined by loopback endpoints; the test plays both progress threads.
// Parameters: slots per side, the most messages A writes into one slot.
class MessageBufferTest : public ::testing::TestWithParam<std::tuple<int, int>> {
 protected:
  int slots() const { return std::get<0>(GetParam()); }
  int batch() const { return std::get<1>(GetParam()); }

  void SetUp() override {
    ma_ = *MessageBuffer::Create(a_, slots(), batch());
    mb_ = *MessageBuffer::Create(b_, slots());
    ASSERT_TRUE(ma_->Connect(ea_, mb_->rx_addr(), mb_->rx_key(), mb_->rx_slots()).ok());
    ASSERT_TRUE(mb_->Connect(eb_, ma_->rx_addr(), ma_->rx_key(), ma_->rx_slots()).ok());
  }

  // Drives both sides once, as a progress thread's turn: B handles every completion, then
  // acknowledges everything it decoded with one ACK. Returns the messages B decoded.
  std::vector<Message> Progress() {
    std::vector<Message> got;
    Completion c[64];
    size_t n = *a_->Poll(absl::MakeSpan(c));
    for (size_t i = 0; i < n; ++i) Handle(c[i], *ma_, nullptr);
    n = *b_->Poll(absl::MakeSpan(c));
    for (size_t i = 0; i < n; ++i) Handle(c[i], *mb_, &got);
    if (mb_->unacknowledged() > 0) {
      max_ack_ = std::max<uint64_t>(max_ack_, mb_->unacknowledged());
      EXPECT_TRUE(mb_->Acknowledge().ok());
    }
    return got;
  }

  void Handle(const Completion& c, MessageBuffer& m, std::vector<Message>* got) {
    ASSERT_TRUE(c.status.ok()) << c.status;
    if (c.kind == CompletionKind::kRemoteWriteImm) {
      if (ClassifyImm(c.imm) == ImmKind::kAck) {
        ASSERT_TRUE(m.OnAck(AckCount(c.imm)).ok());
      } else {
        ASSERT_EQ(c.imm, kImmControlMessage);
        std::vector<Message> slot;
        absl::Status s = m.OnControlMessage(&slot);
        ASSERT_TRUE(s.ok()) << s;
        ASSERT_GE(slot.size(), 1u);
        ASSERT_LE(slot.size(), static_cast<size_t>(batch()));
        max_per_slot_ = std::max(max_per_slot_, slot.size());
        ASSERT_NE(got, nullptr);
        for (Message& msg : slot) got->push_back(std::move(msg));
      }
    } else if (ContextTag(c.context) == OpTag::kMessage) {
      ASSERT_TRUE(m.OnMessageWritten(ContextValue(c.context)).ok());
    }
  }

  LoopbackPair pair_;
  fabric::Domain* const a_ = pair_.a.get();
  fabric::Domain* const b_ = pair_.b.get();
  fabric::Endpoint* const ea_ = pair_.ea.get();
  fabric::Endpoint* const eb_ = pair_.eb.get();
  std::unique_ptr<MessageBuffer> ma_, mb_;
  size_t max_per_slot_ = 0;
  uint64_t max_ack_ = 0;
};

TEST_P(MessageBufferTest, MessagesArriveInOrderWithAtMostSlotsInFlight) {
  constexpr int kMessages = 300;
  for (int i = 0; i < kMessages; ++i) ASSERT_TRUE(ma_->Send(Request(i)).ok());
  EXPECT_EQ(ma_->pending(), static_cast<size_t>(kMessages));
  EXPECT_EQ(ma_->sent(), static_cast<uint64_t>(slots()))
      << "only free slots are written, one message each while they are free";
  EXPECT_EQ(ma_->messages_sent(), static_cast<uint64_t>(slots()));
  std::vector<Message> received;
  for (int round = 0; round < 10 * kMessages && received.size() < kMessages; ++round) {
    EXPECT_LE(ma_->sent() - mb_->received(), static_cast<uint64_t>(slots()));
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
  EXPECT_EQ(ma_->messages_sent(), static_cast<uint64_t>(kMessages));
  EXPECT_EQ(mb_->messages_received(), static_cast<uint64_t>(kMessages));
  if (batch() > 1) {
    // The queue behind busy slots went out batched.
    EXPECT_EQ(max_per_slot_, static_cast<size_t>(batch()));
    EXPECT_LT(ma_->sent(), static_cast<uint64_t>(kMessages));
  } else {
    EXPECT_EQ(ma_->sent(), static_cast<uint64_t>(kMessages)) << "one message per slot";
  }
  if (slots() > 1) {
    EXPECT_GT(max_ack_, 1u) << "one ACK freed several slots";
  }
}

TEST_P(MessageBufferTest, BadAcksAndAnOutOfOrderMessageAreChannelErrors) {
  absl::Status s = ma_->OnAck(1);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("acknowledged 1"));
  ASSERT_TRUE(ma_->Send(Request(1)).ok());
  EXPECT_EQ(ma_->OnAck(2).code(), absl::StatusCode::kDataLoss) << "more slots than are out";
  EXPECT_EQ(ma_->OnAck(0).code(), absl::StatusCode::kDataLoss);
  std::vector<Message> got;
  for (int round = 0; round < 10 && got.empty(); ++round) got = Progress();
  ASSERT_EQ(got.size(), 1u);
  // Decoding the same slot twice (as a duplicated immediate would) finds it zeroed.
  std::vector<Message> again;
  EXPECT_EQ(mb_->OnControlMessage(&again).code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(again.empty());
  EXPECT_EQ(mb_->unacknowledged(), 0u);
  for (int round = 0; round < 10 && ma_->pending() > 0; ++round) Progress();
  ASSERT_EQ(ma_->pending(), 0u);
  EXPECT_TRUE(mb_->Acknowledge().ok()) << "nothing to acknowledge is not an error";
  Completion c[4];
  EXPECT_EQ(*a_->Poll(absl::MakeSpan(c)), 0u) << "and writes nothing";
}

TEST_P(MessageBufferTest, MessagesOfEveryTypeAndSizeShareASlot) {
  // Messages of different lengths (long keys, shapes, error text) pack back to back.
  std::vector<Message> sent;
  for (int i = 0; i < 3 * slots() + 40; ++i) {
    Message m = Request(i);
    m.name = std::string(1 + (i * 37) % 900, static_cast<char>('a' + i % 26));
    if (i % 3 == 1) {
      m.type = MessageType::kMetaDataResponse;
      m.meta.dtype = DataType::kFloat32;
      m.meta.shape = TensorShape::Of({i + 1, 3});
      m.meta.tensor_bytes = static_cast<uint64_t>(i + 1) * 3 * 4;
    } else if (i % 3 == 2) {
      m.type = MessageType::kErrorStatus;
      m.error = absl::NotFoundError(std::string(i * 11, 'e'));
    }
    sent.push_back(m);
    ASSERT_TRUE(ma_->Send(std::move(m)).ok());
  }
  std::vector<Message> received;
  for (int round = 0; round < 1000 && received.size() < sent.size(); ++round) {
    for (Message& m : Progress()) received.push_back(std::move(m));
  }
  ASSERT_EQ(received.size(), sent.size());
  for (size_t i = 0; i < sent.size(); ++i) {
    EXPECT_EQ(received[i].type, sent[i].type) << i;
    EXPECT_EQ(received[i].name, sent[i].name) << i;
    EXPECT_EQ(received[i].meta, sent[i].meta) << i;
    EXPECT_EQ(received[i].error, sent[i].error) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(SlotsAndBatches, MessageBufferTest,
                         ::testing::Combine(::testing::Values(1, 2, 8), ::testing::Values(1, 32)));

// A peer that writes a slot by hand: the receiver's checks on a batch.
class HandWrittenSlotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    mb_ = *MessageBuffer::Create(b_, 2);
    auto ma = *MessageBuffer::Create(a_, 2);
    ASSERT_TRUE(mb_->Connect(eb_, ma->rx_addr(), ma->rx_key(), 2).ok());
    slot_.assign(kMessageSize, 0);
    region_ = *a_->RegisterMemory(slot_.data(), slot_.size(), fabric::kAccessLocal);
  }

  // Encodes `messages` with the given `more` fields back to back and writes them into B's
  // next slot; returns what B's decode says.
  absl::Status WriteAndDecode(const std::vector<std::pair<Message, uint16_t>>& messages) {
    std::fill(slot_.begin(), slot_.end(), 0);
    size_t offset = 0;
    for (const auto& [m, more] : messages) {
      const size_t size = *EncodedSize(m);
      if (absl::Status s = EncodeMessage(m, absl::MakeSpan(slot_).subspan(offset, size), more);
          !s.ok()) {
        return s;
      }
      offset += size;
    }
    const fabric::RemoteBuffer target{
        mb_->rx_key(), mb_->rx_addr() + (mb_->received() % 2) * kMessageSize, kMessageSize};
    if (absl::Status s = ea_->PostWriteWithImm({region_.get(), slot_.data(), offset}, target,
                                               kImmControlMessage, 1);
        !s.ok()) {
      return s;
    }
    Completion c[8];
    for (int round = 0; round < 100; ++round) {
      a_->Poll(absl::MakeSpan(c)).IgnoreError();
      const size_t n = *b_->Poll(absl::MakeSpan(c));
      for (size_t i = 0; i < n; ++i) {
        if (c[i].kind == CompletionKind::kRemoteWriteImm) {
          std::vector<Message> out;
          absl::Status s = mb_->OnControlMessage(&out);
          if (s.ok()) {
            EXPECT_EQ(out.size(), messages.size());
          } else {
            EXPECT_TRUE(out.empty());
          }
          return s;
        }
      }
    }
    return absl::DeadlineExceededError("the write never landed");
  }

  Message WithSequence(int i, uint16_t sequence) {
    Message m = Request(i);
    m.sequence = sequence;
    return m;
  }

  LoopbackPair pair_;
  fabric::Domain* const a_ = pair_.a.get();
  fabric::Domain* const b_ = pair_.b.get();
  fabric::Endpoint* const ea_ = pair_.ea.get();
  fabric::Endpoint* const eb_ = pair_.eb.get();
  std::unique_ptr<MessageBuffer> mb_;
  std::vector<uint8_t> slot_;
  std::unique_ptr<fabric::MemoryRegion> region_;
};

TEST_F(HandWrittenSlotTest, AWellFormedBatchDecodes) {
  ASSERT_TRUE(
      WriteAndDecode({{WithSequence(0, 0), 2}, {WithSequence(1, 1), 1}, {WithSequence(2, 2), 0}})
          .ok());
  EXPECT_EQ(mb_->messages_received(), 3u);
  EXPECT_EQ(mb_->received(), 1u);
  EXPECT_TRUE(WriteAndDecode({{WithSequence(3, 3), 0}}).ok()) << "sequences run on";
}

TEST_F(HandWrittenSlotTest, ABatchThatContradictsItselfIsDataLoss) {
  absl::Status s = WriteAndDecode({{WithSequence(0, 0), 2}, {WithSequence(1, 1), 0}});
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("1 were announced"));
}

TEST_F(HandWrittenSlotTest, ABatchAnnouncingMoreThanItHoldsIsDataLoss) {
  absl::Status s = WriteAndDecode({{WithSequence(0, 0), 1}});
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("message 2 of a batch"));
}

TEST_F(HandWrittenSlotTest, AnOutOfOrderMessageInsideABatchIsDataLoss) {
  absl::Status s = WriteAndDecode({{WithSequence(0, 0), 1}, {WithSequence(1, 5), 0}});
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("arrived where 1 was expected"));
}

TEST_F(HandWrittenSlotTest, ABatchRunningPastItsSlotIsDataLoss) {
  // Long keys: four fill most of the slot; the last one announces a fifth.
  std::vector<std::pair<Message, uint16_t>> batch;
  for (int i = 0; i < 4; ++i) {
    Message m = WithSequence(i, static_cast<uint16_t>(i));
    m.name = std::string(kMaxNameLength - 72, 'k');  // 72: the header
    batch.push_back({m, static_cast<uint16_t>(4 - i)});
  }
  absl::Status s = WriteAndDecode(batch);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
}

TEST(MessageBuffer, RejectsBadSlotCountsBatchesAndPeerDescriptions) {
  auto d = *fabric::loopback::OpenLoopbackDomain({});
  EXPECT_FALSE(MessageBuffer::Create(d.get(), 0).ok());
  EXPECT_FALSE(MessageBuffer::Create(d.get(), 1025).ok());
  EXPECT_FALSE(MessageBuffer::Create(d.get(), 4, 0).ok());
  EXPECT_FALSE(MessageBuffer::Create(d.get(), 4, MessageBuffer::kMaxBatch + 1).ok());
  auto m = *MessageBuffer::Create(d.get(), 4);
  auto ep = *d->CreateEndpoint();
  EXPECT_EQ(m->Connect(ep.get(), 0, "key", 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m->Connect(ep.get(), 4096, "", 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m->Connect(ep.get(), 4096, "key", 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m->Connect(ep.get(), 4096, "key", 1025).code(), absl::StatusCode::kInvalidArgument);
}

TEST(RdmaMemoryMgr, RegistersEachPoolRegionOnceAndForgetsReleasedOnes) {
  auto d = *fabric::loopback::OpenLoopbackDomain({});
  PoolAllocator::Options options;
  options.region_bytes = 1 << 20;
  options.pretouch = false;
  PoolAllocator pool("test", options);
  RdmaMemoryMgr mgr(d.get(), &pool, fabric::kAccessRemoteWrite);
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
