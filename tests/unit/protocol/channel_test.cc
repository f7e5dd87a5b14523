// The grpc+verbs channel and its two state machines, driven directly: an owner and an acceptor
// channel over two in-process loopback domains, with the test playing both progress threads.
// No Server and no gRPC, so every message, counter and close reason is the channel's own.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/unit/protocol/channel_harness.h"

namespace tensorverbs::protocol::channel_testing {
namespace {

using ::testing::HasSubstr;

// The channel's own table (channel.cc): its rows are taken by the request machine's tests,
// which say so.
TEST(ChannelStateTableTest, EveryRowIsWalkedByATest) {
  using State = Channel::State;
  using Event = Channel::Event;
  ExpectEveryRowWalked(
      ChannelStateTable(),
      {
          Walk(State::kConnecting, Event::kConnected, State::kReady,
               "UnconnectedRequestMachineTest.QueuedRequestedReRequestedDone"),
          Walk(State::kConnecting, Event::kClose, State::kClosed,
               "UnconnectedRequestMachineTest.CloseInQueuedEndsTheRecvOnce"),
          Walk(State::kReady, Event::kClose, State::kClosed,
               "RequestMachineTest.CloseInRequestedEndsTheRecvOnceAndKeepsItsDestination"),
      });
}

TEST_F(ChannelTest, FirstRecvTakesTheMetaDataRoundTripAndTheNextHitsTheCache) {
  const ParsedKey key = Key("weights");
  constexpr int64_t kElements = 16384;
  constexpr int64_t kBytes = kElements * sizeof(float);

  const Tensor first_sent = Floats(&acceptor_.pool, kElements, 1.5f);
  std::shared_ptr<RecvOutcome> first = Transfer(1, key, first_sent);
  ASSERT_TRUE(first->status.ok()) << first->status;
  EXPECT_FALSE(first->is_dead);
  EXPECT_TRUE(first->tensor.ContentEquals(first_sent));
  EXPECT_EQ(Get(owner_.stats.requests), 1);
  EXPECT_EQ(Get(owner_.stats.meta_cache_hits), 0);
  EXPECT_EQ(Get(acceptor_.stats.meta_responses), 1);
  EXPECT_EQ(Get(owner_.stats.re_requests), 1);
  EXPECT_EQ(Get(acceptor_.stats.content_writes), 1);
  EXPECT_EQ(Get(acceptor_.stats.content_bytes), kBytes);
  EXPECT_EQ(Get(owner_.stats.control_messages), 2) << "REQUEST and RE_REQUEST";
  EXPECT_EQ(Get(acceptor_.stats.control_messages), 1) << "META_DATA_RESPONSE";
  ASSERT_NE(owner_.memory.CachedMeta(key.full_key), nullptr);
  EXPECT_EQ(owner_.memory.CachedMeta(key.full_key)->tensor_bytes, static_cast<uint64_t>(kBytes));

  // Another step asks for the same key: the cached meta-data names the destination in REQUEST
  // and the sender writes at once.
  const Tensor second_sent = Floats(&acceptor_.pool, kElements, -2.0f);
  std::shared_ptr<RecvOutcome> second = Transfer(2, key, second_sent);
  ASSERT_TRUE(second->status.ok()) << second->status;
  EXPECT_TRUE(second->tensor.ContentEquals(second_sent));
  EXPECT_FALSE(second->tensor.SharesBufferWith(first->tensor));
  EXPECT_EQ(Get(owner_.stats.requests), 2);
  EXPECT_EQ(Get(owner_.stats.meta_cache_hits), 1);
  EXPECT_EQ(Get(acceptor_.stats.meta_responses), 1) << "no META_DATA_RESPONSE on a cache hit";
  EXPECT_EQ(Get(owner_.stats.re_requests), 1);
  EXPECT_EQ(Get(owner_.stats.control_messages), 3) << "REQUEST alone";
  EXPECT_EQ(Get(acceptor_.stats.content_writes), 2);
  EXPECT_EQ(Get(acceptor_.stats.content_bytes), 2 * kBytes);

  // Written in place: the results are the owner's registered pool memory, and neither side
  // copied a byte.
  MemoryRegion region;
  EXPECT_TRUE(owner_.pool.FindRegion(first->tensor.data(), kBytes, &region));
  EXPECT_TRUE(owner_.pool.FindRegion(second->tensor.data(), kBytes, &region));
  EXPECT_EQ(Get(owner_.stats.copies), 0);
  EXPECT_EQ(Get(acceptor_.stats.copies), 0);
  EXPECT_EQ(Get(owner_.transfer_stats.copies), 0);
  EXPECT_EQ(Get(owner_.stats.transient_registrations), 0);

  Settle();
  EXPECT_EQ(first->calls, 1);
  EXPECT_EQ(second->calls, 1);
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 0u);
  EXPECT_EQ(acceptor_.channel->sending()->responses_in_progress(), 0u);
  EXPECT_EQ(Get(owner_.stats.dropped_imms), 0);
  EXPECT_EQ(owner_.channel->message_buffer()->pending(), 0u) << "every slot was acknowledged";
  EXPECT_EQ(acceptor_.channel->message_buffer()->pending(), 0u);
}

TEST_F(ChannelTest, AStaleCachedMetaDataFallsBackToTheRoundTrip) {
  const ParsedKey key = Key("reshaped");
  std::vector<Tensor> sent = {Floats(&acceptor_.pool, 1000, 1.0f),
                              Floats(&acceptor_.pool, 10, 2.0f)};
  Tensor ints = *Tensor::Allocate(&acceptor_.pool, DataType::kInt32, TensorShape::Of({5, 2}));
  for (int i = 0; i < 10; ++i) ints.flat<int32_t>()[i] = -i;
  sent.push_back(ints);
  sent.push_back(Tensor());  // dead
  for (size_t i = 0; i < sent.size(); ++i) {
    SCOPED_TRACE(i);
    const bool dead = !sent[i].IsInitialized();
    Send(static_cast<int64_t>(i), key, sent[i], dead);
    std::shared_ptr<RecvOutcome> out = StartRecv(static_cast<int64_t>(i), key);
    ASSERT_TRUE(Pump([&] { return out->calls > 0; }));
    ASSERT_TRUE(out->status.ok()) << out->status;
    EXPECT_EQ(out->is_dead, dead);
    if (!dead) {
      EXPECT_TRUE(out->tensor.ContentEquals(sent[i]));
    }
  }
  Settle();
  // Every step after the first offered the previous meta-data, and the sender answered each
  // mismatch with the current one.
  EXPECT_EQ(Get(owner_.stats.meta_cache_hits), 3);
  EXPECT_EQ(Get(acceptor_.stats.meta_responses), 4);
  EXPECT_EQ(Get(owner_.stats.re_requests), 4);
  EXPECT_EQ(Get(owner_.stats.channel_errors) + Get(acceptor_.stats.channel_errors), 0);
  // A dead tensor's meta-data does not replace what the next step will most likely send.
  ASSERT_NE(owner_.memory.CachedMeta(key.full_key), nullptr);
  EXPECT_EQ(owner_.memory.CachedMeta(key.full_key)->dtype, DataType::kInt32);
}

TEST_F(ChannelTest, RecvBeforeSendWaitsForTheTensor) {
  const ParsedKey key = Key("activations");
  std::shared_ptr<RecvOutcome> out = StartRecv(1, key);
  ASSERT_TRUE(Pump([&] { return acceptor_.channel->message_buffer()->messages_received() >= 1; }));
  Settle();
  EXPECT_EQ(out->calls, 0);
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 1u);
  EXPECT_EQ(Get(acceptor_.stats.meta_responses), 0) << "nothing to describe yet";

  const Tensor sent = Floats(&acceptor_.pool, 1000, 0.25f);
  Send(1, key, sent);
  ASSERT_TRUE(Pump([&] { return out->calls > 0; }));
  ASSERT_TRUE(out->status.ok()) << out->status;
  EXPECT_TRUE(out->tensor.ContentEquals(sent));
  Settle();
  EXPECT_EQ(out->calls, 1);
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 0u);
}

// The sender's response waits for its local tensor under one ticket of the inbox, which the
// tensor's arrival or the channel's close (cancelling the wait) gives back.
TEST_F(ChannelTest, AWaitingResponseHoldsOneInboxTicketUntilItsTensorOrTheClose) {
  std::shared_ptr<RecvOutcome> out = StartRecv(1, Key("w"));
  ASSERT_TRUE(Pump([&] { return acceptor_.channel->message_buffer()->messages_received() >= 1; }));
  Settle();
  EXPECT_EQ(acceptor_.local_tensors.open_tickets(), 1u);
  Send(1, Key("w"), Floats(&acceptor_.pool, 10, 1.0f));
  ASSERT_TRUE(Pump([&] { return out->calls > 0; }));
  Settle();
  EXPECT_TRUE(out->status.ok()) << out->status;
  EXPECT_EQ(acceptor_.local_tensors.open_tickets(), 0u);

  std::shared_ptr<RecvOutcome> never = StartRecv(2, Key("w"));
  ASSERT_TRUE(Pump([&] { return acceptor_.channel->message_buffer()->messages_received() >= 2; }));
  Settle();
  EXPECT_EQ(acceptor_.local_tensors.open_tickets(), 1u);
  acceptor_.channel->Close(absl::UnavailableError("going away"));
  Settle();
  EXPECT_EQ(acceptor_.local_tensors.open_tickets(), 0u);
  // A send after the close finds no waiter; the step keeps it until it is cleaned up.
  Send(2, Key("w"), Floats(&acceptor_.pool, 10, 2.0f));
  Settle();
  EXPECT_EQ(acceptor_.local_tensors.open_tickets(), 0u);
}

TEST_F(ChannelTest, DeadEmptyAndStringTensorsArriveAsSuch) {
  const ParsedKey dead_key = Key("dead"), empty_key = Key("empty"), string_key = Key("strings");
  const Tensor empty =
      *Tensor::Allocate(&acceptor_.pool, DataType::kFloat32, TensorShape::Of({0, 3}));
  Tensor strings = Tensor::Make(DataType::kString, TensorShape::Of({3}));
  strings.strings()[0] = "";
  strings.strings()[1] = "hello";
  strings.strings()[2] = std::string(20000, 'x');  // larger than a message slot

  // Twice: the second step shows which of them the meta-data cache may serve.
  for (int64_t step = 1; step <= 2; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    Send(step, dead_key, Tensor(), /*is_dead=*/true);
    Send(step, empty_key, empty);
    Send(step, string_key, strings);
    std::shared_ptr<RecvOutcome> dead = StartRecv(step, dead_key);
    std::shared_ptr<RecvOutcome> got_empty = StartRecv(step, empty_key);
    std::shared_ptr<RecvOutcome> got_strings = StartRecv(step, string_key);
    ASSERT_TRUE(Pump([&] { return dead->calls + got_empty->calls + got_strings->calls == 3; }));

    ASSERT_TRUE(dead->status.ok()) << dead->status;
    EXPECT_TRUE(dead->is_dead);
    EXPECT_FALSE(dead->tensor.IsInitialized());

    ASSERT_TRUE(got_empty->status.ok()) << got_empty->status;
    EXPECT_FALSE(got_empty->is_dead);
    EXPECT_EQ(got_empty->tensor.dtype(), DataType::kFloat32);
    EXPECT_EQ(got_empty->tensor.shape(), TensorShape::Of({0, 3}));
    EXPECT_EQ(got_empty->tensor.NumElements(), 0);

    ASSERT_TRUE(got_strings->status.ok()) << got_strings->status;
    EXPECT_FALSE(got_strings->is_dead);
    EXPECT_TRUE(got_strings->tensor.ContentEquals(strings));
  }
  // Only the empty tensor's meta-data may be reused: a dead tensor's says nothing about the next
  // step's, and a string tensor's size is its serialization's.
  EXPECT_EQ(Get(owner_.stats.meta_cache_hits), 1);
  EXPECT_EQ(Get(acceptor_.stats.meta_responses), 5);
  EXPECT_EQ(Get(acceptor_.stats.errors_sent), 0);
  Settle();
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 0u);
}

TEST_F(ChannelTest, KeyOfAnotherSourceTaskEndsTheRecvWithTheSendersError) {
  const ParsedKey key = Key("elsewhere", /*src_task=*/2);
  std::shared_ptr<RecvOutcome> out = StartRecv(1, key);
  ASSERT_TRUE(Pump([&] { return out->calls > 0; }));
  EXPECT_EQ(out->status.code(), absl::StatusCode::kInvalidArgument) << out->status;
  EXPECT_THAT(std::string(out->status.message()),
              HasSubstr(absl::StrCat("task ", TaskName(kJob, kAcceptorTaskIndex),
                                     " could not send '", key.full_key, "'")));
  EXPECT_THAT(std::string(out->status.message()),
              HasSubstr(absl::StrCat("names source task ", TaskName(kJob, 2))));
  EXPECT_EQ(Get(acceptor_.stats.errors_sent), 1);

  // A key from a previous incarnation of the sender is refused the same way, as Aborted.
  const ParsedKey stale = Key("stale", kAcceptorTaskIndex, kAcceptorIncarnation + 1);
  std::shared_ptr<RecvOutcome> restarted = StartRecv(1, stale);
  ASSERT_TRUE(Pump([&] { return restarted->calls > 0; }));
  EXPECT_EQ(restarted->status.code(), absl::StatusCode::kAborted) << restarted->status;
  EXPECT_THAT(std::string(restarted->status.message()), HasSubstr("probably restarted"));
  EXPECT_EQ(Get(acceptor_.stats.errors_sent), 2);

  // Asked again, now by the index its first REQUEST defined: the same error.
  std::shared_ptr<RecvOutcome> again = StartRecv(2, key);
  ASSERT_TRUE(Pump([&] { return again->calls > 0; }));
  EXPECT_EQ(again->status.code(), absl::StatusCode::kInvalidArgument) << again->status;
  EXPECT_THAT(std::string(again->status.message()),
              HasSubstr(absl::StrCat("names source task ", TaskName(kJob, 2))));
  EXPECT_EQ(Get(owner_.stats.indexed_requests), 1);

  Settle();
  EXPECT_EQ(out->calls, 1);
  EXPECT_EQ(restarted->calls, 1);
  EXPECT_EQ(again->calls, 1);
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 0u);
  // A sender's error ends one recv, not the channel.
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);
  EXPECT_EQ(acceptor_.channel->state(), Channel::State::kReady);
  const Tensor sent = Floats(&acceptor_.pool, 8, 1.0f);
  std::shared_ptr<RecvOutcome> good = Transfer(1, Key("fine"), sent);
  ASSERT_TRUE(good->status.ok()) << good->status;
  EXPECT_TRUE(good->tensor.ContentEquals(sent));
}

TEST_F(ChannelTest, AbortStepEndsARecvOnceAndKeepsItsMemoryUntilTheSenderAnswers) {
  const ParsedKey key = Key("gradients");
  constexpr int64_t kElements = 4096;
  constexpr int64_t kBytes = kElements * sizeof(float);
  // Step 1 fills the meta-data cache, so step 2's REQUEST names a destination that the sender
  // will write into whenever it gets the tensor.
  std::shared_ptr<RecvOutcome> warm = Transfer(1, key, Floats(&acceptor_.pool, kElements, 1.0f));
  ASSERT_TRUE(warm->status.ok()) << warm->status;
  warm.reset();
  const size_t baseline = owner_.pool.GetStats().allocations;

  std::shared_ptr<RecvOutcome> aborted = StartRecv(2, key);
  std::shared_ptr<RecvOutcome> bystander = StartRecv(3, Key("other step"));
  Settle();
  EXPECT_EQ(Get(owner_.stats.meta_cache_hits), 1);
  EXPECT_EQ(owner_.pool.GetStats().allocations, baseline + 1)
      << "the destination is allocated before asking";

  owner_.channel->receiving()->AbortStep(2, absl::AbortedError("step 2 was aborted"));
  ASSERT_TRUE(Pump([&] { return aborted->calls > 0; }));
  EXPECT_EQ(aborted->status.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(aborted->status.message()), HasSubstr("step 2 was aborted"));
  EXPECT_EQ(bystander->calls, 0) << "another step's recv is untouched";
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 1u) << "only the bystander is pending";
  EXPECT_EQ(owner_.pool.GetStats().allocations, baseline + 1)
      << "the destination stays while the sender may still write into it";

  // The sender answers late: it writes the whole tensor into the destination it was given, the
  // immediate finds the aborted request's record, and that record lets go of its memory.
  Send(2, key, Floats(&acceptor_.pool, kElements, 3.0f));
  ASSERT_TRUE(Pump([&] { return Get(acceptor_.stats.content_writes) == 2; }));
  Settle();
  EXPECT_EQ(aborted->calls, 1);
  EXPECT_EQ(Get(acceptor_.stats.content_bytes), 2 * kBytes);
  EXPECT_EQ(Get(owner_.stats.dropped_imms), 0);
  EXPECT_EQ(owner_.pool.GetStats().allocations, baseline);
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 1u);

  // The channel goes on: the bystander and a new recv of the aborted key both complete.
  const Tensor later = Floats(&acceptor_.pool, kElements, 4.0f);
  Send(3, Key("other step"), Floats(&acceptor_.pool, 2, 1.0f));
  std::shared_ptr<RecvOutcome> again = Transfer(3, key, later);
  ASSERT_TRUE(again->status.ok()) << again->status;
  EXPECT_TRUE(again->tensor.ContentEquals(later));
  ASSERT_TRUE(Pump([&] { return bystander->calls > 0; }));
  EXPECT_TRUE(bystander->status.ok()) << bystander->status;
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 0u);

  // No record is left holding memory: closing now has nothing to quarantine.
  owner_.channel->Close(absl::CancelledError("test over"));
  EXPECT_TRUE(owner_.quarantined.empty());
  EXPECT_EQ(aborted->calls, 1);
}

TEST_F(ChannelTest, AbortBeforeTheMetaDataRoundTripReleasesWithAnEmptyWrite) {
  const ParsedKey key = Key("uncached");
  std::shared_ptr<RecvOutcome> out = StartRecv(1, key);
  Settle();
  owner_.channel->receiving()->AbortStep(1, absl::CancelledError("step 1 was cleaned up"));
  ASSERT_TRUE(Pump([&] { return out->calls > 0; }));
  EXPECT_EQ(out->status.code(), absl::StatusCode::kCancelled);

  // META_DATA_RESPONSE then finds a recv that ended: RE_REQUEST names no destination and the
  // sender's write carries only the immediate that releases the request.
  Send(1, key, Floats(&acceptor_.pool, 1024, 1.0f));
  ASSERT_TRUE(Pump([&] { return Get(acceptor_.stats.content_writes) == 1; }));
  Settle();
  EXPECT_EQ(out->calls, 1);
  EXPECT_EQ(Get(owner_.stats.re_requests), 1);
  EXPECT_EQ(Get(acceptor_.stats.content_bytes), 0);
  EXPECT_EQ(Get(owner_.stats.dropped_imms), 0);
  owner_.channel->Close(absl::CancelledError("test over"));
  EXPECT_TRUE(owner_.quarantined.empty()) << "the record was released";
}

TEST_F(ChannelTest, ExpireRequestsFailsARecvPastItsDeadline) {
  const ParsedKey key = Key("slow producer");
  // A cached meta-data gives the recv a destination before the tensor exists.
  ASSERT_TRUE(Transfer(1, key, Floats(&acceptor_.pool, 512, 1.0f))->status.ok());
  const size_t baseline = owner_.pool.GetStats().allocations;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  std::shared_ptr<RecvOutcome> out = StartRecv(2, key, deadline);
  Settle();
  owner_.channel->receiving()->ExpireRequests(deadline - absl::Seconds(1));
  Settle();
  EXPECT_EQ(out->calls, 0) << "not yet due";

  owner_.channel->receiving()->ExpireRequests(deadline + absl::Milliseconds(1));
  ASSERT_TRUE(Pump([&] { return out->calls > 0; }));
  EXPECT_EQ(out->status.code(), absl::StatusCode::kDeadlineExceeded) << out->status;
  EXPECT_THAT(std::string(out->status.message()), HasSubstr(key.full_key));
  EXPECT_THAT(std::string(out->status.message()), HasSubstr(TaskName(kJob, kAcceptorTaskIndex)));
  EXPECT_THAT(std::string(out->status.message()), HasSubstr("TENSORVERBS_RECV_TIMEOUT_MS"));
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 0u);

  owner_.channel->receiving()->ExpireRequests(deadline + absl::Minutes(1));
  Settle();
  EXPECT_EQ(out->calls, 1);
  EXPECT_EQ(owner_.pool.GetStats().allocations, baseline + 1) << "kept for a late write";

  // The sender gives up too (its step is cleaned up): its ERROR_STATUS releases the record
  // without a second callback.
  acceptor_.rendezvous_mgr->Cleanup(2);
  ASSERT_TRUE(Pump([&] { return owner_.pool.GetStats().allocations == baseline; }));
  Settle();
  EXPECT_EQ(Get(acceptor_.stats.errors_sent), 1);
  EXPECT_EQ(out->calls, 1);
  EXPECT_EQ(out->status.code(), absl::StatusCode::kDeadlineExceeded) << "the first end stands";
}

// A channel holds at most TENSORVERBS_MAX_PENDING_RECVS recvs waiting for the peer; one more
// fails at once, and a finished recv gives its place back.
class PendingBoundTest : public ChannelTest {
 protected:
  void Configure(ChannelEnv* env) override { env->options.max_pending_recvs = 2; }
};

TEST_F(PendingBoundTest, RecvsBeyondThePendingBoundFailAtOnceAndAFinishedOneGivesItsPlaceBack) {
  std::shared_ptr<RecvOutcome> a = StartRecv(1, Key("a"));
  std::shared_ptr<RecvOutcome> b = StartRecv(1, Key("b"));
  std::shared_ptr<RecvOutcome> c = StartRecv(1, Key("c"));
  EXPECT_EQ(a->calls, 0);
  EXPECT_EQ(b->calls, 0);
  ASSERT_EQ(c->calls, 1) << "refused at once, before any message";
  EXPECT_EQ(c->status.code(), absl::StatusCode::kResourceExhausted) << c->status;
  EXPECT_THAT(std::string(c->status.message()), HasSubstr("TENSORVERBS_MAX_PENDING_RECVS=2"));
  EXPECT_THAT(std::string(c->status.message()), HasSubstr(TaskName(kJob, kAcceptorTaskIndex)));
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 2u);
  Settle();
  EXPECT_EQ(Get(owner_.stats.requests), 2) << "the refused recv asked for nothing";

  const Tensor sent = Floats(&acceptor_.pool, 64, 1.0f);
  Send(1, Key("a"), sent);
  ASSERT_TRUE(Pump([&] { return a->calls > 0; }));
  ASSERT_TRUE(a->status.ok()) << a->status;
  Settle();
  std::shared_ptr<RecvOutcome> d = StartRecv(1, Key("d"));
  Settle();
  EXPECT_EQ(d->calls, 0) << "the finished recv's place was free";
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 2u);
  Send(1, Key("b"), sent);
  Send(1, Key("d"), sent);
  ASSERT_TRUE(Pump([&] { return b->calls > 0 && d->calls > 0; }));
  EXPECT_TRUE(b->status.ok() && d->status.ok()) << b->status << " " << d->status;
  Settle();
  EXPECT_EQ(c->calls, 1);
}

// A receiver that never asks for the content after the meta-data would pin the sender's tensor
// for the channel's life; the sender drops it after the response timeout.
class ResponseExpiryTest : public ChannelTest {
 protected:
  // The sender's response timeout is its recv timeout plus its peer timeout: 5 s.
  void Configure(ChannelEnv* env) override {
    if (env != &acceptor_.env) return;
    env->transfer.recv_timeout = absl::Seconds(4);
    env->transfer.peer_timeout = absl::Seconds(1);
  }
};

TEST_F(ResponseExpiryTest, AResponseTheReceiverNeverAnswersIsDroppedAndALateAnswerIgnored) {
  const ParsedKey key = Key("pinned");
  const Tensor sent = Floats(&acceptor_.pool, 4096, 1.0f);
  Send(1, key, sent);
  std::shared_ptr<RecvOutcome> out = StartRecv(1, key);
  // Stop right after the sender's META_DATA_RESPONSE, before the receiver reads it.
  ASSERT_TRUE(Pump([&] { return Get(acceptor_.stats.meta_responses) == 1; }));
  EXPECT_EQ(acceptor_.channel->sending()->responses_in_progress(), 1u);
  acceptor_.channel->sending()->ExpireResponses(absl::Now() + absl::Seconds(1));
  EXPECT_EQ(acceptor_.channel->sending()->responses_in_progress(), 1u) << "not yet due";
  acceptor_.channel->sending()->ExpireResponses(absl::Now() + absl::Seconds(6));
  EXPECT_EQ(acceptor_.channel->sending()->responses_in_progress(), 0u) << "the tensor is let go";
  EXPECT_EQ(Get(acceptor_.stats.errors_sent), 1);

  // The receiver answers the meta-data (its RE_REQUEST crosses the ERROR_STATUS), then takes
  // the error; the sender ignores the late RE_REQUEST and the channel stays up.
  ASSERT_TRUE(Pump([&] { return out->calls > 0; }));
  Settle();
  EXPECT_EQ(out->calls, 1);
  EXPECT_EQ(out->status.code(), absl::StatusCode::kDeadlineExceeded) << out->status;
  EXPECT_THAT(std::string(out->status.message()), HasSubstr("did not ask for the content"));
  EXPECT_EQ(Get(acceptor_.stats.dropped_imms), 1) << "the crossing RE_REQUEST";
  EXPECT_EQ(acceptor_.channel->state(), Channel::State::kReady);
  EXPECT_EQ(owner_.channel->state(), Channel::State::kReady);
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 0u);
  EXPECT_EQ(Get(acceptor_.stats.content_writes), 0) << "nothing was written";

  // The channel carries the next recvs, reusing the index.
  std::shared_ptr<RecvOutcome> next = Transfer(2, key, sent);
  ASSERT_TRUE(next->status.ok()) << next->status;
  EXPECT_TRUE(next->tensor.ContentEquals(sent));
}

TEST_F(ChannelTest, CloseFailsEveryPendingRecvOnceAndQuarantinesTheirMemory) {
  // Two keys with cached meta-data, so their step-2 destinations exist before the tensors do,
  // and one without, which has no memory yet.
  constexpr int64_t kElementsA = 1000, kElementsB = 3000;
  ASSERT_TRUE(Transfer(1, Key("a"), Floats(&acceptor_.pool, kElementsA, 1.0f))->status.ok());
  ASSERT_TRUE(Transfer(1, Key("b"), Floats(&acceptor_.pool, kElementsB, 1.0f))->status.ok());
  std::vector<std::shared_ptr<RecvOutcome>> pending = {
      StartRecv(2, Key("a")), StartRecv(2, Key("b")), StartRecv(2, Key("c"))};
  Settle();
  EXPECT_EQ(owner_.channel->receiving()->pending_requests(), 3u);

  const absl::Time before = absl::Now();
  owner_.channel->Close(absl::UnavailableError("task went away"));
  const absl::Time after = absl::Now();
  ASSERT_TRUE(Pump([&] {
    for (const auto& p : pending) {
      if (p->calls == 0) return false;
    }
    return true;
  }));
  owner_.channel->Close(absl::InternalError("closed again"));  // idempotent
  Settle();
  for (const auto& p : pending) {
    EXPECT_EQ(p->calls, 1);
    EXPECT_EQ(p->status.code(), absl::StatusCode::kUnavailable) << p->status;
    EXPECT_THAT(std::string(p->status.message()), HasSubstr("task went away"));
  }
  EXPECT_EQ(owner_.channel->state(), Channel::State::kClosed);
  EXPECT_EQ(owner_.channel->close_status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(Get(owner_.stats.channel_errors), 1);

  // The peer may still write into the destinations it was given: they are kept, not freed.
  ASSERT_EQ(owner_.quarantined.size(), 1u);
  const Side::Quarantined& q = owner_.quarantined[0];
  std::vector<size_t> sizes;
  for (const Tensor& t : q.memory) {
    sizes.push_back(t.TotalBytes());
    MemoryRegion region;
    EXPECT_TRUE(owner_.pool.FindRegion(t.data(), t.TotalBytes(), &region));
  }
  EXPECT_THAT(sizes, ::testing::UnorderedElementsAre(kElementsA * sizeof(float),
                                                     kElementsB * sizeof(float)));
  EXPECT_GE(q.until, before + owner_.env.quarantine());
  EXPECT_LE(q.until, after + owner_.env.quarantine());

  // A closed channel refuses new recvs at once.
  std::shared_ptr<RecvOutcome> late = StartRecv(3, Key("a"));
  EXPECT_EQ(late->calls, 1);
  EXPECT_EQ(late->status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(late->status.message()), HasSubstr("is closed"));
}

}  // namespace
}  // namespace tensorverbs::protocol::channel_testing
