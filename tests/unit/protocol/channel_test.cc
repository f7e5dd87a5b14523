// The grpc+verbs channel and its two state machines, driven directly: an owner and an acceptor
// channel over two in-process loopback domains, with the test playing both progress threads.
// No Server and no gRPC, so every message, counter and close reason is the channel's own.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/unit/protocol/channel_harness.h"

namespace tensorverbs::protocol::channel_testing {
namespace {

using ::testing::HasSubstr;

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
  EXPECT_EQ(owner_.channel->pending_requests(), 0u);
  EXPECT_EQ(acceptor_.channel->responses_in_progress(), 0u);
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
  EXPECT_EQ(owner_.channel->pending_requests(), 1u);
  EXPECT_EQ(Get(acceptor_.stats.meta_responses), 0) << "nothing to describe yet";

  const Tensor sent = Floats(&acceptor_.pool, 1000, 0.25f);
  Send(1, key, sent);
  ASSERT_TRUE(Pump([&] { return out->calls > 0; }));
  ASSERT_TRUE(out->status.ok()) << out->status;
  EXPECT_TRUE(out->tensor.ContentEquals(sent));
  Settle();
  EXPECT_EQ(out->calls, 1);
  EXPECT_EQ(owner_.channel->pending_requests(), 0u);
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
  EXPECT_EQ(owner_.channel->pending_requests(), 0u);
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
  EXPECT_EQ(owner_.channel->pending_requests(), 0u);
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

  owner_.channel->AbortStep(2, absl::AbortedError("step 2 was aborted"));
  ASSERT_TRUE(Pump([&] { return aborted->calls > 0; }));
  EXPECT_EQ(aborted->status.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(aborted->status.message()), HasSubstr("step 2 was aborted"));
  EXPECT_EQ(bystander->calls, 0) << "another step's recv is untouched";
  EXPECT_EQ(owner_.channel->pending_requests(), 1u) << "only the bystander is pending";
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
  EXPECT_EQ(owner_.channel->pending_requests(), 1u);

  // The channel goes on: the bystander and a new recv of the aborted key both complete.
  const Tensor later = Floats(&acceptor_.pool, kElements, 4.0f);
  Send(3, Key("other step"), Floats(&acceptor_.pool, 2, 1.0f));
  std::shared_ptr<RecvOutcome> again = Transfer(3, key, later);
  ASSERT_TRUE(again->status.ok()) << again->status;
  EXPECT_TRUE(again->tensor.ContentEquals(later));
  ASSERT_TRUE(Pump([&] { return bystander->calls > 0; }));
  EXPECT_TRUE(bystander->status.ok()) << bystander->status;
  EXPECT_EQ(owner_.channel->pending_requests(), 0u);

  // No record is left holding memory: closing now has nothing to quarantine.
  owner_.channel->Close(absl::CancelledError("test over"));
  EXPECT_TRUE(owner_.quarantined.empty());
  EXPECT_EQ(aborted->calls, 1);
}

TEST_F(ChannelTest, AbortBeforeTheMetaDataRoundTripReleasesWithAnEmptyWrite) {
  const ParsedKey key = Key("uncached");
  std::shared_ptr<RecvOutcome> out = StartRecv(1, key);
  Settle();
  owner_.channel->AbortStep(1, absl::CancelledError("step 1 was cleaned up"));
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
  owner_.channel->ExpireRequests(deadline - absl::Seconds(1));
  Settle();
  EXPECT_EQ(out->calls, 0) << "not yet due";

  owner_.channel->ExpireRequests(deadline + absl::Milliseconds(1));
  ASSERT_TRUE(Pump([&] { return out->calls > 0; }));
  EXPECT_EQ(out->status.code(), absl::StatusCode::kDeadlineExceeded) << out->status;
  EXPECT_THAT(std::string(out->status.message()), HasSubstr(key.full_key));
  EXPECT_THAT(std::string(out->status.message()), HasSubstr(TaskName(kJob, kAcceptorTaskIndex)));
  EXPECT_THAT(std::string(out->status.message()), HasSubstr("TENSORVERBS_RECV_TIMEOUT_MS"));
  EXPECT_EQ(owner_.channel->pending_requests(), 0u);

  owner_.channel->ExpireRequests(deadline + absl::Minutes(1));
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
  void Configure(ChannelEnv* env) override { env->max_pending_recvs = 2; }
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
  EXPECT_EQ(owner_.channel->pending_requests(), 2u);
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
  EXPECT_EQ(owner_.channel->pending_requests(), 2u);
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
  void Configure(ChannelEnv* env) override { env->response_timeout = absl::Seconds(5); }
};

TEST_F(ResponseExpiryTest, AResponseTheReceiverNeverAnswersIsDroppedAndALateAnswerIgnored) {
  const ParsedKey key = Key("pinned");
  const Tensor sent = Floats(&acceptor_.pool, 4096, 1.0f);
  Send(1, key, sent);
  std::shared_ptr<RecvOutcome> out = StartRecv(1, key);
  // Stop right after the sender's META_DATA_RESPONSE, before the receiver reads it.
  ASSERT_TRUE(Pump([&] { return Get(acceptor_.stats.meta_responses) == 1; }));
  EXPECT_EQ(acceptor_.channel->responses_in_progress(), 1u);
  acceptor_.channel->ExpireResponses(absl::Now() + absl::Seconds(1));
  EXPECT_EQ(acceptor_.channel->responses_in_progress(), 1u) << "not yet due";
  acceptor_.channel->ExpireResponses(absl::Now() + absl::Seconds(6));
  EXPECT_EQ(acceptor_.channel->responses_in_progress(), 0u) << "the tensor is let go";
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
  EXPECT_EQ(owner_.channel->pending_requests(), 0u);
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
  EXPECT_EQ(owner_.channel->pending_requests(), 3u);

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
  EXPECT_GE(q.until, before + owner_.env.quarantine);
  EXPECT_LE(q.until, after + owner_.env.quarantine);

  // A closed channel refuses new recvs at once.
  std::shared_ptr<RecvOutcome> late = StartRecv(3, Key("a"));
  EXPECT_EQ(late->calls, 1);
  EXPECT_EQ(late->status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(late->status.message()), HasSubstr("is closed"));
}

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
  EXPECT_EQ(owner_.channel->pending_requests(), 0u);
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
  owner_.env.push = true;
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
  owner_.env.data_validation = true;
  acceptor_.env.data_validation = true;
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

class UnconnectedChannelTest : public ChannelTest {
 protected:
  bool ConnectOnSetUp() const override { return false; }
};

TEST_F(UnconnectedChannelTest, RecvsStartedBeforeConnectWaitAndThoseThatEndedAreNeverSent) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  std::shared_ptr<RecvOutcome> waits = StartRecv(1, Key("a"));
  std::shared_ptr<RecvOutcome> aborted = StartRecv(2, Key("b"));
  std::shared_ptr<RecvOutcome> expired = StartRecv(3, Key("c"), deadline);
  EXPECT_EQ(owner_.channel->pending_requests(), 3u);

  owner_.channel->AbortStep(2, absl::AbortedError("step 2 was aborted"));
  owner_.channel->ExpireRequests(deadline + absl::Milliseconds(1));
  Settle();
  EXPECT_EQ(aborted->calls, 1);
  EXPECT_EQ(aborted->status.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(expired->calls, 1);
  EXPECT_EQ(expired->status.code(), absl::StatusCode::kUnavailable) << expired->status;
  EXPECT_THAT(std::string(expired->status.message()),
              HasSubstr("was not set up before the recv's deadline"));
  EXPECT_EQ(waits->calls, 0);
  EXPECT_EQ(owner_.channel->pending_requests(), 1u);

  const Tensor sent = Floats(&acceptor_.pool, 100, 1.0f);
  Send(1, Key("a"), sent);
  ASSERT_NO_FATAL_FAILURE(ConnectChannels());
  ASSERT_TRUE(Pump([&] { return waits->calls > 0; }));
  ASSERT_TRUE(waits->status.ok()) << waits->status;
  EXPECT_TRUE(waits->tensor.ContentEquals(sent));
  Settle();
  EXPECT_EQ(Get(owner_.stats.requests), 1) << "the recvs that ended while queued never went out";
  EXPECT_EQ(aborted->calls, 1);
  EXPECT_EQ(expired->calls, 1);
  EXPECT_EQ(owner_.channel->pending_requests(), 0u);
  // Nothing of theirs was left behind for a sender to write into.
  owner_.channel->Close(absl::CancelledError("test over"));
  EXPECT_TRUE(owner_.quarantined.empty());
}

TEST_F(ChannelTest, PoolRegistrationStagesMemoryOutsideThePoolOnceEachSide) {
  // Neither tensor is in a registered pool: the sender stages its source, the receiver lands
  // the content in a registered proxy and copies it out.
  const Tensor sent = Floats(CpuAllocator(), 5000, 0.5f);
  Send(1, Key("heap"), sent);
  std::shared_ptr<RecvOutcome> out =
      StartRecv(1, Key("heap"), absl::InfiniteFuture(), CpuAllocator());
  ASSERT_TRUE(Pump([&] { return out->calls > 0; }));
  ASSERT_TRUE(out->status.ok()) << out->status;
  EXPECT_TRUE(out->tensor.ContentEquals(sent));
  EXPECT_EQ(out->tensor.allocator(), CpuAllocator()) << "the caller's allocator, not the proxy's";
  EXPECT_EQ(Get(acceptor_.stats.copies), 1);
  EXPECT_EQ(Get(owner_.stats.copies), 1);
  EXPECT_EQ(Get(owner_.stats.copied_bytes), 5000 * static_cast<int64_t>(sizeof(float)));
  EXPECT_EQ(Get(owner_.transfer_stats.copies), 1) << "counted for the worker too";
}

// The designs a transport can run, with the copies and registrations each makes per recv of a
// float tensor (from and into pool memory).
struct Strategy {
  const char* name;
  VerbsMode mode;
  Registration registration;
  int64_t copies_per_side;
  int64_t transient_registrations_per_side;
};

void PrintTo(const Strategy& s, std::ostream* os) { *os << s.name; }

class StrategyTest : public ChannelTest, public ::testing::WithParamInterface<Strategy> {
 protected:
  void Configure(ChannelEnv* env) override {
    env->mode = GetParam().mode;
    env->registration = GetParam().registration;
  }
};

TEST_P(StrategyTest, DeliversIntactTensorsWithTheDesignsCopies) {
  const Strategy& strategy = GetParam();
  const ParsedKey key = Key("layer");
  constexpr int64_t kElements = 20000;
  constexpr int64_t kBytes = kElements * sizeof(float);
  for (int64_t step = 1; step <= 2; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    const Tensor sent = Floats(&acceptor_.pool, kElements, static_cast<float>(step));
    std::shared_ptr<RecvOutcome> out = Transfer(step, key, sent);
    ASSERT_TRUE(out->status.ok()) << out->status;
    EXPECT_FALSE(out->is_dead);
    EXPECT_TRUE(out->tensor.ContentEquals(sent));
    for (const Side* side : {&owner_, &acceptor_}) {
      SCOPED_TRACE(side == &owner_ ? "receiver" : "sender");
      EXPECT_EQ(Get(side->stats.copies), step * strategy.copies_per_side);
      EXPECT_EQ(Get(side->stats.copied_bytes), step * strategy.copies_per_side * kBytes);
      EXPECT_EQ(Get(side->stats.transient_registrations),
                step * strategy.transient_registrations_per_side);
    }
  }
  // The second step reused what the first learned (the cached meta-data, or in copy mode the
  // receiver's buffer for the name): one META_DATA_RESPONSE in all.
  EXPECT_EQ(Get(acceptor_.stats.meta_responses), 1);
  EXPECT_EQ(Get(owner_.stats.re_requests), 1);

  // Strings and dead tensors go through every design too.
  Tensor strings = Tensor::Make(DataType::kString, TensorShape::Of({2}));
  strings.strings()[0] = "first";
  strings.strings()[1] = std::string(9000, 'y');
  std::shared_ptr<RecvOutcome> got_strings = Transfer(3, Key("names"), strings);
  ASSERT_TRUE(got_strings->status.ok()) << got_strings->status;
  EXPECT_TRUE(got_strings->tensor.ContentEquals(strings));
  Send(3, Key("nothing"), Tensor(), /*is_dead=*/true);
  std::shared_ptr<RecvOutcome> dead = StartRecv(3, Key("nothing"));
  ASSERT_TRUE(Pump([&] { return dead->calls > 0; }));
  ASSERT_TRUE(dead->status.ok()) << dead->status;
  EXPECT_TRUE(dead->is_dead);

  Settle();
  EXPECT_EQ(owner_.channel->pending_requests(), 0u);
  EXPECT_EQ(acceptor_.channel->responses_in_progress(), 0u);
  EXPECT_EQ(Get(owner_.stats.channel_errors) + Get(acceptor_.stats.channel_errors), 0);
}

INSTANTIATE_TEST_SUITE_P(
    Designs, StrategyTest,
    ::testing::Values(
        Strategy{"ZeroCopyPool", VerbsMode::kZeroCopy, Registration::kPool, 0, 0},
        // Seed 002: laid out in the sender's buffer, copied out of the receiver's.
        Strategy{"CopyMode", VerbsMode::kCopy, Registration::kPool, 1, 0},
        // Each buffer pinned for its transfer: no copies, one registration a side.
        Strategy{"PerTransfer", VerbsMode::kZeroCopy, Registration::kPerTransfer, 0, 1},
        // Nothing but staging buffers is registered: one staging copy a side.
        Strategy{"CopyRegistration", VerbsMode::kZeroCopy, Registration::kCopy, 1, 0}),
    [](const ::testing::TestParamInfo<Strategy>& info) { return info.param.name; });

TEST_F(ChannelTest, PerTransferRegistrationMovesMemoryOutsideThePoolWithoutCopies) {
  owner_.env.registration = Registration::kPerTransfer;
  acceptor_.env.registration = Registration::kPerTransfer;
  const Tensor sent = Floats(CpuAllocator(), 5000, 0.75f);
  Send(1, Key("heap"), sent);
  std::shared_ptr<RecvOutcome> out =
      StartRecv(1, Key("heap"), absl::InfiniteFuture(), CpuAllocator());
  ASSERT_TRUE(Pump([&] { return out->calls > 0; }));
  ASSERT_TRUE(out->status.ok()) << out->status;
  EXPECT_TRUE(out->tensor.ContentEquals(sent));
  EXPECT_EQ(Get(owner_.stats.copies) + Get(acceptor_.stats.copies), 0);
  EXPECT_EQ(Get(owner_.stats.transient_registrations), 1);
  EXPECT_EQ(Get(acceptor_.stats.transient_registrations), 1);
}

// Large destinations (ChannelEnv::large_in_flight): 128 KiB counts as large here, and a
// channel hands its sender one such destination for a ready tensor at a time (plus one named
// in a REQUEST from the cached meta-data).
class LargeDestinationTest : public ChannelTest {
 protected:
  static constexpr int64_t kElements = 32768;  // 128 KiB of floats
  void Configure(ChannelEnv* env) override {
    env->large_bytes = uint64_t{64} << 10;
    env->large_in_flight = 1;
  }

  // Sends `count` large tensors in `step` and receives them all at once. Each callback checks
  // its tensor and lets go of it, so the owner's live pool allocations are the destinations
  // the sender may write plus results not yet handed to their callback. Returns the peak.
  size_t ReceiveAtOnce(int64_t step, int count) {
    std::vector<ParsedKey> keys;
    for (int i = 0; i < count; ++i) {
      keys.push_back(Key(absl::StrCat("layer", i)));
      Send(step, keys.back(), Floats(&acceptor_.pool, kElements, static_cast<float>(step + i)));
    }
    auto landed = std::make_shared<int>(0);
    for (int i = 0; i < count; ++i) {
      const Tensor expected = Floats(CpuAllocator(), kElements, static_cast<float>(step + i));
      owner_.channel->StartRecv(
          step, keys_.Intern(keys[i]), &owner_.pool, absl::InfiniteFuture(),
          [landed, expected, i](const absl::Status& s, const Tensor& t, bool) {
            EXPECT_TRUE(s.ok()) << "recv " << i << ": " << s;
            EXPECT_TRUE(t.ContentEquals(expected)) << "recv " << i;
            ++*landed;
          });
    }
    size_t peak = 0;
    EXPECT_TRUE(Pump([&] {
      peak = std::max(peak, owner_.pool.GetStats().allocations);
      return *landed == count;
    }));
    Settle();
    EXPECT_EQ(*landed, count);
    EXPECT_EQ(owner_.pool.GetStats().allocations, 0u);
    return peak;
  }
};

TEST_F(LargeDestinationTest, ManyLargeRecvsHoldAFewDestinationsAtATimeAndAllLand) {
  constexpr int kRecvs = 8;
  // No meta-data cached: every REQUEST goes without a destination, and the sender's answers
  // get one each as the one before lands (one live destination, and one result on its way to
  // its callback).
  EXPECT_LE(ReceiveAtOnce(1, kRecvs), 2u);
  EXPECT_EQ(Get(owner_.stats.re_requests), kRecvs);
  // Cached: the first REQUEST names its destination, the other seven ask and wait.
  EXPECT_LE(ReceiveAtOnce(2, kRecvs), 3u);
  EXPECT_EQ(Get(owner_.stats.meta_cache_hits), 1);
  EXPECT_EQ(Get(owner_.stats.re_requests), 2 * kRecvs - 1);
  // Without the limit, every cached REQUEST names its destination at once.
  owner_.env.large_in_flight = 0;
  EXPECT_GE(ReceiveAtOnce(3, kRecvs), static_cast<size_t>(kRecvs));
  EXPECT_EQ(Get(owner_.stats.meta_cache_hits), 1 + kRecvs);
  EXPECT_EQ(Get(owner_.stats.channel_errors) + Get(acceptor_.stats.channel_errors), 0);
}

// The sender produces C, then B once C has arrived, then A once B has: a limit that counted
// A's destination (named in its REQUEST before A existed) against B and C would never let
// them land.
TEST_F(LargeDestinationTest, ALargeRecvWhoseTensorComesLaterNeverHoldsUpOnesThatAreReady) {
  const ParsedKey a = Key("a"), b = Key("b"), c = Key("c");
  for (const ParsedKey* key : {&a, &b, &c}) {  // caches their meta-data
    ASSERT_TRUE(Transfer(1, *key, Floats(&acceptor_.pool, kElements, 1.0f))->status.ok());
  }
  std::shared_ptr<RecvOutcome> got_a = StartRecv(2, a);
  std::shared_ptr<RecvOutcome> got_b = StartRecv(2, b);
  std::shared_ptr<RecvOutcome> got_c = StartRecv(2, c);
  Settle();
  const Tensor sent_c = Floats(&acceptor_.pool, kElements, 3.0f);
  Send(2, c, sent_c);
  ASSERT_TRUE(Pump([&] { return got_c->calls > 0; }));
  EXPECT_TRUE(got_c->status.ok()) << got_c->status;
  EXPECT_TRUE(got_c->tensor.ContentEquals(sent_c));
  const Tensor sent_b = Floats(&acceptor_.pool, kElements, 2.0f);
  Send(2, b, sent_b);
  ASSERT_TRUE(Pump([&] { return got_b->calls > 0; }));
  EXPECT_TRUE(got_b->status.ok()) << got_b->status;
  EXPECT_TRUE(got_b->tensor.ContentEquals(sent_b));
  const Tensor sent_a = Floats(&acceptor_.pool, kElements, 1.5f);
  Send(2, a, sent_a);
  ASSERT_TRUE(Pump([&] { return got_a->calls > 0; }));
  EXPECT_TRUE(got_a->status.ok()) << got_a->status;
  EXPECT_TRUE(got_a->tensor.ContentEquals(sent_a));
  Settle();
  EXPECT_EQ(got_a->calls + got_b->calls + got_c->calls, 3);
  EXPECT_EQ(owner_.channel->pending_requests(), 0u);
}

// A recv that ends while it waits for a large destination answers the sender at once, without
// a destination, so the sender lets go of its tensor; the recv it waited behind still lands.
TEST_F(LargeDestinationTest, ARecvAbortedWhileWaitingForADestinationReleasesTheSendersTensor) {
  const ParsedKey first = Key("first"), second = Key("second");
  const Tensor sent_first = Floats(&acceptor_.pool, kElements, 1.0f);
  Send(1, first, sent_first);
  Send(2, second, Floats(&acceptor_.pool, kElements, 2.0f));
  std::shared_ptr<RecvOutcome> got_first = StartRecv(1, first);
  std::shared_ptr<RecvOutcome> waiting = StartRecv(2, second);
  // Both answers came in one batch: the first got the grant, the second waits for it.
  ASSERT_TRUE(Pump([&] { return Get(owner_.stats.re_requests) > 0; }));
  EXPECT_EQ(Get(acceptor_.stats.meta_responses), 2);
  EXPECT_EQ(Get(owner_.stats.re_requests), 1);
  owner_.channel->AbortStep(2, absl::AbortedError("step 2 was aborted"));
  EXPECT_EQ(Get(owner_.stats.re_requests), 2) << "released at once, not behind the first";
  Settle();
  EXPECT_EQ(waiting->calls, 1);
  EXPECT_EQ(waiting->status.code(), absl::StatusCode::kAborted) << waiting->status;
  ASSERT_EQ(got_first->calls, 1);
  EXPECT_TRUE(got_first->status.ok()) << got_first->status;
  EXPECT_TRUE(got_first->tensor.ContentEquals(sent_first));
  EXPECT_EQ(Get(acceptor_.stats.content_bytes), kElements * static_cast<int64_t>(sizeof(float)));
  EXPECT_FALSE(acceptor_.channel->holds_state_for_peer()) << "the sender let go of both";
  EXPECT_EQ(owner_.channel->pending_requests(), 0u);
}

}  // namespace
}  // namespace tensorverbs::protocol::channel_testing
