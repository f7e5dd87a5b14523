// RdmaTensorResponse's state machine, driven through a real channel pair (channel_harness.h):
// every row of its table (tensor_response.cc) walked by the protocol itself and seen taken, and a
// close of the sender's channel in every state a response rests in, after which the channel holds
// nothing and a late tensor or completion finds no one.
//
// kDone is where a record ends: the sending side finishes it in the same loop turn, so it
// never rests there and there is no close to test in it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "tests/support/stand_in_device.h"
#include "tests/unit/protocol/channel_harness.h"

namespace tensorverbs::protocol::channel_testing {
namespace {

using ::testing::HasSubstr;
using State = RdmaTensorResponse::State;

constexpr State kEveryState[] = {State::kWaitTensor, State::kWaitReRequest, State::kWriting,
                                 State::kDone};
static_assert(std::size(kEveryState) == RdmaTensorResponse::kStates);

using Event = RdmaTensorResponse::Event;

TEST(ResponseTableTest, EveryRowIsWalkedByATest) {
  const char* const kRoundTrip =
      "ResponseMachineTest.WaitTensorThenWaitReRequestThenWritingThenDone";
  ExpectEveryRowWalked(
      ResponseStateTable(),
      {
          Walk(State::kWaitTensor, Event::kTensor, State::kWriting,
               "ResponseMachineTest.WaitTensorStraightToWritingWhenTheRequestNamedADestination"),
          Walk(State::kWaitTensor, Event::kTensor, State::kDone,
               "ResponseMachineTest.WaitTensorToDoneWhenTheSendersStepIsAborted"),
          Walk(State::kWaitTensor, Event::kTensor, State::kWaitReRequest, kRoundTrip),
          Walk(State::kWaitTensor, Event::kCancel, State::kDone,
               "ResponseMachineTest.CloseInWaitTensorCancelsTheWaitAndALateTensorFindsNoOne"),
          Walk(State::kWaitReRequest, Event::kReRequest, State::kWriting, kRoundTrip),
          Walk(State::kWaitReRequest, Event::kExpire, State::kDone,
               "ExpiringResponseMachineTest.WaitReRequestToDoneWhenTheReceiverNeverAsks"),
          Walk(State::kWaitReRequest, Event::kStaged, State::kDone,
               "StagedResponseTest.WaitReRequestToDoneWhenAPartFailsToStage"),
          Walk(State::kWaitReRequest, Event::kCancel, State::kDone,
               "ResponseMachineTest.CloseInWaitReRequestLetsTheTensorGo"),
          Walk(State::kWriting, Event::kStaged, State::kDone,
               "StagedResponseTest.WritingToDoneWhenAPartFailsToStageWithNoWriteInFlight"),
          Walk(State::kWriting, Event::kWriteDone, State::kDone, kRoundTrip),
          Walk(State::kWriting, Event::kWriteRefused, State::kDone,
               "ResponseMachineTest.WritingToDoneWhenTheNamedDestinationCannotBeWritten"),
          Walk(State::kWriting, Event::kCancel, State::kDone,
               "ResponseMachineTest.CloseInWritingIgnoresTheWritesCompletion"),
      });
}

::testing::AssertionResult Took(State from, Event event, State to) {
  return RowsTaken::Took(ResponseStateTable(), from, event, to);
}

using CensusMap = std::map<State, size_t>;

class ResponseMachineTest : public ChannelTest {
 protected:
  // Responses of the acceptor's channel in each state; only non-zero entries.
  CensusMap Census() const {
    CensusMap out;
    for (State s : kEveryState) {
      if (size_t n = acceptor_.channel->sending()->CountResponses(s); n > 0) out[s] = n;
    }
    return out;
  }
  ::testing::AssertionResult ReachState(State s) {
    return Pump([&] { return acceptor_.channel->sending()->CountResponses(s) == 1; });
  }
  // The sender's channel closes; afterwards it holds nothing for its peer.
  void CloseAcceptor() {
    acceptor_.channel->Close(absl::UnavailableError("the test closed the channel"));
    Settle();
    EXPECT_TRUE(Census().empty()) << "a closed channel keeps no response";
    EXPECT_EQ(acceptor_.channel->sending()->responses_in_progress(), 0u);
    EXPECT_FALSE(acceptor_.channel->sending()->holds_state_for_peer());
    EXPECT_EQ(acceptor_.local_tensors.open_tickets(), 0u);
  }
};

// kWaitTensor -> kWaitReRequest -> kWriting -> kDone: the recv comes before the tensor and has
// no cached meta-data, so the sender answers with META_DATA_RESPONSE.
TEST_F(ResponseMachineTest, WaitTensorThenWaitReRequestThenWritingThenDone) {
  const ParsedKey k = Key("k");
  std::shared_ptr<RecvOutcome> recv = StartRecv(1, k);
  ASSERT_TRUE(ReachState(State::kWaitTensor));
  Settle();
  EXPECT_EQ(Census(), (CensusMap{{State::kWaitTensor, 1}}));
  EXPECT_EQ(acceptor_.local_tensors.open_tickets(), 1u);
  const Tensor sent = Floats(&acceptor_.pool, 100, 2.0f);
  Send(1, k, sent);
  ASSERT_TRUE(ReachState(State::kWaitReRequest));
  EXPECT_EQ(Get(acceptor_.stats.meta_responses), 1);
  ASSERT_TRUE(ReachState(State::kWriting));
  ASSERT_TRUE(Pump([&] { return recv->calls > 0; }));
  Settle();
  ASSERT_TRUE(recv->status.ok()) << recv->status;
  EXPECT_TRUE(recv->tensor.ContentEquals(sent));
  EXPECT_TRUE(Census().empty());
  EXPECT_EQ(Get(acceptor_.stats.content_writes), 1);
  EXPECT_TRUE(Took(State::kWaitTensor, Event::kTensor, State::kWaitReRequest));
  EXPECT_TRUE(Took(State::kWaitReRequest, Event::kReRequest, State::kWriting));
  EXPECT_TRUE(Took(State::kWriting, Event::kWriteDone, State::kDone));
}

// kWaitTensor -> kWriting -> kDone: with the meta-data cached, REQUEST names a destination the
// tensor fits, so the sender writes as soon as the tensor is there.
TEST_F(ResponseMachineTest, WaitTensorStraightToWritingWhenTheRequestNamedADestination) {
  const ParsedKey k = Key("k");
  ASSERT_TRUE(Transfer(1, k, Floats(&acceptor_.pool, 100, 1.0f))->status.ok());
  const int64_t meta_responses = Get(acceptor_.stats.meta_responses);
  std::shared_ptr<RecvOutcome> recv = StartRecv(2, k);
  ASSERT_TRUE(ReachState(State::kWaitTensor));
  Settle();
  const int64_t writes = Get(acceptor_.stats.content_writes);
  // The tensor's arrival posts the write, and the loopback fabric completes it within the same
  // turn of the sender's loop: kWriting is passed through, not rested in.
  Send(2, k, Floats(&acceptor_.pool, 100, 3.0f));
  ASSERT_TRUE(Pump([&] { return recv->calls > 0; }));
  Settle();
  ASSERT_TRUE(recv->status.ok()) << recv->status;
  EXPECT_EQ(Get(acceptor_.stats.content_writes), writes + 1);
  EXPECT_EQ(Get(acceptor_.stats.meta_responses), meta_responses) << "no kWaitReRequest";
  EXPECT_TRUE(Census().empty());
  EXPECT_TRUE(Took(State::kWaitTensor, Event::kTensor, State::kWriting));
}

// kWaitTensor -> kDone: the sender's step is aborted before its tensor exists; the receiver
// gets the sender's error once.
TEST_F(ResponseMachineTest, WaitTensorToDoneWhenTheSendersStepIsAborted) {
  const ParsedKey k = Key("k");
  std::shared_ptr<RecvOutcome> recv = StartRecv(1, k);
  ASSERT_TRUE(ReachState(State::kWaitTensor));
  Settle();
  absl::StatusOr<std::shared_ptr<RemoteRendezvous>> step = acceptor_.rendezvous_mgr->Find(1);
  ASSERT_TRUE(step.ok()) << step.status();
  (*step)->StartAbort(absl::AbortedError("the sender's step was aborted"));
  ASSERT_TRUE(Pump([&] { return recv->calls > 0; }));
  Settle();
  EXPECT_EQ(recv->calls, 1);
  EXPECT_EQ(recv->status.code(), absl::StatusCode::kAborted) << recv->status;
  EXPECT_THAT(std::string(recv->status.message()), HasSubstr("the sender's step was aborted"));
  EXPECT_EQ(Get(acceptor_.stats.errors_sent), 1);
  EXPECT_TRUE(Census().empty());
  EXPECT_EQ(acceptor_.local_tensors.open_tickets(), 0u);
  EXPECT_TRUE(Took(State::kWaitTensor, Event::kTensor, State::kDone));
}

// kWaitReRequest -> kWriting -> kDone with nothing to write: the receiver releases the tensor
// with an empty RE_REQUEST (its recv ended while the sender's META_DATA_RESPONSE was on its
// way), and the sender answers with the bare immediate.
TEST_F(ResponseMachineTest, AnEmptyReRequestIsAnsweredWithTheImmediateAlone) {
  const ParsedKey k = Key("k");
  Send(1, k, Floats(&acceptor_.pool, 100, 2.0f));
  std::shared_ptr<RecvOutcome> recv = StartRecv(1, k);
  ASSERT_TRUE(ReachState(State::kWaitReRequest));
  owner_.channel->receiving()->AbortStep(1, absl::CancelledError("the receiver gave up"));
  ASSERT_TRUE(Pump([&] { return Census().empty(); }));
  Settle();
  EXPECT_EQ(recv->calls, 1);
  EXPECT_EQ(recv->status.code(), absl::StatusCode::kCancelled) << recv->status;
  EXPECT_EQ(Get(acceptor_.stats.content_bytes), 0) << "no tensor bytes were written";
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 0u);
}

class ExpiringResponseMachineTest : public ResponseMachineTest {
 protected:
  // The sender's response timeout is its recv timeout plus its peer timeout: 5 s.
  void Configure(ChannelEnv* env) override {
    if (env != &acceptor_.env) return;
    env->transfer.recv_timeout = absl::Seconds(4);
    env->transfer.peer_timeout = absl::Seconds(1);
  }
};

// kWaitReRequest -> kDone: the receiver never asks for the content within the response
// timeout; the sender answers ERROR_STATUS and lets the tensor go.
TEST_F(ExpiringResponseMachineTest, WaitReRequestToDoneWhenTheReceiverNeverAsks) {
  const ParsedKey k = Key("k");
  Send(1, k, Floats(&acceptor_.pool, 100, 2.0f));
  std::shared_ptr<RecvOutcome> recv = StartRecv(1, k);
  ASSERT_TRUE(ReachState(State::kWaitReRequest));
  acceptor_.channel->sending()->ExpireResponses(absl::Now() + absl::Seconds(6));
  EXPECT_TRUE(Census().empty());
  EXPECT_EQ(Get(acceptor_.stats.errors_sent), 1);
  ASSERT_TRUE(Pump([&] { return recv->calls > 0; }));
  Settle();
  EXPECT_EQ(recv->calls, 1);
  EXPECT_EQ(recv->status.code(), absl::StatusCode::kDeadlineExceeded) << recv->status;
  EXPECT_TRUE(Took(State::kWaitReRequest, Event::kExpire, State::kDone));
}

TEST_F(ResponseMachineTest, CloseInWaitTensorCancelsTheWaitAndALateTensorFindsNoOne) {
  const ParsedKey k = Key("k");
  std::shared_ptr<RecvOutcome> recv = StartRecv(1, k);
  ASSERT_TRUE(ReachState(State::kWaitTensor));
  Settle();
  CloseAcceptor();
  Send(1, k, Floats(&acceptor_.pool, 100, 2.0f));
  Settle();
  EXPECT_EQ(Get(acceptor_.stats.content_writes), 0);
  EXPECT_EQ(Get(acceptor_.stats.meta_responses), 0);
  EXPECT_TRUE(Took(State::kWaitTensor, Event::kCancel, State::kDone));
}

TEST_F(ResponseMachineTest, CloseInWaitReRequestLetsTheTensorGo) {
  const ParsedKey k = Key("k");
  Send(1, k, Floats(&acceptor_.pool, 100, 2.0f));
  std::shared_ptr<RecvOutcome> recv = StartRecv(1, k);
  ASSERT_TRUE(ReachState(State::kWaitReRequest));
  CloseAcceptor();
  EXPECT_EQ(Get(acceptor_.stats.content_writes), 0);
  EXPECT_TRUE(Took(State::kWaitReRequest, Event::kCancel, State::kDone));
}

TEST_F(ResponseMachineTest, CloseInWritingIgnoresTheWritesCompletion) {
  const ParsedKey k = Key("k");
  ASSERT_TRUE(Transfer(1, k, Floats(&acceptor_.pool, 100, 1.0f))->status.ok());
  const int64_t writes = Get(acceptor_.stats.content_writes);
  std::shared_ptr<RecvOutcome> recv = StartRecv(2, k);
  Send(2, k, Floats(&acceptor_.pool, 100, 3.0f));
  // Stopped right after the sender posted the write, before it polled its completion.
  ASSERT_TRUE(ReachState(State::kWriting));
  CloseAcceptor();
  EXPECT_EQ(Get(acceptor_.stats.content_writes), writes) << "a closed channel counts no completion";
  EXPECT_EQ(acceptor_.channel->state(), Channel::State::kClosed);
  EXPECT_TRUE(Took(State::kWriting, Event::kCancel, State::kDone));
}

// kWaitTensor -> kWriting -> kDone: a REQUEST that names a destination the fabric refuses (a
// peer's malformed key) is answered with ERROR_STATUS, and the channel stays up.
TEST_F(ResponseMachineTest, WritingToDoneWhenTheNamedDestinationCannotBeWritten) {
  const ParsedKey k = Key("k");
  const Tensor sent = Floats(&acceptor_.pool, 100, 2.0f);
  Send(1, k, sent);
  Message m = Control(MessageType::kTensorRequest, k, 90);
  m.meta.dtype = sent.dtype();
  m.meta.shape = sent.shape();
  m.meta.tensor_bytes = sent.TotalBytes();
  m.remote_addr = 4096;
  m.remote_key = "not a key";
  owner_.channel->SendMessage(m);
  ASSERT_TRUE(Pump([&] { return Get(acceptor_.stats.errors_sent) == 1; }));
  Settle();
  EXPECT_TRUE(Census().empty());
  EXPECT_EQ(Get(acceptor_.stats.content_writes), 0);
  EXPECT_EQ(acceptor_.channel->state(), Channel::State::kReady);
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);
  EXPECT_TRUE(Took(State::kWaitTensor, Event::kTensor, State::kWriting));
  EXPECT_TRUE(Took(State::kWriting, Event::kWriteRefused, State::kDone));
}

// A device tensor the fabric cannot reach, staged to host memory in parts
// (WorkerEnv::proxy_chunk_bytes) by a stand-in GPU's copier whose copies the test holds and
// fails: a part that fails to stage ends the response with ERROR_STATUS, in either state it can
// find the response in.
class StagedResponseTest : public ResponseMachineTest {
 protected:
  static constexpr uint64_t kChunk = 4096;
  static constexpr int64_t kFloats = 4 * kChunk / 4;  // four parts
  void SetUp() override {
    acceptor_.worker.device_copier = &copier_;
    acceptor_.worker.proxy_chunk_bytes = kChunk;
    ASSERT_NO_FATAL_FAILURE(ResponseMachineTest::SetUp());
  }
  Tensor DeviceFloats(float scale) {
    const Tensor host = Floats(&acceptor_.pool, kFloats, scale);
    Tensor t = *Tensor::Allocate(&gpu_, DataType::kFloat32, host.shape());
    std::memcpy(t.data(), host.data(), host.TotalBytes());
    return t;
  }
  // Turns the sender's loop alone until `until` holds.
  ::testing::AssertionResult TurnSender(const std::function<bool()>& until) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (!until()) {
      if (absl::Now() > deadline) return ::testing::AssertionFailure() << "not reached in 10 s";
      acceptor_.Turn();
    }
    return ::testing::AssertionSuccess();
  }
  static void ExpectStagingFailure(const RecvOutcome& recv) {
    EXPECT_EQ(recv.calls, 1);
    EXPECT_EQ(recv.status.code(), absl::StatusCode::kInternal) << recv.status;
    EXPECT_THAT(std::string(recv.status.message()), HasSubstr("stand-in staging failure"));
  }

  testing::StandInDeviceAllocator gpu_{0};
  testing::StandInDeviceCopier copier_{1};
};

TEST_F(StagedResponseTest, WaitReRequestToDoneWhenAPartFailsToStage) {
  const ParsedKey k = Key("k");
  copier_.Hold(CopyDirection::kDeviceToHost);
  copier_.FailNext(CopyDirection::kDeviceToHost, absl::InternalError("stand-in staging failure"));
  Send(1, k, DeviceFloats(2.0f));
  std::shared_ptr<RecvOutcome> recv = StartRecv(1, k);
  // META_DATA_RESPONSE is out; the receiver has not answered it.
  ASSERT_TRUE(ReachState(State::kWaitReRequest));
  copier_.ReleaseHeld(-1);
  ASSERT_TRUE(TurnSender([&] { return Census().empty(); }));
  EXPECT_TRUE(Took(State::kWaitReRequest, Event::kStaged, State::kDone));
  ASSERT_TRUE(Pump([&] { return recv->calls > 0; }));
  Settle();
  ExpectStagingFailure(*recv);
  EXPECT_EQ(Get(acceptor_.stats.content_writes), 0);
  EXPECT_EQ(acceptor_.channel->state(), Channel::State::kReady);
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);
}

TEST_F(StagedResponseTest, WritingToDoneWhenAPartFailsToStageWithNoWriteInFlight) {
  const ParsedKey k = Key("k");
  // The first transfer caches the meta-data: the next REQUEST names a destination, and the
  // sender goes to kWriting as soon as its tensor is there, before any part is staged.
  ASSERT_TRUE(Transfer(1, k, DeviceFloats(1.0f))->status.ok());
  const int64_t writes = Get(acceptor_.stats.content_writes);
  std::shared_ptr<RecvOutcome> recv = StartRecv(2, k);
  ASSERT_TRUE(ReachState(State::kWaitTensor));
  Settle();
  copier_.Hold(CopyDirection::kDeviceToHost);
  copier_.FailNext(CopyDirection::kDeviceToHost, absl::InternalError("stand-in staging failure"));
  Send(2, k, DeviceFloats(2.0f));
  ASSERT_TRUE(TurnSender(
      [&] { return acceptor_.channel->sending()->CountResponses(State::kWriting) == 1; }));
  copier_.ReleaseHeld(-1);
  ASSERT_TRUE(Pump([&] { return recv->calls > 0; }));
  Settle();
  ExpectStagingFailure(*recv);
  EXPECT_EQ(Get(acceptor_.stats.content_writes), writes);
  EXPECT_TRUE(Census().empty());
  EXPECT_TRUE(Took(State::kWriting, Event::kStaged, State::kDone));
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);
}

}  // namespace
}  // namespace tensorverbs::protocol::channel_testing
