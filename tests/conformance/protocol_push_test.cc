// The protocol conformance suite (protocol_fixture.h), requests pushed ahead (TENSORVERBS_PUSH).
#include "src/fabric/loopback/loopback.h"
#include "tests/conformance/protocol_fixture.h"

namespace tensorverbs::protocol_conformance {
namespace {

// TENSORVERBS_PUSH (on by default): after a recv of a key at step s, the receiver asks for the
// key at step s+1 with a destination from the cached meta-data, so that step's recv finds its
// request made and, when the tensor was sent, its content landed.
class PushTest : public ProtocolTest {
 protected:
  // Sends and receives `t` as `name` at `step`, then cleans the step up on both tasks, as a
  // training loop does.
  void Step1(int64_t step, const std::string& name, const Tensor& t, bool is_dead = false) {
    ASSERT_TRUE(Step(1, step)->Send(Key(1, name), t, is_dead).ok());
    PendingRecv recv(*Step(0, step), Key(1, name));
    ASSERT_TRUE(recv.Wait()) << name << " at step " << step;
    ASSERT_TRUE(recv.status().ok()) << name << " at step " << step << ": " << recv.status();
    EXPECT_EQ(recv.is_dead(), is_dead) << name << " at step " << step;
    if (!is_dead) {
      EXPECT_TRUE(recv.tensor().ContentEquals(t))
          << name << " at step " << step << ": got " << recv.tensor().DebugString();
    }
    EXPECT_EQ(recv.calls(), 1);
  }
  void CleanupStep(int64_t step) {
    server(0).rendezvous_mgr()->Cleanup(step);
    server(1).rendezvous_mgr()->Cleanup(step);
  }
  // Receives each of `names` once at step 1 (so the receiver asks for step 2 ahead), sends them
  // at step 2 and waits until their contents were written; returns what step 2 sent.
  std::vector<Tensor> SendAheadOfTheRecvs(const std::vector<std::string>& names) {
    std::vector<Tensor> sent;
    for (const std::string& name : names) {
      Step1(1, name, PoolTensor(1, DataType::kFloat32, {64}, 1));
      if (::testing::Test::HasFatalFailure()) return sent;
    }
    CleanupStep(1);
    if (stall_receiver_after_step1_) {
      fabric::loopback::Faults stalled;
      stalled.stalled = true;
      fabric::loopback::SetFaults(transport(0).domain_for_testing(), stalled);
    }
    for (size_t i = 0; i < names.size(); ++i) {
      sent.push_back(PoolTensor(1, DataType::kFloat32, {64}, 10 + static_cast<uint32_t>(i)));
      EXPECT_TRUE(Step(1, 2)->Send(Key(1, names[i]), sent.back()).ok());
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (tx().content_writes.load() < 2 * static_cast<int64_t>(names.size()) &&
           absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(tx().content_writes.load(), 2 * static_cast<int64_t>(names.size()));
    return sent;
  }
  bool stall_receiver_after_step1_ = false;  // loopback only: see SendAheadOfTheRecvs
  // Each of `names` at step 2 is `sent`.
  void ExpectRecvsAtStep2(const std::vector<std::string>& names, const std::vector<Tensor>& sent) {
    for (size_t i = 0; i < names.size(); ++i) {
      PendingRecv recv(*Step(0, 2), Key(1, names[i]));
      ASSERT_TRUE(recv.Wait()) << names[i];
      ASSERT_TRUE(recv.status().ok()) << names[i] << ": " << recv.status();
      EXPECT_TRUE(recv.tensor().ContentEquals(sent[i])) << names[i];
    }
  }
  const VerbsStats& rx() { return transport(0).stats(); }
  const VerbsStats& tx() { return transport(1).stats(); }
  // Whether the sender answered a request with meta-data (a changed shape) since it had sent
  // `before` such answers, within 20 s.
  bool AnsweredWithMetaData(int64_t before) {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (tx().meta_responses.load() <= before) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(1));
    }
    return true;
  }
};

TEST_P(PushTest, SteadyStateRecvsFindTheirRequestAlreadyMade) {
  StartCluster(2);
  constexpr int kSteps = 20;
  for (int step = 1; step <= kSteps; ++step) {
    ASSERT_NO_FATAL_FAILURE(Step1(step, "w", PoolTensor(1, DataType::kFloat32, {256}, step)));
    CleanupStep(step);
  }
  EXPECT_EQ(rx().push_hits.load(), kSteps - 1) << "every recv after the first";
  EXPECT_EQ(rx().requests.load() - rx().pushed.load(), 1) << "only the first recv asked itself";
  EXPECT_EQ(tx().meta_responses.load(), 1) << "one meta-data round trip, for the first";
  EXPECT_EQ(tx().errors_sent.load() + rx().channel_errors.load() + tx().channel_errors.load(), 0);
  // The results are the receiver's pool memory, written in place.
  Tensor last;
  ASSERT_TRUE(
      Step(1, kSteps + 1)->Send(Key(1, "w"), PoolTensor(1, DataType::kFloat32, {256}, 99)).ok());
  PendingRecv recv(*Step(0, kSteps + 1), Key(1, "w"));
  ASSERT_TRUE(recv.Wait());
  MemoryRegion region;
  EXPECT_TRUE(server(0).recv_allocator()->FindRegion(recv.tensor().data(), 1, &region));
  EXPECT_EQ(transport(0).stats().copies.load() + transport(1).stats().copies.load(), 0);
}

TEST_P(PushTest, ShapeChangesDeadAndEmptyTensorsFallBackToTheMetaDataRoundTrip) {
  StartCluster(2);
  int64_t step = 0;
  for (int64_t n : {4, 4, 8, 8, 2, 0, 0, 16}) {
    ASSERT_NO_FATAL_FAILURE(
        Step1(++step, "act", PoolTensor(1, DataType::kInt64, {n}, static_cast<uint32_t>(n + 1))));
    CleanupStep(step);
  }
  // A dead tensor, then live ones again.
  ASSERT_NO_FATAL_FAILURE(Step1(++step, "act", Tensor(), /*is_dead=*/true));
  CleanupStep(step);
  for (int i = 0; i < 2; ++i) {
    ASSERT_NO_FATAL_FAILURE(Step1(++step, "act", PoolTensor(1, DataType::kInt64, {16}, 5)));
    CleanupStep(step);
  }
  // A string tensor travels as its TensorProto, never into a pushed destination.
  Tensor strings = Tensor::Make(DataType::kString, TensorShape::Of({2}));
  strings.strings()[0] = "pushed";
  strings.strings()[1] = "not";
  ASSERT_NO_FATAL_FAILURE(Step1(++step, "act", strings));
  CleanupStep(step);
  EXPECT_GT(rx().push_hits.load(), 0);
  EXPECT_EQ(rx().channel_errors.load() + tx().channel_errors.load(), 0);
}

TEST_P(PushTest, AnAbortedStepReleasesItsPushedRequestAndLaterStepsStillArrive) {
  StartCluster(2);
  ASSERT_NO_FATAL_FAILURE(Step1(1, "g", PoolTensor(1, DataType::kFloat32, {64}, 1)));
  CleanupStep(1);
  // Step 2 is aborted on both tasks before anything is sent: the request made for it ends.
  Step(0, 2)->StartAbort(absl::CancelledError("step 2 cancelled"));
  Step(1, 2)->StartAbort(absl::CancelledError("step 2 cancelled"));
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (rx().push_unused.load() < 1 && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(rx().push_unused.load(), 1);
  CleanupStep(2);
  for (int step = 3; step <= 6; ++step) {
    ASSERT_NO_FATAL_FAILURE(Step1(step, "g", PoolTensor(1, DataType::kFloat32, {64}, step)));
    CleanupStep(step);
  }
  EXPECT_EQ(rx().channel_errors.load() + tx().channel_errors.load(), 0);
}

// A sender whose tensors were all written into the receiver's requests made ahead may stop
// (its sends were taken): the receiver still gets them, although the next requests it makes
// ahead find the sender gone and close the channel.
TEST_P(PushTest, TensorsThatLandedAheadSurviveTheSendersExit) {
  if (GetParam().fabric == &kShm) {
    // libfabric's shm provider crashes (in fi_writedata) writing to a peer endpoint of the same
    // process that was closed: the peer's region is unmapped under the writer. Peers in
    // processes of their own, as tasks are, keep the region mapped.
    GTEST_SKIP() << "a stopped peer in the same process over libfabric shm";
  }
  StartCluster(2);
  const std::vector<std::string> names = {"a", "b", "c"};
  const std::vector<Tensor> sent = SendAheadOfTheRecvs(names);
  ASSERT_FALSE(HasFailure());
  server(1).Stop();
  ExpectRecvsAtStep2(names, sent);
}

// The sender stops right after writing tensors its peer asked for ahead; the receiver's loop
// meets all of their contents in one turn, and the first thing it sends back fails (the sender
// is gone). The channel closes after that turn, not in the middle of it, so every tensor that
// came in the turn still reaches its recv. (Closing at once dropped the rest of the turn: a
// worker's last recvs from a parameter server that had just exited then failed.)
TEST_P(PushTest, ContentInTheSameTurnAsTheSendersExitStillReachesItsRecvs) {
  if (GetParam().fabric != &kLoopback) GTEST_SKIP() << "stalls the loopback fabric's polls";
  StartCluster(2);
  const std::vector<std::string> names = {"a", "b", "c"};
  // The receiver's loop stops taking completions before step 2's contents come.
  stall_receiver_after_step1_ = true;
  const std::vector<Tensor> sent = SendAheadOfTheRecvs(names);
  ASSERT_FALSE(HasFailure());
  server(1).Stop();
  // The receiver's loop turns again and meets the three contents at once; its first post fails.
  fabric::loopback::Faults first_post_fails;
  first_post_fails.fail_post_nth = 1;
  fabric::loopback::SetFaults(transport(0).domain_for_testing(), first_post_fails);
  ExpectRecvsAtStep2(names, sent);
}

TEST_P(PushTest, AReceiverThatSkipsStepsStillGetsEveryTensorItAsksFor) {
  StartCluster(2);
  // The sender produces every step; the receiver asks for steps 1, 3 and 5 only, then 6 to 9,
  // and every step is cleaned up on both tasks once the receiver is past it, as a training
  // loop's steps are.
  for (int step = 1; step <= 9; ++step) {
    ASSERT_TRUE(Step(1, step)->Send(Key(1, "x"), PoolTensor(1, DataType::kInt32, {32}, step)).ok());
  }
  int cleaned = 0;
  for (int step : {1, 3, 5, 6, 7, 8, 9}) {
    PendingRecv recv(*Step(0, step), Key(1, "x"));
    ASSERT_TRUE(recv.Wait()) << step;
    ASSERT_TRUE(recv.status().ok()) << step << ": " << recv.status();
    EXPECT_TRUE(recv.tensor().ContentEquals(PoolTensor(1, DataType::kInt32, {32}, step))) << step;
    while (cleaned < step) CleanupStep(++cleaned);
  }
  EXPECT_GE(rx().push_hits.load(), 3) << "steps 7 to 9 at least";
  EXPECT_EQ(rx().channel_errors.load() + tx().channel_errors.load(), 0);
}

TEST_P(PushTest, RecvsOutOfStepOrderTakeTheirOwnRequests) {
  StartCluster(2);
  ASSERT_NO_FATAL_FAILURE(Step1(1, "o", PoolTensor(1, DataType::kInt32, {8}, 1)));
  // Step 3's recv starts before step 2's: the request made ahead for step 2 waits for its own.
  for (int step : {2, 3}) {
    ASSERT_TRUE(Step(1, step)->Send(Key(1, "o"), PoolTensor(1, DataType::kInt32, {8}, step)).ok());
  }
  PendingRecv third(*Step(0, 3), Key(1, "o"));
  ASSERT_TRUE(third.Wait());
  ASSERT_TRUE(third.status().ok()) << third.status();
  EXPECT_TRUE(third.tensor().ContentEquals(PoolTensor(1, DataType::kInt32, {8}, 3)));
  PendingRecv second(*Step(0, 2), Key(1, "o"));
  ASSERT_TRUE(second.Wait());
  ASSERT_TRUE(second.status().ok()) << second.status();
  EXPECT_TRUE(second.tensor().ContentEquals(PoolTensor(1, DataType::kInt32, {8}, 2)));
  EXPECT_EQ(rx().push_hits.load(), 1) << "step 2's";
}

TEST_P(PushTest, AChangedShapeWaitsForItsRecvWhateverTheOrder) {
  StartCluster(2);
  ASSERT_NO_FATAL_FAILURE(Step1(1, "c", PoolTensor(1, DataType::kFloat32, {16}, 1)));
  CleanupStep(1);
  // Step 2's tensor has another shape, and is sent well before its recv: the sender answers
  // the request made ahead with its meta-data, and holds the tensor for it.
  const Tensor bigger = PoolTensor(1, DataType::kFloat32, {64}, 2);
  int64_t meta_responses = tx().meta_responses.load();
  ASSERT_TRUE(Step(1, 2)->Send(Key(1, "c"), bigger).ok());
  // Not a sleep: under TSan on a loaded machine the request made ahead can take longer than
  // any fixed pause to reach the sender.
  ASSERT_TRUE(AnsweredWithMetaData(meta_responses)) << "step 2's request made ahead";
  PendingRecv recv(*Step(0, 2), Key(1, "c"));
  ASSERT_TRUE(recv.Wait());
  ASSERT_TRUE(recv.status().ok()) << recv.status();
  EXPECT_TRUE(recv.tensor().ContentEquals(bigger)) << recv.tensor().DebugString();
  CleanupStep(2);
  // Step 3 changes shape again but is aborted before any recv: the sender is let go.
  meta_responses = tx().meta_responses.load();
  ASSERT_TRUE(Step(1, 3)->Send(Key(1, "c"), PoolTensor(1, DataType::kFloat32, {4}, 3)).ok());
  ASSERT_TRUE(AnsweredWithMetaData(meta_responses)) << "step 3's request made ahead";
  CleanupStep(3);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (transport(1).stats().content_writes.load() < 3 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(transport(1).stats().content_writes.load(), 3) << "step 3 ended with an empty write";
  ASSERT_NO_FATAL_FAILURE(Step1(4, "c", PoolTensor(1, DataType::kFloat32, {4}, 4)));
  EXPECT_EQ(rx().channel_errors.load() + tx().channel_errors.load(), 0);
}

TEST_P(PushTest, TheBudgetBoundsRequestsMadeAhead) {
  StartCluster(2, [](ServerOptions& o) { o.verbs.channel.push_max_destinations = 4; });
  constexpr int kKeys = 10;
  for (int step = 1; step <= 3; ++step) {
    std::vector<std::unique_ptr<PendingRecv>> recvs;
    for (int k = 0; k < kKeys; ++k) {
      ASSERT_TRUE(Step(1, step)
                      ->Send(Key(1, absl::StrCat("k", k)),
                             PoolTensor(1, DataType::kFloat32, {8}, step * 100 + k))
                      .ok());
      recvs.push_back(std::make_unique<PendingRecv>(*Step(0, step), Key(1, absl::StrCat("k", k))));
    }
    for (int k = 0; k < kKeys; ++k) {
      ASSERT_TRUE(recvs[k]->Wait());
      ASSERT_TRUE(recvs[k]->status().ok()) << recvs[k]->status();
      EXPECT_TRUE(
          recvs[k]->tensor().ContentEquals(PoolTensor(1, DataType::kFloat32, {8}, step * 100 + k)));
    }
    CleanupStep(step);
  }
  // At most 4 requests ahead at a time: 4 per step after the first.
  EXPECT_LE(rx().pushed.load(), 3 * 4);
  EXPECT_GT(rx().push_hits.load(), 0);
}

// The count runs over loopback only: the other fabrics carry each key by the same code.
class PushScaleTest : public PushTest {};

TEST_P(PushScaleTest, TenThousandKeysEachStep) {
  StartCluster(2);
  constexpr int kKeys = 10000;
  std::vector<ParsedKey> keys;
  for (int k = 0; k < kKeys; ++k) keys.push_back(Key(1, absl::StrCat("layer", k, "/grad:0")));
  const Tensor t = PoolTensor(1, DataType::kFloat32, {4}, 3);
  for (int step = 1; step <= 3; ++step) {
    for (const ParsedKey& key : keys) ASSERT_TRUE(Step(1, step)->Send(key, t).ok());
    absl::StatusOr<std::vector<Tensor>> got = RecvAll(*Step(0, step), keys);
    ASSERT_TRUE(got.ok()) << got.status();
    for (const Tensor& g : *got) ASSERT_TRUE(g.ContentEquals(t));
    CleanupStep(step);
  }
  // The default budget (1,024 requests ahead per channel) bounds what was pushed.
  EXPECT_LE(rx().pushed.load(), 2 * 1024 + 1024);
  EXPECT_GT(rx().push_hits.load(), 0);
  EXPECT_EQ(rx().channel_errors.load() + tx().channel_errors.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(Protocols, PushTest,
                         ::testing::ValuesIn(Combine({&kGrpcVerbs}, kEveryFabric)), ParamName);
INSTANTIATE_TEST_SUITE_P(Protocols, PushScaleTest,
                         ::testing::ValuesIn(Combine({&kGrpcVerbs}, {&kLoopback})), ParamName);

}  // namespace
}  // namespace tensorverbs::protocol_conformance
