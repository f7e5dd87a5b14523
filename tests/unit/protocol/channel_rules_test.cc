// The channel's wire rules, driven directly over two loopback domains (channel_harness.h):
// keys named by index, messages that break the protocol or reach the wrong side, duplicated
// immediates, batching, and checksums. Each breach closes the channel with a reason that names
// the peer.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/unit/protocol/channel_harness.h"

namespace tensorverbs::protocol::channel_testing {
namespace {

using ::testing::HasSubstr;

TEST_F(ChannelTest, RequestReusingAPendingIndexClosesTheChannel) {
  Message m = Control(MessageType::kTensorRequest, Key("never sent"), 77);
  owner_.channel->SendMessage(m);
  owner_.channel->SendMessage(m);
  ASSERT_TRUE(Pump([&] { return acceptor_.channel->state() == Channel::State::kClosed; }));
  ExpectClosedWithDataLoss(acceptor_, "reused request index 77 while it was pending");
}

TEST_F(ChannelTest, KeysTravelByIndexAfterTheirFirstRequest) {
  // Seed 001's "names to indexes": a key's first REQUEST on the channel carries the key and
  // defines its index; every later one carries the index alone.
  for (int64_t step = 1; step <= 3; ++step) {
    for (const char* name : {"weights", "bias"}) {
      const Tensor sent = Floats(&acceptor_.pool, 32, static_cast<float>(step));
      std::shared_ptr<RecvOutcome> out = Transfer(step, Key(name), sent);
      ASSERT_TRUE(out->status.ok()) << name << " at step " << step << ": " << out->status;
      EXPECT_TRUE(out->tensor.ContentEquals(sent)) << name << " at step " << step;
    }
  }
  EXPECT_EQ(Get(owner_.stats.requests), 6);
  EXPECT_EQ(Get(owner_.stats.indexed_requests), 4) << "all but each key's first";
  EXPECT_EQ(Get(acceptor_.stats.errors_sent), 0);
}

TEST_F(ChannelTest, RequestByAnIndexNeverDefinedClosesTheChannel) {
  Message m = Control(MessageType::kTensorRequest, Key("unnamed"), 80);
  m.name.clear();
  m.name_index = 3;
  owner_.channel->SendMessage(m);
  ASSERT_TRUE(Pump([&] { return acceptor_.channel->state() == Channel::State::kClosed; }));
  ExpectClosedWithDataLoss(acceptor_, "asked for key index 3, which it never defined (0 defined)");
}

TEST_F(ChannelTest, AnIndexDefinedOutOfOrderClosesTheChannel) {
  Message m = Control(MessageType::kTensorRequest, Key("skipping"), 81);
  m.name_index = 5;
  owner_.channel->SendMessage(m);
  ASSERT_TRUE(Pump([&] { return acceptor_.channel->state() == Channel::State::kClosed; }));
  ExpectClosedWithDataLoss(acceptor_, "defined key index 5 out of order (expected 0)");
}

TEST_F(ChannelTest, ReRequestForAnUnknownRequestClosesTheChannel) {
  Message m = Control(MessageType::kTensorReRequest, Key("never asked"), 78);
  owner_.channel->SendMessage(m);
  ASSERT_TRUE(Pump([&] { return acceptor_.channel->state() == Channel::State::kClosed; }));
  ExpectClosedWithDataLoss(acceptor_,
                           absl::StrCat("RE_REQUEST from task ", TaskName(kJob, kOwnerTaskIndex),
                                        " for unknown request 78"));
}

TEST_F(ChannelTest, MetaDataResponseForARequestNotWaitingForOneClosesTheChannel) {
  const ParsedKey key = Key("described twice");
  // A fresh channel's first request has index 0 (RequestIndexAllocator counts up from 0).
  std::shared_ptr<RecvOutcome> out = StartRecv(1, key);
  Settle();
  Message m = Control(MessageType::kMetaDataResponse, key, 0);
  m.meta.dtype = DataType::kFloat32;
  m.meta.shape = TensorShape::Of({4});
  m.meta.tensor_bytes = 4 * sizeof(float);
  // The first moves the request on to RE_REQUEST; the second finds it no longer waiting.
  acceptor_.channel->SendMessage(m);
  acceptor_.channel->SendMessage(m);
  ASSERT_TRUE(Pump([&] { return owner_.channel->state() == Channel::State::kClosed; }));
  ExpectClosedWithDataLoss(owner_, "META_DATA_RESPONSE for request 0 that is not waiting for one");
  ASSERT_TRUE(Pump([&] { return out->calls > 0; }));
  Settle();
  EXPECT_EQ(out->calls, 1);
  EXPECT_EQ(out->status.code(), absl::StatusCode::kDataLoss);
}

TEST_F(ChannelTest, RequestSentToTheReceivingSideClosesTheChannel) {
  Message m = Control(MessageType::kTensorRequest, Key("backwards"), 5);
  acceptor_.channel->SendMessage(m);
  ASSERT_TRUE(Pump([&] { return owner_.channel->state() == Channel::State::kClosed; }));
  ExpectClosedWithDataLoss(owner_,
                           absl::StrCat("task ", TaskName(kJob, kAcceptorTaskIndex), " sent ",
                                        MessageTypeName(MessageType::kTensorRequest),
                                        " on a channel where it sends tensors"));
}

TEST_F(ChannelTest, AnswerSentToTheSendingSideClosesTheChannel) {
  Message m = Control(MessageType::kMetaDataResponse, Key("backwards"), 5);
  owner_.channel->SendMessage(m);
  ASSERT_TRUE(Pump([&] { return acceptor_.channel->state() == Channel::State::kClosed; }));
  ExpectClosedWithDataLoss(acceptor_,
                           absl::StrCat("task ", TaskName(kJob, kOwnerTaskIndex), " sent ",
                                        MessageTypeName(MessageType::kMetaDataResponse),
                                        " on a channel where it receives them"));
}

TEST_F(ChannelTest, ManyRecvsAtOnceBatchTheirMessagesAndAllArrive) {
  // Far more requests than message slots: they queue behind the busy slots and go out batched,
  // and every ACK frees what the peer decoded in its turn.
  constexpr int kRecvs = 300;
  std::vector<Tensor> sent;
  std::vector<std::shared_ptr<RecvOutcome>> got;
  for (int i = 0; i < kRecvs; ++i) {
    const ParsedKey key = Key(absl::StrCat("t", i));
    sent.push_back(Floats(&acceptor_.pool, 1 + i, static_cast<float>(i)));
    Send(1, key, sent.back());
    got.push_back(StartRecv(1, key));
  }
  ASSERT_TRUE(Pump([&] {
    for (const auto& g : got) {
      if (g->calls == 0) return false;
    }
    return true;
  }));
  Settle();
  for (int i = 0; i < kRecvs; ++i) {
    ASSERT_EQ(got[i]->calls, 1) << i;
    ASSERT_TRUE(got[i]->status.ok()) << i << ": " << got[i]->status;
    EXPECT_TRUE(got[i]->tensor.ContentEquals(sent[i])) << i;
  }
  // REQUEST and RE_REQUEST per recv one way, META_DATA_RESPONSE the other.
  EXPECT_EQ(Get(owner_.stats.control_messages), 2 * kRecvs);
  EXPECT_EQ(Get(acceptor_.stats.control_messages), kRecvs);
  EXPECT_LT(Get(owner_.stats.control_slots), Get(owner_.stats.control_messages));
  EXPECT_EQ(owner_.channel->message_buffer()->pending(), 0u);
  EXPECT_EQ(acceptor_.channel->message_buffer()->pending(), 0u);
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 0u);
}

TEST_F(ChannelTest, ADuplicatedContentImmediateIsDroppedNotDeliveredTwice) {
  const ParsedKey key = Key("once");
  ASSERT_TRUE(Transfer(1, key, Floats(&acceptor_.pool, 64, 1.0f))->status.ok());
  const Tensor sent = Floats(&acceptor_.pool, 64, 2.0f);
  Send(2, key, sent);
  std::shared_ptr<RecvOutcome> out = StartRecv(2, key);
  // With the meta-data cached, the sender's next write with an immediate is the content.
  ASSERT_TRUE(Pump([&] { return Get(owner_.stats.requests) == 2; }));
  fabric::loopback::SetFaults(acceptor_.domain.get(), {.duplicate_imm_nth = 1});
  ASSERT_TRUE(Pump([&] { return out->calls > 0; }));
  Settle();
  EXPECT_EQ(out->calls, 1);
  ASSERT_TRUE(out->status.ok()) << out->status;
  EXPECT_TRUE(out->tensor.ContentEquals(sent));
  EXPECT_EQ(Get(owner_.stats.dropped_imms), 1) << "the copy found no request and was counted";
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);
}

TEST_F(ChannelTest, ADuplicatedImmediateForContentThatAlreadyLandedIsDropped) {
  owner_.env.options.push = true;
  const ParsedKey key = Key("ahead");
  ASSERT_TRUE(Transfer(1, key, Floats(&acceptor_.pool, 64, 1.0f))->status.ok());
  // The recv of step 1 asked for step 2 ahead; once the sender has it, the content lands in
  // the pushed request before any recv wants it, and its immediate arrives twice.
  ASSERT_TRUE(Pump([&] { return Get(owner_.stats.pushed) == 1; }));
  Settle();
  fabric::loopback::SetFaults(acceptor_.domain.get(), {.duplicate_imm_nth = 1});
  const Tensor sent = Floats(&acceptor_.pool, 64, 2.0f);
  Send(2, key, sent);
  ASSERT_TRUE(Pump([&] { return Get(owner_.stats.dropped_imms) == 1; }))
      << "the copy finds a request whose content is in and is counted";
  std::shared_ptr<RecvOutcome> out = StartRecv(2, key);
  ASSERT_TRUE(Pump([&] { return out->calls > 0; }));
  Settle();
  EXPECT_EQ(out->calls, 1);
  ASSERT_TRUE(out->status.ok()) << out->status;
  EXPECT_TRUE(out->tensor.ContentEquals(sent));
  EXPECT_EQ(Get(owner_.stats.push_hits), 1);
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);
}

TEST_F(ChannelTest, DataValidationFailsACorruptedTransferWithDataLoss) {
  owner_.env.options.data_validation = true;
  acceptor_.env.options.data_validation = true;
  const ParsedKey key = Key("checked");
  const Tensor sent = Floats(&acceptor_.pool, 1000, 3.0f);
  std::shared_ptr<RecvOutcome> good = Transfer(1, key, sent);
  ASSERT_TRUE(good->status.ok()) << good->status;
  EXPECT_TRUE(good->tensor.ContentEquals(sent));

  Send(2, key, sent);
  std::shared_ptr<RecvOutcome> out = StartRecv(2, key);
  // Validation always takes the round trip (the checksum rides META_DATA_RESPONSE): once the
  // owner has sent RE_REQUEST, the sender's next write with an immediate is the content.
  ASSERT_TRUE(Pump([&] { return Get(owner_.stats.re_requests) == 2; }));
  fabric::loopback::SetFaults(acceptor_.domain.get(), {.corrupt_write_nth = 1});
  ASSERT_TRUE(Pump([&] { return out->calls > 0; }));
  Settle();
  EXPECT_EQ(out->calls, 1);
  EXPECT_EQ(out->status.code(), absl::StatusCode::kDataLoss) << out->status;
  EXPECT_THAT(std::string(out->status.message()), HasSubstr("checksum mismatch"));
  EXPECT_THAT(std::string(out->status.message()), HasSubstr(key.full_key));
  EXPECT_EQ(Get(owner_.stats.checksum_failures), 1);
  EXPECT_EQ(Get(owner_.stats.meta_cache_hits), 0);
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady) << "one recv failed, not the channel";
}

}  // namespace
}  // namespace tensorverbs::protocol::channel_testing
