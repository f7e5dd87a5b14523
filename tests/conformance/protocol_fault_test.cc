// The protocol conformance suite (protocol_fixture.h), faults the loopback fabric injects under
// each protocol built on the grpc+verbs transport.
#include "tests/conformance/protocol_fixture.h"

namespace tensorverbs::protocol_conformance {
namespace {

// Faults the loopback fabric injects into the sender's or the receiver's operations. Whatever
// breaks, every recv ends exactly once, within its deadline, with either the right tensor or
// an error: never with wrong bytes, never with a crash or a hang.
class FaultTest : public ProtocolTest {
 protected:
  struct Outcome {
    int ok = 0;
    int failed = 0;
    std::vector<absl::Status> errors;
  };

  // Runs three recvs (the first takes the meta-data round trip where the design has one, the
  // others hit the cache) with `faults` on task `faulty`'s domain.
  Outcome Run(int faulty, const fabric::loopback::Faults& faults, bool validation = false) {
    Outcome out;
    StartCluster(2, [validation](ServerOptions& o) {
      o.verbs.channel.data_validation = validation;
      o.verbs.channel.message_slots = 2;
    });
    if (HasFatalFailure()) return out;
    fabric::loopback::SetFaults(transport(faulty).domain_for_testing(), faults);
    std::vector<std::unique_ptr<PendingRecv>> recvs;
    for (int step = 1; step <= 3; ++step) {
      Tensor t = PoolTensor(1, DataType::kFloat32, {4096}, step);
      EXPECT_TRUE(Step(1, step)->Send(Key(1, "f"), t).ok());
      recvs.push_back(std::make_unique<PendingRecv>(*Step(0, step), Key(1, "f")));
      PendingRecv& recv = *recvs.back();
      EXPECT_TRUE(recv.Wait(recv_timeout_ + absl::Seconds(20))) << "the recv hung";
      if (recv.status().ok()) {
        EXPECT_TRUE(recv.tensor().ContentEquals(t)) << "a recv succeeded with wrong bytes";
        ++out.ok;
      } else {
        ++out.failed;
        out.errors.push_back(recv.status());
      }
    }
    // A second callback would come soon after the first: every recv is watched for at least
    // this long after it ended (the earlier ones for longer), before the servers stop.
    absl::SleepFor(absl::Milliseconds(20));
    for (auto& recv : recvs) EXPECT_EQ(recv->calls(), 1);
    recvs.clear();  // the tensors go back to the pools before the servers do
    TearDown();
    return out;
  }
};

TEST_P(FaultTest, FailedPostsAndErrorCompletionsCloseTheChannelAndItReconnects) {
  recv_timeout_ = absl::Seconds(5);
  int failed = 0;
  // Every operation of the first six in the release suite; every other one under TSan, which
  // looks for races in the same close-and-reconnect paths (a minute of its suite otherwise).
  const int step = kUnderThreadSanitizer ? 2 : 1;
  for (int n = 1; n <= 6; n += step) {
    for (int faulty : {0, 1}) {
      SCOPED_TRACE(absl::StrCat("operation ", n, " of task ", faulty));
      fabric::loopback::Faults post;
      post.fail_post_nth = n;
      Outcome a = Run(faulty, post);
      EXPECT_EQ(a.ok + a.failed, 3);
      EXPECT_GE(a.ok, 1) << "a new channel serves the recvs after the broken one";
      fabric::loopback::Faults completion;
      completion.error_completion_nth = n;
      Outcome b = Run(faulty, completion);
      EXPECT_EQ(b.ok + b.failed, 3);
      EXPECT_GE(b.ok, 1);
      for (const absl::Status& e : b.errors) {
        EXPECT_THAT(std::string(e.message()), HasSubstr("task:")) << "errors name the peer";
      }
      failed += a.failed + b.failed;
    }
  }
  EXPECT_GT(failed, 0) << "some injected faults failed recvs";
}

// A peer whose progress thread takes longer than the peer timeout to accept a channel (a task
// that many peers set up channels to at once, on a host whose page faults are slow) is slow,
// not gone: the recv that set the channel up waits for it rather than failing with "could not
// be reached", because the watchdog's probes of a channel being set up are answered by the
// peer's RPC threads. A peer that is gone still fails it within the peer timeout
// (PartitionTest, and the integration suite's peers that never start).
TEST_P(FaultTest, AChannelSetUpSlowerThanThePeerTimeoutIsWaitedForNotFailed) {
  StartCluster(2, [](ServerOptions& o) { o.transfer.peer_timeout = absl::Seconds(1); });
  ASSERT_FALSE(HasFatalFailure());
  Tensor t = PoolTensor(1, DataType::kFloat32, {4096}, 1);
  ASSERT_TRUE(Step(1, 1)->Send(Key(1, "f"), t).ok());
  // The sender's next two registrations (the message buffers of the channel it accepts) each
  // hold its progress thread for longer than the peer timeout.
  fabric::loopback::Faults slow;
  slow.slow_registrations = 2;
  slow.register_delay = absl::Milliseconds(1500);
  fabric::loopback::SetFaults(transport(1).domain_for_testing(), slow);
  const absl::Time start = absl::Now();
  PendingRecv recv(*Step(0, 1), Key(1, "f"));
  ASSERT_TRUE(recv.Wait(absl::Seconds(30))) << "the recv hung";
  ASSERT_TRUE(recv.status().ok()) << recv.status();
  EXPECT_TRUE(recv.tensor().ContentEquals(t));
  const absl::Duration took = absl::Now() - start;
  EXPECT_GT(took, absl::Seconds(1)) << "the set-up was to outlast the peer timeout";
  std::printf("the recv whose channel took %s to set up succeeded\n",
              absl::FormatDuration(took).c_str());
}

// A peer's liveness probe is answered from the channel table on the RPC thread while the
// progress loop moves, instead of queued behind the loop's work: with 256 tasks on two cores,
// answers that waited for the loop came after the 10 s peer timeout and the prober closed live
// channels. A loop held in one turn for longer than half the peer timeout (a provider call that
// does not return) is asked on the loop, and stays as silent as it is.
TEST_P(FaultTest, AProbeIsAnsweredWhileTheLoopIsBusyAndNotWhileItIsWedged) {
  StartCluster(2, [](ServerOptions& o) { o.transfer.peer_timeout = absl::Seconds(2); });
  ASSERT_FALSE(HasFatalFailure());
  const std::string address = server(1).cluster().TaskAddresses().at(
      server(1).device_name().substr(0, server(1).device_name().find("/device:")));
  std::unique_ptr<proto::VerbsService::Stub> stub = proto::VerbsService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  auto probe = [&](absl::Duration deadline) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    proto::CheckChannelRequest request;
    request.set_task_name(
        server(0).device_name().substr(0, server(0).device_name().find("/device:")));
    request.set_owned_channel_id(987654321);  // no such channel: an answer all the same
    proto::CheckChannelResponse response;
    grpc::Status s = stub->CheckChannel(&context, request, &response);
    if (s.ok()) {
      EXPECT_THAT(response.reason(), HasSubstr("no such channel"));
    }
    return s;
  };
  ASSERT_TRUE(probe(absl::Seconds(10)).ok()) << "task 1 answers at all";

  // Task 1's next registration (its message buffers, as it accepts the channel task 0 sets up
  // to receive from it) holds its progress thread in one turn for 4 s.
  Tensor t = PoolTensor(1, DataType::kFloat32, {4096}, 1);
  ASSERT_TRUE(Step(1, 1)->Send(Key(1, "f"), t).ok());
  fabric::loopback::Faults slow;
  slow.slow_registrations = 1;
  slow.register_delay = absl::Seconds(4);
  fabric::loopback::SetFaults(transport(1).domain_for_testing(), slow);
  PendingRecv recv(*Step(0, 1), Key(1, "f"));
  // Held: the same report (phase and turn count) for 100 ms, outside an idle wait.
  std::string held;
  for (absl::Time since = absl::Now(), until = absl::Now() + absl::Seconds(10); absl::Now() < until;
       absl::SleepFor(absl::Milliseconds(5))) {
    const std::string now = transport(1).LoopReport();
    if (now != held || absl::StrContains(now, "waiting for the fabric")) {
      held = now;
      since = absl::Now();
    } else if (absl::Now() - since >= absl::Milliseconds(100)) {
      break;
    }
  }
  const absl::Time held_at = absl::Now();
  ASSERT_THAT(held, HasSubstr("a posted task")) << "the loop was never held";

  // Held for about 100 ms of the 1 s (half the peer timeout) a loop may go without a turn:
  // busy, and answered from the table.
  const grpc::Status busy = probe(absl::Milliseconds(800));
  EXPECT_TRUE(busy.ok()) << busy.error_code() << " " << busy.error_message();
  EXPECT_EQ(transport(1).LoopReport(), held) << "answered while the loop was still held";

  // Held past that: wedged, and the probe waits for the loop.
  absl::SleepFor(held_at + absl::Milliseconds(1300) - absl::Now());
  const grpc::Status wedged = probe(absl::Milliseconds(800));
  EXPECT_EQ(wedged.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << wedged.error_message();
  EXPECT_EQ(transport(1).LoopReport(), held) << "the loop was let go before the second probe";
  ASSERT_TRUE(recv.Wait(absl::Seconds(30))) << "the recv hung";
  EXPECT_TRUE(recv.status().ok()) << recv.status();
}

INSTANTIATE_TEST_SUITE_P(Loopback, FaultTest,
                         ::testing::ValuesIn(Combine(kVerbsFamily, {&kLoopback})), ParamName);

// Designs whose content arrives by a write with immediate, which the fabric can corrupt,
// duplicate or lose.
class WrittenContentFaultTest : public FaultTest {};

TEST_P(WrittenContentFaultTest, CorruptedWritesAreCaughtByTheCodecOrTheChecksum) {
  recv_timeout_ = absl::Seconds(2);
  int checksum_failures = 0;
  for (int n = 1; n <= 8; ++n) {
    for (int faulty : {0, 1}) {
      SCOPED_TRACE(absl::StrCat("corrupt write ", n, " of task ", faulty));
      fabric::loopback::Faults f;
      f.corrupt_write_nth = n;
      Outcome o = Run(faulty, f, /*validation=*/true);
      EXPECT_EQ(o.ok + o.failed, 3);
      for (const absl::Status& e : o.errors) {
        checksum_failures += absl::StrContains(e.message(), "checksum mismatch");
      }
    }
  }
  EXPECT_GT(checksum_failures, 0) << "a corrupted content write fails its recv with DataLoss";
}

// A request the fabric loses (here its immediate: the peer never learns it landed) is
// never acknowledged: the channel closes within about the peer timeout, naming the peer, instead
// of leaving the recv to wait for its deadline, while the peer's process answers every probe.
// Over tcp;ofi_rxm, a connection that a peer's late write to a withdrawn key broke lost the
// first request of the next channel this way (PartitionTest). The sender never saw the request,
// so the same recv made again finds its tensor.
TEST_P(WrittenContentFaultTest,
       ARequestThePeerNeverAcknowledgesClosesTheChannelWithinThePeerTimeout) {
  recv_timeout_ = absl::Seconds(60);
  StartCluster(2, [](ServerOptions& o) { o.transfer.peer_timeout = absl::Seconds(1); });
  ASSERT_FALSE(HasFatalFailure());
  fabric::loopback::Faults lose_first;
  lose_first.drop_imm_nth = 1;  // the receiver's first message: its request
  fabric::loopback::SetFaults(transport(0).domain_for_testing(), lose_first);
  Tensor t = PoolTensor(1, DataType::kFloat32, {4096}, 1);
  ASSERT_TRUE(Step(1, 1)->Send(Key(1, "f"), t).ok());
  const absl::Time start = absl::Now();
  {
    PendingRecv lost(*Step(0, 1), Key(1, "f"));
    ASSERT_TRUE(lost.Wait(absl::Seconds(30))) << "the recv hung";
    const absl::Duration took = absl::Now() - start;
    EXPECT_EQ(lost.status().code(), absl::StatusCode::kUnavailable) << lost.status();
    EXPECT_THAT(lost.status().message(), HasSubstr("acknowledged no control message"));
    EXPECT_THAT(lost.status().message(), HasSubstr("task:1"));
    EXPECT_LT(took, absl::Seconds(20)) << "failed at the recv's deadline, not the peer timeout";
    std::printf("the recv whose request was lost failed after %s\n",
                absl::FormatDuration(took).c_str());
  }
  PendingRecv again(*Step(0, 1), Key(1, "f"));
  ASSERT_TRUE(again.Wait(absl::Seconds(30))) << "the recv made again hung";
  ASSERT_TRUE(again.status().ok()) << again.status();
  EXPECT_TRUE(again.tensor().ContentEquals(t));
}

// A channel its peer keeps writing into needs no liveness probe: each write with immediate says
// the peer is alive. With a tensor every few milliseconds (and, push being on, a request for
// the next step always waiting), about seven rounds pass without a probe; a recv left waiting
// on a channel its peer has fallen silent on is probed every round. The peer timeout leaves a
// probe 1.6 s: beside busy loops, a gRPC round trip once outlasted 800 ms, and the sender closed
// its end under the steady steps.
TEST_P(WrittenContentFaultTest, AChannelInSteadyUseIsNotProbedAndASilentOneIs) {
  recv_timeout_ = absl::Milliseconds(3000);
  StartCluster(2, [](ServerOptions& o) {
    o.transfer.peer_timeout = absl::Milliseconds(1600);  // a round every 400 ms
  });
  ASSERT_FALSE(HasFatalFailure());
  auto probes = [this] { return transport(0).stats().liveness_probes.load(); };
  const int64_t before_steady = probes();
  int64_t step = 1;
  for (const absl::Time start = absl::Now(); absl::Now() - start < absl::Seconds(3); ++step) {
    Tensor t = PoolTensor(1, DataType::kFloat32, {256}, static_cast<int>(step));
    ASSERT_TRUE(Step(1, step)->Send(Key(1, "f"), t).ok());
    PendingRecv recv(*Step(0, step), Key(1, "f"));
    ASSERT_TRUE(recv.Wait(absl::Seconds(10))) << "the recv hung";
    ASSERT_TRUE(recv.status().ok()) << recv.status();
  }
  const int64_t steady = probes() - before_steady;
  const int64_t before_silent = probes();
  {
    PendingRecv never(*Step(0, step), Key(1, "never"));  // ends at its 3 s deadline
    ASSERT_TRUE(never.Wait(absl::Seconds(20))) << "the recv hung";
    EXPECT_EQ(never.status().code(), absl::StatusCode::kDeadlineExceeded) << never.status();
  }
  const int64_t silent = probes() - before_silent;
  std::printf("%lld steps: %lld probes while they ran, %lld in as long with a recv waiting\n",
              static_cast<long long>(step - 1), static_cast<long long>(steady),
              static_cast<long long>(silent));
  EXPECT_GE(silent, 4) << "a waiting recv's silent peer is probed every round";
  EXPECT_LE(steady, silent / 2) << "a channel in steady use was probed";
}

INSTANTIATE_TEST_SUITE_P(Loopback, WrittenContentFaultTest,
                         ::testing::ValuesIn(Combine(With(&ProtocolDesign::content_by_write),
                                                     {&kLoopback})),
                         ParamName);

// grpc+gdr: the lender keeps a lent tensor until its borrower's release arrives over the
// borrower's channel. A borrower whose read failed (its channel broke) sends no release and
// tells nobody; a lender stopping its traffic asks it once rather than waiting out its whole
// shutdown grace (2 s) for a release that cannot come.
class LendingFaultTest : public FaultTest {};

TEST_P(LendingFaultTest, StoppingTheLenderAsksABorrowerWhoseChannelBrokeInsteadOfWaiting) {
  StartCluster(2);
  // The borrower's first operation is its read of the lent tensor: it completes in error.
  fabric::loopback::Faults read_fails;
  read_fails.error_completion_nth = 1;
  fabric::loopback::SetFaults(transport(0).domain_for_testing(), read_fails);
  Tensor t = PoolTensor(1, DataType::kFloat32, {4096}, 1);
  ASSERT_TRUE(Step(1, 1)->Send(Key(1, "f"), t).ok());
  PendingRecv recv(*Step(0, 1), Key(1, "f"));
  ASSERT_TRUE(recv.Wait(absl::Seconds(30))) << "the recv hung";
  EXPECT_FALSE(recv.status().ok()) << "the read was to fail";
  ASSERT_EQ(transport(1).NumLentTensors(), 1u) << "the lease outlives the failed read";
  // The borrower is alive and its end of the channel closed: the lender's last probe learns it.
  const absl::Time start = absl::Now();
  server(1).StopTraffic();
  const absl::Duration took = absl::Now() - start;
  EXPECT_LT(took, absl::Milliseconds(1500)) << "the lender waited for a release that cannot come";
  std::printf("the lender stopped its traffic in %s\n", absl::FormatDuration(took).c_str());
}

INSTANTIATE_TEST_SUITE_P(Loopback, LendingFaultTest,
                         ::testing::ValuesIn(Combine(With(&ProtocolDesign::lends_tensors),
                                                     {&kLoopback})),
                         ParamName);

// grpc+verbs alone: duplicated and lost immediates.
class ZeroCopyFaultTest : public FaultTest {};

TEST_P(ZeroCopyFaultTest, DuplicatedImmediatesAreDroppedOrCloseTheChannel) {
  recv_timeout_ = absl::Seconds(2);
  int dropped = 0;
  for (int n = 1; n <= 8; ++n) {
    for (int faulty : {0, 1}) {
      SCOPED_TRACE(absl::StrCat("duplicate immediate ", n, " of task ", faulty));
      fabric::loopback::Faults f;
      f.duplicate_imm_nth = n;
      Outcome o = Run(faulty, f);
      EXPECT_EQ(o.ok + o.failed, 3);
      for (const absl::Status& e : o.errors) {
        EXPECT_THAT(e.code(), AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDataLoss,
                                    absl::StatusCode::kDeadlineExceeded))
            << e;
      }
      dropped += o.errors.empty();
    }
  }
  EXPECT_GT(dropped, 0) << "some duplicates (of content immediates) are harmless";
}

TEST_P(ZeroCopyFaultTest, LostImmediatesFailPendingRecvsAtTheirDeadline) {
  recv_timeout_ = absl::Seconds(1);
  for (int n = 1; n <= 6; ++n) {
    SCOPED_TRACE(absl::StrCat("drop immediate ", n));
    fabric::loopback::Faults f;
    f.drop_imm_nth = n;
    Outcome o = Run(1, f);
    EXPECT_EQ(o.ok + o.failed, 3);
  }
}

INSTANTIATE_TEST_SUITE_P(Loopback, ZeroCopyFaultTest,
                         ::testing::ValuesIn(Combine({&kGrpcVerbs}, {&kLoopback})), ParamName);

}  // namespace
}  // namespace tensorverbs::protocol_conformance
