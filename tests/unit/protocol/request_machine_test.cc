// RdmaTensorRequest's state machine, driven through a real channel pair (channel_harness.h):
// every row of its table (tensor_request.cc) walked by the protocol itself and seen taken, and a
// close of the channel in every state a request rests in, which ends each recv exactly once and
// keeps the memory the sender may still write.
//
// kDone is where a record ends: the channel finishes it in the same loop turn, so it never
// rests there and there is no close to test in it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "tests/unit/protocol/channel_harness.h"

namespace tensorverbs::protocol::channel_testing {
namespace {

using ::testing::HasSubstr;
using State = RdmaTensorRequest::State;
using Owner = RdmaTensorRequest::Owner;

constexpr State kEveryState[] = {State::kQueued,     State::kRequested,   State::kAwaitingGrant,
                                 State::kMetaParked, State::kReRequested, State::kLandedAhead,
                                 State::kDone};
static_assert(std::size(kEveryState) == RdmaTensorRequest::kStates);

using Event = RdmaTensorRequest::Event;

TEST(RequestTableTest, EveryRowIsWalkedByATest) {
  const char* const kRoundTrip = "UnconnectedRequestMachineTest.QueuedRequestedReRequestedDone";
  const char* const kGranted =
      "GrantedRequestTest.AwaitingGrantThenReRequestedWhenTheOneAheadLands";
  const char* const kParkedAdopted =
      "PushedRequestTest.MetaParkedThenAdoptedAsksWithAFittingDestination";
  const char* const kLandedAdopted = "PushedRequestTest.LandedAheadThenAdoptedDeliversAtOnce";
  ExpectEveryRowWalked(
      RequestStateTable(),
      {
          Walk(State::kQueued, Event::kStart, State::kRequested, kRoundTrip),
          Walk(State::kQueued, Event::kStart, State::kDone,
               "RequestMachineTest.QueuedToDoneWhenTheCachedDestinationCannotBeMade"),
          Walk(State::kQueued, Event::kAbort, State::kDone,
               "UnconnectedRequestMachineTest.AbortInQueuedEndsTheRecvAndForgetsTheRequest"),
          Walk(State::kQueued, Event::kClose, State::kDone,
               "UnconnectedRequestMachineTest.CloseInQueuedEndsTheRecvOnce"),
          Walk(State::kRequested, Event::kMetaData, State::kMetaParked, kParkedAdopted),
          Walk(State::kRequested, Event::kMetaData, State::kAwaitingGrant, kGranted),
          Walk(State::kRequested, Event::kMetaData, State::kReRequested, kRoundTrip),
          Walk(State::kRequested, Event::kContent, State::kLandedAhead, kLandedAdopted),
          Walk(State::kRequested, Event::kContent, State::kDone,
               "RequestMachineTest.RequestedStraightToDoneWithCachedMetaData"),
          Walk(State::kRequested, Event::kErrorStatus, State::kDone,
               "RequestMachineTest.ErrorStatusInRequestedEndsTheRecvOnce"),
          Walk(State::kRequested, Event::kClose, State::kDone,
               "RequestMachineTest.CloseInRequestedEndsTheRecvOnceAndKeepsItsDestination"),
          Walk(State::kRequested, Event::kLaneLost, State::kDone,
               "LaneTest.ALaneThatFallsSilentAfterServingIsTakenOutMidTensor"),
          Walk(State::kAwaitingGrant, Event::kGrant, State::kReRequested, kGranted),
          Walk(State::kAwaitingGrant, Event::kErrorStatus, State::kDone,
               "GrantedRequestTest.ErrorStatusInAwaitingGrantEndsThatRecvOnceAndTheOtherLands"),
          Walk(State::kAwaitingGrant, Event::kClose, State::kDone,
               "GrantedRequestTest.CloseInAwaitingGrantAndReRequestedEndsBothRecvsOnce"),
          Walk(State::kMetaParked, Event::kAdopt, State::kReRequested, kParkedAdopted),
          Walk(State::kMetaParked, Event::kRelease, State::kReRequested,
               "PushedRequestTest.MetaParkedThenDeclinedReleasesTheSendersTensor"),
          Walk(State::kMetaParked, Event::kErrorStatus, State::kDone,
               "PushedRequestTest.ErrorStatusInMetaParkedForgetsTheRequest"),
          Walk(State::kMetaParked, Event::kClose, State::kDone,
               "PushedRequestTest.CloseInMetaParkedCallsNobody"),
          Walk(State::kReRequested, Event::kContent, State::kDone, kRoundTrip),
          Walk(State::kReRequested, Event::kErrorStatus, State::kDone,
               "GrantedRequestTest.ExpiredResponsesEndBothRecvsOnceAndTheGrantComesBack"),
          Walk(State::kReRequested, Event::kClose, State::kDone,
               "GrantedRequestTest.CloseAfterTheGrantEndsTheSecondRecvOnceAndKeepsItsDestination"),
          Walk(State::kReRequested, Event::kLaneLost, State::kDone,
               "LaneTest.ALaneSilentWhileSegmentsAreDueIsTakenOutAndTheChannelGoesOn"),
          Walk(State::kLandedAhead, Event::kAdopt, State::kDone, kLandedAdopted),
          Walk(State::kLandedAhead, Event::kAbort, State::kDone,
               "PushedRequestTest.LandedAheadThenDeclinedEndsTheRecord"),
          Walk(State::kLandedAhead, Event::kClose, State::kDone,
               "PushedRequestTest.CloseInLandedAheadHandsTheTensorToTheTransport"),
      });
}

// Whether the test took the request table's row (from, event, to).
::testing::AssertionResult Took(State from, Event event, State to) {
  return RowsTaken::Took(RequestStateTable(), from, event, to);
}

// An allocator with no memory to give.
class RefusingAllocator final : public Allocator {
 public:
  std::string Name() const override { return "refusing"; }
  void* AllocateRaw(size_t) override { return nullptr; }
  void DeallocateRaw(void*, size_t) override {}
};

// Requests of the owner's channel in each state, by owner; only non-zero entries.
std::map<std::pair<State, Owner>, size_t> Census(const Channel& channel) {
  std::map<std::pair<State, Owner>, size_t> out;
  for (State s : kEveryState) {
    for (Owner o : {Owner::kRecv, Owner::kPushed, Owner::kAdopted, Owner::kDeclined}) {
      if (size_t n = channel.receiving()->CountRequests(s, o); n > 0) out[{s, o}] = n;
    }
  }
  return out;
}

using CensusMap = std::map<std::pair<State, Owner>, size_t>;

class RequestMachineTest : public ChannelTest {
 protected:
  static constexpr int64_t kLarge = 32768;  // floats: 128 KiB, a large destination below
  void Configure(ChannelEnv* env) override {
    env->options.large_bytes = uint64_t{64} << 10;
    env->options.large_in_flight = 1;
    // The sender's response timeout (its recv timeout plus its peer timeout), for the tests
    // that expire responses.
    if (env == &acceptor_.env) {
      env->transfer.recv_timeout = absl::Seconds(4);
      env->transfer.peer_timeout = absl::Seconds(1);
    }
  }
  size_t InState(State s, std::optional<Owner> o = std::nullopt) {
    return owner_.channel->receiving()->CountRequests(s, o);
  }
  // Pumps until one request of the owner's rests in `s`, served by `o`.
  ::testing::AssertionResult ReachState(State s, Owner o) {
    return Pump([&] { return InState(s, o) == 1; });
  }
  // The owner's channel closes with Unavailable; what a test then expects of `recv`.
  void CloseOwner() {
    owner_.channel->Close(absl::UnavailableError("the test closed the channel"));
    Settle();
    EXPECT_TRUE(Census(*owner_.channel).empty()) << "a closed channel keeps no request";
  }
  static void ExpectEndedByClose(const RecvOutcome& recv) {
    EXPECT_EQ(recv.calls, 1);
    EXPECT_EQ(recv.status.code(), absl::StatusCode::kUnavailable) << recv.status;
    EXPECT_THAT(std::string(recv.status.message()), HasSubstr("the test closed the channel"));
  }
  size_t QuarantinedTensors() const {
    size_t n = 0;
    for (const Side::Quarantined& q : owner_.quarantined) n += q.memory.size();
    return n;
  }
};

class UnconnectedRequestMachineTest : public RequestMachineTest {
 protected:
  bool ConnectOnSetUp() const override { return false; }
};

// kQueued -> kRequested -> kReRequested -> kDone: a key with no cached meta-data takes the
// round trip, and each state is seen on the way.
TEST_F(UnconnectedRequestMachineTest, QueuedRequestedReRequestedDone) {
  const ParsedKey k = Key("k");
  std::shared_ptr<RecvOutcome> recv = StartRecv(1, k);
  EXPECT_EQ((Census(*owner_.channel)), (CensusMap{{{State::kQueued, Owner::kRecv}, 1}}));
  ASSERT_NO_FATAL_FAILURE(ConnectChannels());
  ASSERT_TRUE(ReachState(State::kRequested, Owner::kRecv));
  Settle();  // the sender has no tensor yet: the request waits for it
  EXPECT_EQ((Census(*owner_.channel)), (CensusMap{{{State::kRequested, Owner::kRecv}, 1}}));
  const Tensor sent = Floats(&acceptor_.pool, 100, 2.0f);
  Send(1, k, sent);
  ASSERT_TRUE(ReachState(State::kReRequested, Owner::kRecv));
  EXPECT_EQ(recv->calls, 0);
  ASSERT_TRUE(Pump([&] { return recv->calls > 0; }));
  Settle();
  EXPECT_EQ(recv->calls, 1);
  ASSERT_TRUE(recv->status.ok()) << recv->status;
  EXPECT_TRUE(recv->tensor.ContentEquals(sent));
  EXPECT_TRUE(Census(*owner_.channel).empty());
  EXPECT_TRUE(Took(State::kQueued, Event::kStart, State::kRequested));
  EXPECT_TRUE(RowsTaken::Took(ChannelStateTable(), Channel::State::kConnecting,
                              Channel::Event::kConnected, Channel::State::kReady));
  EXPECT_TRUE(Took(State::kRequested, Event::kMetaData, State::kReRequested));
  EXPECT_TRUE(Took(State::kReRequested, Event::kContent, State::kDone));
}

TEST_F(UnconnectedRequestMachineTest, CloseInQueuedEndsTheRecvOnce) {
  std::shared_ptr<RecvOutcome> recv = StartRecv(1, Key("k"));
  ASSERT_EQ(InState(State::kQueued, Owner::kRecv), 1u);
  CloseOwner();
  ExpectEndedByClose(*recv);
  EXPECT_EQ(QuarantinedTensors(), 0u) << "a request never sent named no memory";
  EXPECT_TRUE(Took(State::kQueued, Event::kClose, State::kDone));
  EXPECT_TRUE(RowsTaken::Took(ChannelStateTable(), Channel::State::kConnecting,
                              Channel::Event::kClose, Channel::State::kClosed));
}

TEST_F(UnconnectedRequestMachineTest, AbortInQueuedEndsTheRecvAndForgetsTheRequest) {
  std::shared_ptr<RecvOutcome> recv = StartRecv(1, Key("k"));
  ASSERT_EQ(InState(State::kQueued, Owner::kRecv), 1u);
  owner_.channel->receiving()->AbortStep(1, absl::CancelledError("step 1 aborted"));
  Settle();
  EXPECT_EQ(recv->calls, 1);
  EXPECT_EQ(recv->status.code(), absl::StatusCode::kCancelled) << recv->status;
  EXPECT_TRUE(Census(*owner_.channel).empty()) << "never sent: nothing can land";
  EXPECT_TRUE(Took(State::kQueued, Event::kAbort, State::kDone));
  ASSERT_NO_FATAL_FAILURE(ConnectChannels());
  Settle();
  EXPECT_EQ(Get(owner_.stats.requests), 0) << "no REQUEST goes for it once connected";
}

// kQueued -> kDone: a cached meta-data has REQUEST name the destination, and there is no
// memory for it.
TEST_F(RequestMachineTest, QueuedToDoneWhenTheCachedDestinationCannotBeMade) {
  const ParsedKey k = Key("k");
  ASSERT_TRUE(Transfer(1, k, Floats(&acceptor_.pool, 100, 1.0f))->status.ok());
  const int64_t requests = Get(owner_.stats.requests);
  RefusingAllocator refusing;
  std::shared_ptr<RecvOutcome> recv = StartRecv(2, k, absl::InfiniteFuture(), &refusing);
  Settle();
  EXPECT_EQ(recv->calls, 1);
  EXPECT_EQ(recv->status.code(), absl::StatusCode::kResourceExhausted) << recv->status;
  EXPECT_THAT(std::string(recv->status.message()), HasSubstr("refusing"));
  EXPECT_TRUE(Census(*owner_.channel).empty());
  EXPECT_EQ(Get(owner_.stats.requests), requests) << "no REQUEST went";
  EXPECT_TRUE(Took(State::kQueued, Event::kStart, State::kDone));
}

// kRequested -> kDone on ERROR_STATUS: the sender's step ends while its response waits for the
// tensor.
TEST_F(RequestMachineTest, ErrorStatusInRequestedEndsTheRecvOnce) {
  const ParsedKey k = Key("k");
  std::shared_ptr<RecvOutcome> recv = StartRecv(1, k);
  ASSERT_TRUE(ReachState(State::kRequested, Owner::kRecv));
  Settle();  // the sender has no tensor yet
  acceptor_.rendezvous_mgr->Cleanup(1);
  ASSERT_TRUE(Pump([&] { return recv->calls > 0; }));
  Settle();
  EXPECT_EQ(recv->calls, 1);
  EXPECT_FALSE(recv->status.ok());
  EXPECT_THAT(std::string(recv->status.message()), HasSubstr("could not send"));
  EXPECT_TRUE(Census(*owner_.channel).empty());
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);
  EXPECT_TRUE(Took(State::kRequested, Event::kErrorStatus, State::kDone));
}

// kRequested -> kDone: with the meta-data cached, REQUEST names the destination and the
// content lands without a round trip.
TEST_F(RequestMachineTest, RequestedStraightToDoneWithCachedMetaData) {
  const ParsedKey k = Key("k");
  ASSERT_TRUE(Transfer(1, k, Floats(&acceptor_.pool, 100, 1.0f))->status.ok());
  const int64_t re_requests = Get(owner_.stats.re_requests);
  std::shared_ptr<RecvOutcome> recv = StartRecv(2, k);
  ASSERT_TRUE(ReachState(State::kRequested, Owner::kRecv));
  Settle();
  const Tensor sent = Floats(&acceptor_.pool, 100, 3.0f);
  Send(2, k, sent);
  ASSERT_TRUE(Pump([&] { return recv->calls > 0; }));
  Settle();
  ASSERT_TRUE(recv->status.ok()) << recv->status;
  EXPECT_TRUE(recv->tensor.ContentEquals(sent));
  EXPECT_EQ(Get(owner_.stats.re_requests), re_requests) << "no kReRequested on the way";
  EXPECT_TRUE(Census(*owner_.channel).empty());
  EXPECT_TRUE(Took(State::kRequested, Event::kContent, State::kDone));
}

TEST_F(RequestMachineTest, CloseInRequestedEndsTheRecvOnceAndKeepsItsDestination) {
  const ParsedKey k = Key("k");
  ASSERT_TRUE(Transfer(1, k, Floats(&acceptor_.pool, 100, 1.0f))->status.ok());
  std::shared_ptr<RecvOutcome> recv = StartRecv(2, k);  // names its destination
  ASSERT_TRUE(ReachState(State::kRequested, Owner::kRecv));
  Settle();
  CloseOwner();
  ExpectEndedByClose(*recv);
  EXPECT_EQ(QuarantinedTensors(), 1u) << "the sender may still write the destination";
  EXPECT_TRUE(Took(State::kRequested, Event::kClose, State::kDone));
  EXPECT_TRUE(RowsTaken::Took(ChannelStateTable(), Channel::State::kReady, Channel::Event::kClose,
                              Channel::State::kClosed));
}

// A large recv waits for the one ahead of it (kAwaitingGrant), then asks (kReRequested).
class GrantedRequestTest : public RequestMachineTest {
 protected:
  // Two large recvs with no cached meta-data ask without destinations; both tensors exist, so
  // the sender answers both with META_DATA_RESPONSE in one turn: the first answered takes the
  // channel's one large destination (kReRequested), the second waits (kAwaitingGrant).
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(RequestMachineTest::SetUp());
    got_a_ = StartRecv(1, a_);
    got_b_ = StartRecv(1, b_);
    Settle();
    Send(1, a_, sent_a_);
    Send(1, b_, sent_b_);
    ASSERT_TRUE(ReachState(State::kAwaitingGrant, Owner::kRecv));
    ASSERT_EQ(InState(State::kReRequested, Owner::kRecv), 1u);
  }
  const ParsedKey a_ = Key("a"), b_ = Key("b");
  const Tensor sent_a_ = Floats(&acceptor_.pool, kLarge, 3.0f);
  const Tensor sent_b_ = Floats(&acceptor_.pool, kLarge, 2.0f);
  std::shared_ptr<RecvOutcome> got_a_, got_b_;
};

TEST_F(GrantedRequestTest, AwaitingGrantThenReRequestedWhenTheOneAheadLands) {
  ASSERT_TRUE(Pump([&] { return got_a_->calls > 0 && got_b_->calls > 0; }));
  Settle();
  ASSERT_TRUE(got_a_->status.ok()) << got_a_->status;
  ASSERT_TRUE(got_b_->status.ok()) << got_b_->status;
  EXPECT_TRUE(got_a_->tensor.ContentEquals(sent_a_));
  EXPECT_TRUE(got_b_->tensor.ContentEquals(sent_b_));
  EXPECT_EQ(Get(owner_.stats.re_requests), 2);
  EXPECT_TRUE(Census(*owner_.channel).empty());
  EXPECT_TRUE(Took(State::kRequested, Event::kMetaData, State::kAwaitingGrant));
  EXPECT_TRUE(Took(State::kAwaitingGrant, Event::kGrant, State::kReRequested));
}

TEST_F(GrantedRequestTest, CloseInAwaitingGrantAndReRequestedEndsBothRecvsOnce) {
  CloseOwner();
  ExpectEndedByClose(*got_a_);
  ExpectEndedByClose(*got_b_);
  EXPECT_EQ(QuarantinedTensors(), 1u) << "the granted destination; the other was never named";
  EXPECT_TRUE(Took(State::kAwaitingGrant, Event::kClose, State::kDone));
}

TEST_F(GrantedRequestTest, CloseAfterTheGrantEndsTheSecondRecvOnceAndKeepsItsDestination) {
  // The first lands and the second is granted and asks: stop right after its RE_REQUEST.
  ASSERT_TRUE(Pump([&] { return InState(State::kAwaitingGrant) == 0; }));
  ASSERT_EQ(InState(State::kReRequested, Owner::kRecv), 1u);
  std::shared_ptr<RecvOutcome> first = got_a_->calls > 0 ? got_a_ : got_b_;
  std::shared_ptr<RecvOutcome> second = got_a_->calls > 0 ? got_b_ : got_a_;
  EXPECT_EQ(first->calls, 1);
  EXPECT_TRUE(first->status.ok()) << first->status;
  EXPECT_EQ(second->calls, 0);
  CloseOwner();
  ExpectEndedByClose(*second);
  EXPECT_EQ(QuarantinedTensors(), 1u) << "the destination named in its RE_REQUEST";
  EXPECT_TRUE(Took(State::kReRequested, Event::kClose, State::kDone));
}

// The sender gives up on both responses (no RE_REQUEST in time, as it sees it): the granted
// recv's RE_REQUEST crosses the ERROR_STATUS, and the waiting one, granted in turn, ends too.
TEST_F(GrantedRequestTest, ExpiredResponsesEndBothRecvsOnceAndTheGrantComesBack) {
  acceptor_.channel->sending()->ExpireResponses(absl::Now() + absl::Hours(1));
  ASSERT_TRUE(Pump([&] { return got_a_->calls > 0 && got_b_->calls > 0; }));
  Settle();
  for (const std::shared_ptr<RecvOutcome>& got : {got_a_, got_b_}) {
    EXPECT_EQ(got->calls, 1);
    EXPECT_EQ(got->status.code(), absl::StatusCode::kDeadlineExceeded) << got->status;
  }
  EXPECT_TRUE(Census(*owner_.channel).empty());
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);
  EXPECT_TRUE(Took(State::kReRequested, Event::kErrorStatus, State::kDone));
  // The channel's grant came back: the next large recv goes.
  std::shared_ptr<RecvOutcome> next = Transfer(2, a_, sent_a_);
  ASSERT_TRUE(next->status.ok()) << next->status;
  EXPECT_TRUE(next->tensor.ContentEquals(sent_a_));
}

// ERROR_STATUS for the recv that waits for a grant (what a sender whose response failed
// answers): it ends once, and the granted one lands.
TEST_F(GrantedRequestTest, ErrorStatusInAwaitingGrantEndsThatRecvOnceAndTheOtherLands) {
  Message error = Control(MessageType::kErrorStatus, b_, /*index=*/1);
  error.error = absl::InternalError("the sender failed");
  acceptor_.channel->SendMessage(error);
  ASSERT_TRUE(Pump([&] { return got_b_->calls > 0; }));
  EXPECT_EQ(InState(State::kAwaitingGrant), 0u);
  EXPECT_TRUE(Took(State::kAwaitingGrant, Event::kErrorStatus, State::kDone));
  ASSERT_TRUE(Pump([&] { return got_a_->calls > 0; }));
  Settle();
  EXPECT_EQ(got_b_->calls, 1);
  EXPECT_EQ(got_b_->status.code(), absl::StatusCode::kInternal) << got_b_->status;
  EXPECT_THAT(std::string(got_b_->status.message()), HasSubstr("the sender failed"));
  EXPECT_EQ(got_a_->calls, 1);
  ASSERT_TRUE(got_a_->status.ok()) << got_a_->status;
  EXPECT_TRUE(got_a_->tensor.ContentEquals(sent_a_));
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);
}

// Requests pushed ahead (TENSORVERBS_PUSH): made by the channel after a recv of the key, then
// adopted by the step's recv, or declined when the step ends first.
class PushedRequestTest : public RequestMachineTest {
 protected:
  void Configure(ChannelEnv* env) override {
    RequestMachineTest::Configure(env);
    env->options.push = true;
  }
  // Step 1 of `k_` moves, which pushes the request for step 2.
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(RequestMachineTest::SetUp());
    ASSERT_TRUE(Transfer(1, k_, Floats(&acceptor_.pool, 100, 1.0f))->status.ok());
    ASSERT_EQ((Census(*owner_.channel)), (CensusMap{{{State::kRequested, Owner::kPushed}, 1}}));
  }
  const ParsedKey k_ = Key("k");
};

TEST_F(PushedRequestTest, LandedAheadThenAdoptedDeliversAtOnce) {
  const Tensor sent = Floats(&acceptor_.pool, 100, 2.0f);
  Send(2, k_, sent);
  ASSERT_TRUE(ReachState(State::kLandedAhead, Owner::kPushed));
  std::shared_ptr<RecvOutcome> recv = StartRecv(2, k_);
  Turn();  // the callback runs in the owner's next turn
  EXPECT_EQ(recv->calls, 1);
  ASSERT_TRUE(recv->status.ok()) << recv->status;
  EXPECT_TRUE(recv->tensor.ContentEquals(sent));
  Settle();
  // Delivered in place, so step 3 is pushed in turn.
  EXPECT_EQ((Census(*owner_.channel)), (CensusMap{{{State::kRequested, Owner::kPushed}, 1}}));
  EXPECT_TRUE(Took(State::kRequested, Event::kContent, State::kLandedAhead));
  EXPECT_TRUE(Took(State::kLandedAhead, Event::kAdopt, State::kDone));
}

TEST_F(PushedRequestTest, AdoptedWhileRequestedThenDone) {
  std::shared_ptr<RecvOutcome> recv = StartRecv(2, k_);
  EXPECT_EQ((Census(*owner_.channel)), (CensusMap{{{State::kRequested, Owner::kAdopted}, 1}}));
  const Tensor sent = Floats(&acceptor_.pool, 100, 4.0f);
  Send(2, k_, sent);
  ASSERT_TRUE(Pump([&] { return recv->calls > 0; }));
  ASSERT_TRUE(recv->status.ok()) << recv->status;
  EXPECT_TRUE(recv->tensor.ContentEquals(sent));
}

TEST_F(PushedRequestTest, MetaParkedThenAdoptedAsksWithAFittingDestination) {
  const Tensor sent = Floats(&acceptor_.pool, 300, 5.0f);  // another shape than step 1's
  Send(2, k_, sent);
  ASSERT_TRUE(ReachState(State::kMetaParked, Owner::kPushed));
  Settle();
  EXPECT_EQ(InState(State::kMetaParked, Owner::kPushed), 1u) << "it waits for its recv";
  std::shared_ptr<RecvOutcome> recv = StartRecv(2, k_);
  EXPECT_EQ(InState(State::kReRequested, Owner::kAdopted), 1u);
  ASSERT_TRUE(Pump([&] { return recv->calls > 0; }));
  Settle();
  EXPECT_EQ(recv->calls, 1);
  ASSERT_TRUE(recv->status.ok()) << recv->status;
  EXPECT_TRUE(recv->tensor.ContentEquals(sent));
  EXPECT_TRUE(Took(State::kRequested, Event::kMetaData, State::kMetaParked));
  EXPECT_TRUE(Took(State::kMetaParked, Event::kAdopt, State::kReRequested));
}

TEST_F(PushedRequestTest, MetaParkedThenDeclinedReleasesTheSendersTensor) {
  Send(2, k_, Floats(&acceptor_.pool, 300, 5.0f));
  ASSERT_TRUE(ReachState(State::kMetaParked, Owner::kPushed));
  Settle();
  ASSERT_EQ(acceptor_.channel->sending()->responses_in_progress(), 1u)
      << "the sender holds the tensor";
  owner_.channel->receiving()->AbortStep(2, absl::CancelledError("step 2 aborted"));
  Settle();
  EXPECT_TRUE(Census(*owner_.channel).empty());
  EXPECT_EQ(acceptor_.channel->sending()->responses_in_progress(), 0u)
      << "released by an empty RE_REQUEST";
  EXPECT_EQ(Get(owner_.stats.channel_errors) + Get(acceptor_.stats.channel_errors), 0);
  EXPECT_TRUE(Took(State::kMetaParked, Event::kRelease, State::kReRequested));
}

TEST_F(PushedRequestTest, LandedAheadThenDeclinedEndsTheRecord) {
  Send(2, k_, Floats(&acceptor_.pool, 100, 2.0f));
  ASSERT_TRUE(ReachState(State::kLandedAhead, Owner::kPushed));
  const int64_t unused = Get(owner_.stats.push_unused);
  owner_.channel->receiving()->AbortStep(2, absl::CancelledError("step 2 aborted"));
  Settle();
  EXPECT_TRUE(Census(*owner_.channel).empty());
  EXPECT_EQ(Get(owner_.stats.push_unused), unused + 1);
  EXPECT_TRUE(Took(State::kLandedAhead, Event::kAbort, State::kDone));
}

TEST_F(PushedRequestTest, ErrorStatusInMetaParkedForgetsTheRequest) {
  Send(2, k_, Floats(&acceptor_.pool, 300, 5.0f));
  ASSERT_TRUE(ReachState(State::kMetaParked, Owner::kPushed));
  Settle();
  acceptor_.channel->sending()->ExpireResponses(absl::Now() + absl::Hours(1));
  Settle();
  EXPECT_TRUE(Census(*owner_.channel).empty());
  EXPECT_EQ(acceptor_.channel->sending()->responses_in_progress(), 0u);
  EXPECT_EQ(Get(owner_.stats.channel_errors) + Get(acceptor_.stats.channel_errors), 0);
  EXPECT_TRUE(Took(State::kMetaParked, Event::kErrorStatus, State::kDone));
}

TEST_F(PushedRequestTest, CloseInRequestedCallsNobodyAndKeepsTheDestination) {
  CloseOwner();
  EXPECT_EQ(QuarantinedTensors(), 1u);
}

TEST_F(PushedRequestTest, CloseInMetaParkedCallsNobody) {
  Send(2, k_, Floats(&acceptor_.pool, 300, 5.0f));
  ASSERT_TRUE(ReachState(State::kMetaParked, Owner::kPushed));
  CloseOwner();
  // The step's recv, started after the close, is refused at once rather than left waiting.
  std::shared_ptr<RecvOutcome> recv = StartRecv(2, k_);
  EXPECT_EQ(recv->calls, 1);
  EXPECT_EQ(recv->status.code(), absl::StatusCode::kUnavailable) << recv->status;
  EXPECT_TRUE(Took(State::kMetaParked, Event::kClose, State::kDone));
}

TEST_F(PushedRequestTest, CloseInLandedAheadHandsTheTensorToTheTransport) {
  Send(2, k_, Floats(&acceptor_.pool, 100, 2.0f));
  ASSERT_TRUE(ReachState(State::kLandedAhead, Owner::kPushed));
  CloseOwner();
  std::optional<Tensor> kept = owner_.landed.Take(acceptor_.worker.task_name, k_.full_key, 2);
  ASSERT_TRUE(kept.has_value()) << "whole, and the sender is done with it";
  EXPECT_TRUE(kept->IsInitialized());
  EXPECT_TRUE(owner_.landed.empty()) << "kept once, for its own key and step";
  EXPECT_EQ(QuarantinedTensors(), 0u);
  EXPECT_TRUE(Took(State::kLandedAhead, Event::kClose, State::kDone));
}

// A recv that asks to hear of its progress (RecvArgs::progress_bytes, on_landed): the sender
// writes the content in segments, each ending with the immediate, and the recv is told of each
// prefix that landed but the last, while it has not ended.
class SegmentedRecvTest : public RequestMachineTest {
 protected:
  struct Heard {
    std::vector<uint64_t> prefixes;
    Tensor landing;
  };
  RecvLanding Listening(const std::shared_ptr<Heard>& heard, uint64_t segment) {
    RecvLanding landing;
    landing.progress_bytes = segment;
    landing.on_landed = [heard](const Tensor& t, uint64_t landed_bytes) {
      heard->prefixes.push_back(landed_bytes);
      heard->landing = t;
    };
    return landing;
  }
};

TEST_F(SegmentedRecvTest, EachSegmentButTheLastIsToldInOrderAndTheLastIsTheRecv) {
  const ParsedKey k = Key("k");
  constexpr uint64_t kSegment = kMinSegmentBytes;
  // Four whole segments and a short fifth.
  const Tensor sent = Floats(&acceptor_.pool, (4 * kSegment + 400) / 4, 3.0f);
  for (int64_t step = 1; step <= 2; ++step) {  // the meta-data round trip, then the cached one
    auto heard = std::make_shared<Heard>();
    Send(step, k, sent);
    std::shared_ptr<RecvOutcome> recv =
        StartRecv(step, k, absl::InfiniteFuture(), nullptr, Listening(heard, kSegment));
    ASSERT_TRUE(Pump([&] { return recv->calls > 0; }));
    Settle();
    EXPECT_EQ(recv->calls, 1);
    ASSERT_TRUE(recv->status.ok()) << recv->status;
    EXPECT_TRUE(recv->tensor.ContentEquals(sent));
    EXPECT_EQ(heard->prefixes,
              (std::vector<uint64_t>{kSegment, 2 * kSegment, 3 * kSegment, 4 * kSegment}))
        << "step " << step;
    EXPECT_TRUE(heard->landing.SharesBufferWith(recv->tensor)) << "told where the result lands";
    EXPECT_EQ(Get(owner_.stats.content_segments), 4 * step);
    EXPECT_TRUE(Census(*owner_.channel).empty());
  }
  // A tensor no larger than one segment, and a recv that asks for none, cost one immediate.
  auto heard = std::make_shared<Heard>();
  const Tensor small = Floats(&acceptor_.pool, kSegment / 4, 1.0f);
  Send(3, Key("small"), small);
  std::shared_ptr<RecvOutcome> one =
      StartRecv(3, Key("small"), absl::InfiniteFuture(), nullptr, Listening(heard, kSegment));
  Send(3, Key("plain"), sent);
  std::shared_ptr<RecvOutcome> plain = StartRecv(3, Key("plain"));
  ASSERT_TRUE(Pump([&] { return one->calls > 0 && plain->calls > 0; }));
  EXPECT_TRUE(one->tensor.ContentEquals(small));
  EXPECT_TRUE(plain->tensor.ContentEquals(sent));
  EXPECT_TRUE(heard->prefixes.empty());
  EXPECT_EQ(Get(owner_.stats.content_segments), 8);
  EXPECT_EQ(Get(owner_.stats.dropped_imms), 0);
}

TEST_F(SegmentedRecvTest, ARecvThatEndsMidwayHearsNothingMoreAndItsRecordWaitsForTheLast) {
  const ParsedKey k = Key("k");
  constexpr uint64_t kSegment = kMinSegmentBytes;
  // More segments than one turn of the receiver's loop takes completions (64).
  const Tensor sent = Floats(&acceptor_.pool, 100 * kSegment / 4, 7.0f);
  auto heard = std::make_shared<Heard>();
  Send(1, k, sent);
  std::shared_ptr<RecvOutcome> recv =
      StartRecv(1, k, absl::InfiniteFuture(), nullptr, Listening(heard, kSegment));
  ASSERT_TRUE(Pump([&] { return !heard->prefixes.empty(); }));
  ASSERT_LT(heard->prefixes.size(), 99u) << "the test needs the recv to end midway";
  owner_.channel->receiving()->AbortStep(1, absl::CancelledError("step 1 aborted"));
  const size_t told = heard->prefixes.size();
  EXPECT_EQ(InState(State::kReRequested), 1u) << "the sender may still write: the record stays";
  Settle();
  EXPECT_EQ(recv->calls, 1);
  EXPECT_EQ(recv->status.code(), absl::StatusCode::kCancelled) << recv->status;
  EXPECT_EQ(heard->prefixes.size(), told) << "nothing is told once the recv ended";
  EXPECT_TRUE(Census(*owner_.channel).empty()) << "the last immediate ended the record";
  EXPECT_EQ(Get(owner_.stats.content_segments), 99);
  EXPECT_EQ(Get(owner_.stats.dropped_imms), 0);
  EXPECT_EQ(Get(owner_.stats.channel_errors) + Get(acceptor_.stats.channel_errors), 0);
}

}  // namespace
}  // namespace tensorverbs::protocol::channel_testing
