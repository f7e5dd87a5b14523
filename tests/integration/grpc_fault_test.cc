// Faults between real processes, for every protocol: peers killed, frozen, restarted or gone
// while a recv waits or bytes are in flight, receivers killed or frozen under a sender, and a
// task that runs out of descriptors or memory. Each recv ends once, never with wrong bytes, and
// the surviving task serves on (the fixture is grpc_cluster_fixture.h).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/integration/grpc_cluster_fixture.h"

namespace tensorverbs {
namespace {

using cluster_testing::GrpcClusterTest;
using cluster_testing::kStep;
using ::testing::HasSubstr;
using testing::Subprocess;

TEST_P(GrpcClusterTest, KilledPeerGivesUnavailableWithinTheDeadline) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, /*recv_timeout=*/absl::Seconds(30)));
  auto r = *server_->rendezvous_mgr()->Find(kStep);
  PendingRecv recv(*r, Key(1, "never"));
  absl::SleepFor(absl::Milliseconds(300));
  absl::Time killed = absl::Now();
  peers_[1]->Signal(SIGKILL);
  ASSERT_TRUE(recv.Wait(absl::Seconds(30)));
  EXPECT_LT(absl::Now() - killed, absl::Seconds(10));
  EXPECT_EQ(recv.status().code(), absl::StatusCode::kUnavailable) << recv.status();
  EXPECT_THAT(recv.status().message(), HasSubstr("/job:worker/replica:0/task:1"));
  EXPECT_THAT(recv.status().message(), HasSubstr(absl::StrCat("127.0.0.1:", ports_[1])));
}

// A sender frozen for less than the peer timeout (2 s here) in the middle of a 64 MiB transfer
// is slow, not dead: when it resumes, the recv completes with the right bytes.
TEST_P(GrpcClusterTest, APeerFrozenShorterThanThePeerTimeoutMidTransferDeliversIntact) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, /*recv_timeout=*/absl::Seconds(60), /*big=*/true));
  ASSERT_TRUE(server_->WaitForPeers(absl::Seconds(30)).ok());
  ASSERT_TRUE(Recv(kStep, Key(1, "scalar")).ok());
  auto r = *server_->rendezvous_mgr()->Find(kStep);
  PendingRecv big(*r, Key(1, "big"));
  absl::SleepFor(absl::Milliseconds(1));
  peers_[1]->Signal(SIGSTOP);
  absl::SleepFor(absl::Milliseconds(600));
  peers_[1]->Signal(SIGCONT);
  ASSERT_TRUE(big.Wait(absl::Seconds(30))) << "the recv hung";
  ASSERT_TRUE(big.status().ok()) << big.status();
  for (const testing::Fixture& f : testing::MakeFixtures(/*seed=*/1, /*with_big=*/true)) {
    if (f.name == "big") {
      EXPECT_TRUE(big.tensor().ContentEquals(f.tensor));
    }
  }
  EXPECT_TRUE(Recv(kStep, Key(1, "medium")).ok()) << "the channel carries on";
}

// A peer that stops (SIGSTOP: its sockets stay open, nothing answers) fails a waiting recv
// within about the peer timeout (2 s here), not at the recv's 60 s deadline; once it resumes,
// the same two tasks exchange tensors again (grpc reconnects, a verbs channel is set up anew),
// without a restart.
TEST_P(GrpcClusterTest, AFrozenPeerFailsTheRecvWithinThePeerTimeoutAndServesOnceResumed) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, /*recv_timeout=*/absl::Seconds(60)));
  ASSERT_TRUE(server_->WaitForPeers(absl::Seconds(30)).ok());
  ASSERT_TRUE(Recv(kStep, Key(1, "scalar")).ok());
  auto r = *server_->rendezvous_mgr()->Find(kStep);
  PendingRecv never(*r, Key(1, "never"));
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time frozen = absl::Now();
  peers_[1]->Signal(SIGSTOP);
  const bool ended = never.Wait(absl::Seconds(30));
  peers_[1]->Signal(SIGCONT);
  ASSERT_TRUE(ended) << "the recv waited for its deadline";
  EXPECT_LT(absl::Now() - frozen, absl::Seconds(15));
  EXPECT_EQ(never.status().code(), absl::StatusCode::kUnavailable) << never.status();
  EXPECT_THAT(never.status().message(), HasSubstr("task:1"));
  ExpectDeliveredSoon(*r, Key(1, "medium"), "the resume");
}

// The keepalive that finds frozen peers must not fail a live one that is merely slow: a recv
// that waits three peer timeouts (2 s here) for its tensor gets it.
TEST_P(GrpcClusterTest, ARecvOutlivesThePeerTimeoutWhileTheSenderIsAliveButSlow) {
  late_ms_ = 6000;
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, /*recv_timeout=*/absl::Seconds(60)));
  ASSERT_TRUE(server_->WaitForPeers(absl::Seconds(30)).ok());
  auto r = *server_->rendezvous_mgr()->Find(kStep);
  const absl::Time start = absl::Now();
  PendingRecv recv(*r, Key(1, "late"));
  ASSERT_TRUE(recv.Wait(absl::Seconds(40))) << "the recv hung";
  ASSERT_TRUE(recv.status().ok()) << recv.status();
  EXPECT_GT(absl::Now() - start, absl::Seconds(3)) << "the tensor came before the sender sent it";
  const testing::Fixture first = testing::MakeFixtures(/*seed=*/1, false).front();
  EXPECT_TRUE(recv.tensor().ContentEquals(first.tensor)) << recv.tensor().DebugString();
}

TEST_P(GrpcClusterTest, PeerKilledWhileBytesAreInFlightEndsTheRecvOnceNeverWithWrongBytes) {
  // A 64 MiB transfer takes a few milliseconds here; kills at several points of it land
  // before, during and after the bytes move.
  Tensor big;
  for (const testing::Fixture& f : testing::MakeFixtures(/*seed=*/1, /*with_big=*/true)) {
    if (f.name == "big") big = f.tensor;
  }
  ASSERT_TRUE(big.IsInitialized());
  int completed = 0, failed = 0;
  for (int delay_us : {0, 1000, 3000, 6000, 12000}) {
    SCOPED_TRACE(absl::StrCat("kill after ", delay_us, " us"));
    ASSERT_NO_FATAL_FAILURE(StartCluster(2, /*recv_timeout=*/absl::Seconds(30), /*big=*/true));
    // Connections and channels are up, as in a running job: the kill hits a transfer, not
    // the set-up (a peer that never answered is only known dead at the recv's deadline).
    ASSERT_TRUE(server_->WaitForPeers(absl::Seconds(30)).ok());
    auto r = *server_->rendezvous_mgr()->Find(kStep);
    auto recv = std::make_unique<PendingRecv>(*r, Key(1, "big"));
    absl::SleepFor(absl::Microseconds(delay_us));
    const absl::Time killed = absl::Now();
    peers_[1]->Signal(SIGKILL);
    ASSERT_TRUE(recv->Wait(absl::Seconds(30))) << "the recv hung";
    EXPECT_LT(absl::Now() - killed, absl::Seconds(15));
    if (recv->status().ok()) {
      EXPECT_TRUE(recv->tensor().ContentEquals(big)) << "a recv completed with wrong bytes";
      ++completed;
    } else {
      EXPECT_THAT(recv->status().code(),
                  ::testing::AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kAborted,
                                   absl::StatusCode::kCancelled))
          << recv->status();
      EXPECT_THAT(recv->status().message(), HasSubstr("task:1")) << "the error names the peer";
      ++failed;
    }
    recv.reset();
    TearDown();
    server_.reset();
  }
  EXPECT_GT(failed, 0) << "at least the earliest kill lands before the bytes";
  RecordProperty("completed_before_the_kill", completed);
}

// A receiver killed while this task writes a 64 MiB tensor to it: the sender neither crashes
// nor hangs, lets go of the tensor within a bounded time, and goes on serving its other peers.
TEST_P(GrpcClusterTest, AReceiverKilledWhileTheSenderWritesLeavesTheSenderWhole) {
  size_t baseline = 0;
  ASSERT_NO_FATAL_FAILURE(StreamToTask1UntilTheSecondIsInFlight(absl::Seconds(60), &baseline));
  const absl::Time killed = absl::Now();
  peers_[1]->Signal(SIGKILL);
  ASSERT_TRUE(peers_[1]->Wait(absl::Seconds(10)).ok());
  // The tensor is let go once the transport knows the receiver is gone (a failed write, the
  // closed channel, the cancelled call), after the quarantine that keeps late writes from
  // landing in reused memory.
  EXPECT_TRUE(CleanUpAndWaitForTheSenderToLetGo(baseline, killed, absl::Seconds(30)))
      << "the sender still holds the tensor";
  std::printf("the sender let go of the tensor %s after the kill\n",
              absl::FormatDuration(absl::Now() - killed).c_str());
  absl::StatusOr<Tensor> other = Recv(kStep, Key(2, "medium"));
  EXPECT_TRUE(other.ok()) << "another peer is affected: " << other.status();
}

// As above, but the receiver freezes (SIGSTOP) with a 64 MiB tensor in flight to it: the sender
// lets go of the tensor within about the peer timeout (its keepalive pings go unanswered, or the
// channel's probes), not at the recv timeout; once resumed, the receiver's recv has either the
// whole tensor or an error, and other peers were never affected.
TEST_P(GrpcClusterTest, AReceiverFrozenWhileTheSenderWritesIsLetGoWithinThePeerTimeout) {
  size_t baseline = 0;
  ASSERT_NO_FATAL_FAILURE(StreamToTask1UntilTheSecondIsInFlight(absl::Seconds(120), &baseline));
  const absl::Time frozen = absl::Now();
  peers_[1]->Signal(SIGSTOP);
  // The peer timeout is 2 s and the recv timeout 120 s; measured: 0.0-4.4 s by protocol, and
  // 20.8 s over grpc before its server pinged frozen callers. 15 s tells the two apart.
  const bool let_go = CleanUpAndWaitForTheSenderToLetGo(baseline, frozen, absl::Seconds(15));
  const absl::Duration held = absl::Now() - frozen;
  absl::StatusOr<Tensor> other = Recv(kStep, Key(2, "medium"));
  peers_[1]->Signal(SIGCONT);
  EXPECT_TRUE(let_go) << "the sender still holds the tensor after " << held;
  std::printf("the sender let go of the tensor %s after the freeze\n",
              absl::FormatDuration(held).c_str());
  EXPECT_TRUE(other.ok()) << "another peer is affected: " << other.status();
  // Resumed, the receiver ends its recv once, whole or failed.
  absl::StatusOr<std::string> second;
  const absl::Time resumed = absl::Now();
  do {
    second = peers_[1]->WaitForLine("", absl::Seconds(60) - (absl::Now() - resumed));
  } while (second.ok() && !absl::StartsWith(*second, "got 2 ") &&
           !absl::StartsWith(*second, "failed 2 "));
  ASSERT_TRUE(second.ok()) << second.status();
  std::printf("the resumed receiver: %s\n", second->c_str());
  if (absl::StartsWith(*second, "got")) {
    EXPECT_EQ(*second, absl::StrCat("got 2 ", int64_t{64} << 20));
  } else {
    EXPECT_TRUE(absl::StartsWith(*second, "failed 2 ")) << *second;
  }
}

// Every file descriptor in use when a task first reaches a peer (sockets, shared memory and
// doorbells for the channel cannot be made): the recv ends with an error naming the peer,
// within its deadline, and the task works again once descriptors are free.
TEST_P(GrpcClusterTest, RunningOutOfFileDescriptorsFailsTheRecvAndTheTaskRecovers) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, /*recv_timeout=*/absl::Seconds(20)));
  auto r = *server_->rendezvous_mgr()->Find(kStep);
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &old), 0);
  std::vector<int> burned;
  {
    rlimit low = old;
    low.rlim_cur = 4096;
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
    for (int fd; (fd = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) burned.push_back(fd);
  }
  ASSERT_EQ(errno, EMFILE);
  PendingRecv starved(*r, Key(1, "medium"));
  const bool ended = starved.Wait(absl::Seconds(40));
  for (int fd : burned) close(fd);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &old), 0);
  ASSERT_TRUE(ended) << "the recv hung without descriptors";
  std::printf("recv without descriptors: %s\n", starved.status().ToString().c_str());
  if (!starved.status().ok()) {
    EXPECT_THAT(starved.status().message(), HasSubstr("task:1")) << starved.status();
    // The cause is named: this process, not the peer.
    EXPECT_THAT(starved.status().message(),
                ::testing::AnyOf(HasSubstr("Too many open files"), HasSubstr("ulimit -n")))
        << starved.status();
  }

  ExpectDeliveredSoon(*r, Key(1, "scalar"), "descriptors came back");
}

// The task's memory runs out (its address space is capped just above what it uses) when a
// 64 MiB tensor arrives: the pool cannot grow, the recv fails with ResourceExhausted naming
// the key, nothing crashes, and the task receives again once memory is back.
TEST_P(GrpcClusterTest, RunningOutOfMemoryFailsTheRecvAndTheTaskRecovers) {
  if (GetParam() == "grpc") {
    // gRPC allocates the received message itself, with an allocator that aborts the process
    // when memory runs out; the verbs protocols allocate from the pool and can refuse.
    GTEST_SKIP() << "gRPC's own allocator aborts on exhaustion";
  }
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, /*recv_timeout=*/absl::Seconds(20), /*big=*/true));
  auto r = *server_->rendezvous_mgr()->Find(kStep);
  // Channels, threads and the pool's first region exist before the cap.
  ExpectDeliveredSoon(*r, Key(1, "scalar"), "the start");
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_AS, &old), 0);
  uint64_t used = 0;
  {
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);) {
      if (absl::StartsWith(line, "VmSize:")) {
        ASSERT_TRUE(absl::SimpleAtoi(
            absl::StripAsciiWhitespace(absl::StripSuffix(line.substr(7), "kB")), &used))
            << line;
      }
    }
  }
  ASSERT_GT(used, 0u);
  rlimit capped = old;
  capped.rlim_cur = (used << 10) + (uint64_t{48} << 20);  // room for a few thread stacks
  ASSERT_EQ(setrlimit(RLIMIT_AS, &capped), 0);
  PendingRecv starved(*r, Key(1, "big"));
  const bool ended = starved.Wait(absl::Seconds(40));
  ASSERT_EQ(setrlimit(RLIMIT_AS, &old), 0);
  ASSERT_TRUE(ended) << "the recv hung without memory";
  std::printf("recv without memory: %s\n", starved.status().ToString().c_str());
  EXPECT_EQ(starved.status().code(), absl::StatusCode::kResourceExhausted) << starved.status();
  EXPECT_THAT(starved.status().message(), HasSubstr("big")) << starved.status();

  ExpectDeliveredSoon(*r, Key(1, "medium"), "memory came back");
}

TEST_P(GrpcClusterTest, UnreachablePeerIsUnavailableWhenTheDeadlinePasses) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, /*recv_timeout=*/absl::Milliseconds(1500)));
  peers_[1]->Signal(SIGKILL);
  ASSERT_TRUE(peers_[1]->Wait(absl::Seconds(10)).ok());
  absl::Time start = absl::Now();
  absl::StatusOr<Tensor> got = Recv(kStep, Key(1, "scalar"));
  absl::Duration took = absl::Now() - start;
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  EXPECT_THAT(got.status().message(), HasSubstr("task /job:worker/replica:0/task:1 at 127.0.0.1:"));
  EXPECT_LT(took, absl::Seconds(10));
}

// A recv to a task that cannot be reached fails within about the peer timeout (2 s here), not
// at the recv's deadline (60 s): the connection watch for grpc and grpc+gdr, the channel's for
// the verbs protocols.
TEST_P(GrpcClusterTest, ADeadPeerFailsARecvWithinThePeerTimeoutNotItsDeadline) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, /*recv_timeout=*/absl::Seconds(60)));
  peers_[1]->Signal(SIGKILL);
  ASSERT_TRUE(peers_[1]->Wait(absl::Seconds(10)).ok());
  peers_[1].reset();  // reaped: TearDown has nothing to wait for
  const absl::Time start = absl::Now();
  absl::StatusOr<Tensor> got = Recv(kStep, Key(1, "scalar"));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  EXPECT_THAT(got.status().message(), HasSubstr("task:1"));
  EXPECT_LT(took, absl::Seconds(15)) << got.status();
  std::printf("recv from a dead peer failed after %s\n", absl::FormatDuration(took).c_str());
}

}  // namespace
}  // namespace tensorverbs
