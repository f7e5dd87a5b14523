// RdmaTensorResponse's state machine, driven through a real channel pair (channel_harness.h):
// the transition table against the diagram in tensor_response.h, every edge walked by the
// protocol itself, and a close of the sender's channel in every state a response rests in,
// after which the channel holds nothing and a late tensor or completion finds no one.
//
// kDone is where a record ends: the sending side finishes it in the same loop turn, so it
// never rests there and there is no close to test in it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <iterator>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "tests/unit/protocol/channel_harness.h"

namespace tensorverbs::protocol::channel_testing {
namespace {

using ::testing::HasSubstr;
using State = RdmaTensorResponse::State;

constexpr State kEveryState[] = {State::kWaitTensor, State::kWaitReRequest, State::kWriting,
                                 State::kDone};
static_assert(std::size(kEveryState) == RdmaTensorResponse::kStates);

TEST(ResponseTransitionTest, TheTableIsTheDiagramInTheHeader) {
  // tensor_response.h's diagram, edge by edge ("any --error, or Cancel--> kDone" included).
  const std::set<std::pair<State, State>> diagram = {
      {State::kWaitTensor, State::kWriting}, {State::kWaitTensor, State::kWaitReRequest},
      {State::kWaitTensor, State::kDone},    {State::kWaitReRequest, State::kWriting},
      {State::kWaitReRequest, State::kDone}, {State::kWriting, State::kDone},
  };
  ExpectTableIsTheDiagram(kEveryState, diagram, ResponseTransitionAllowed, ResponseStateName);
}

using CensusMap = std::map<State, size_t>;

class ResponseMachineTest : public ChannelTest {
 protected:
  // Responses of the acceptor's channel in each state; only non-zero entries.
  CensusMap Census() const {
    CensusMap out;
    for (State s : kEveryState) {
      if (size_t n = acceptor_.channel->CountResponses(s); n > 0) out[s] = n;
    }
    return out;
  }
  ::testing::AssertionResult ReachState(State s) {
    return Pump([&] { return acceptor_.channel->CountResponses(s) == 1; });
  }
  // The sender's channel closes; afterwards it holds nothing for its peer.
  void CloseAcceptor() {
    acceptor_.channel->Close(absl::UnavailableError("the test closed the channel"));
    Settle();
    EXPECT_TRUE(Census().empty()) << "a closed channel keeps no response";
    EXPECT_EQ(acceptor_.channel->responses_in_progress(), 0u);
    EXPECT_FALSE(acceptor_.channel->holds_state_for_peer());
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
}

// kWaitReRequest -> kWriting -> kDone with nothing to write: the receiver releases the tensor
// with an empty RE_REQUEST (its recv ended while the sender's META_DATA_RESPONSE was on its
// way), and the sender answers with the bare immediate.
TEST_F(ResponseMachineTest, AnEmptyReRequestIsAnsweredWithTheImmediateAlone) {
  const ParsedKey k = Key("k");
  Send(1, k, Floats(&acceptor_.pool, 100, 2.0f));
  std::shared_ptr<RecvOutcome> recv = StartRecv(1, k);
  ASSERT_TRUE(ReachState(State::kWaitReRequest));
  owner_.channel->AbortStep(1, absl::CancelledError("the receiver gave up"));
  ASSERT_TRUE(Pump([&] { return Census().empty(); }));
  Settle();
  EXPECT_EQ(recv->calls, 1);
  EXPECT_EQ(recv->status.code(), absl::StatusCode::kCancelled) << recv->status;
  EXPECT_EQ(Get(acceptor_.stats.content_bytes), 0) << "no tensor bytes were written";
  EXPECT_EQ(owner_.channel->pending_requests(), 0u);
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
  acceptor_.channel->ExpireResponses(absl::Now() + absl::Seconds(6));
  EXPECT_TRUE(Census().empty());
  EXPECT_EQ(Get(acceptor_.stats.errors_sent), 1);
  ASSERT_TRUE(Pump([&] { return recv->calls > 0; }));
  Settle();
  EXPECT_EQ(recv->calls, 1);
  EXPECT_EQ(recv->status.code(), absl::StatusCode::kDeadlineExceeded) << recv->status;
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
}

TEST_F(ResponseMachineTest, CloseInWaitReRequestLetsTheTensorGo) {
  const ParsedKey k = Key("k");
  Send(1, k, Floats(&acceptor_.pool, 100, 2.0f));
  std::shared_ptr<RecvOutcome> recv = StartRecv(1, k);
  ASSERT_TRUE(ReachState(State::kWaitReRequest));
  CloseAcceptor();
  EXPECT_EQ(Get(acceptor_.stats.content_writes), 0);
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
}

}  // namespace
}  // namespace tensorverbs::protocol::channel_testing
