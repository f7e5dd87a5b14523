// Every protocol between real processes on 127.0.0.1: task 0 runs in the test, the other tasks
// are tv_test_peer processes that send the standard fixtures. What needs separate processes
// (killed, restarted and unreachable peers, ports held by another process, tensors crossing
// process boundaries) is here; protocol behaviour that one process shows is in
// tests/conformance/protocol_conformance_test.cc.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "proto/worker.pb.h"
#include "src/common/mutex.h"
#include "tensorverbs/device_name.h"
#include "src/server/server.h"
#include "src/support/process_util.h"
#include "tests/support/fixtures.h"
#include "tests/support/pending_recv.h"
#include "tests/support/shm_regions.h"
#include "tests/support/subprocess.h"

namespace tensorverbs {
namespace {

using ::testing::HasSubstr;
using testing::Subprocess;

constexpr int64_t kStep = 42;

class GrpcClusterTest : public ::testing::TestWithParam<std::string> {
 protected:
  void TearDown() override {
    for (auto& p : peers_) {
      if (p) p->Signal(SIGTERM);
    }
    for (auto& p : peers_) {
      if (p) (void)p->Wait(absl::Seconds(10));
    }
    peers_.clear();
    // Peers the test SIGKILLed left their shm regions behind.
    for (pid_t pid : peer_pids_) testing::UnlinkShmRegionsOf(pid);
  }

  // A cluster of `n` worker tasks; task 0 is in this process, the others are peers.
  void StartCluster(int n, absl::Duration recv_timeout = absl::Seconds(60), bool big = false) {
    absl::StatusOr<std::vector<int>> ports = support::PickFreePorts(n);
    ASSERT_TRUE(ports.ok());
    ports_ = *ports;
    std::vector<std::string> addrs;
    for (int p : ports_) addrs.push_back(absl::StrCat("127.0.0.1:", p));
    cluster_ = absl::StrCat("worker=", absl::StrJoin(addrs, ","));
    peers_.resize(n);
    incarnations_.resize(n);
    for (int t = 1; t < n; ++t) ASSERT_NO_FATAL_FAILURE(StartPeer(t, big));
    ServerOptions options;
    options.cluster = *ClusterSpec::Parse(cluster_);
    options.job = "worker";
    options.task = 0;
    options.recv_timeout = recv_timeout;
    options.protocol = GetParam();
    options.verbs.peer_timeout = absl::Seconds(2);
    absl::StatusOr<std::unique_ptr<Server>> server = Server::Create(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  void StartPeer(int task, bool big = false) {
    std::vector<std::string> args = {"--cluster",  cluster_,
                                     "--job",      "worker",
                                     "--task",     absl::StrCat(task),
                                     "--step",     absl::StrCat(kStep),
                                     "--seed",     absl::StrCat(task),
                                     "--dst",      CpuDeviceName("worker", 0),
                                     "--big",      big ? "1" : "0",
                                     "--protocol", GetParam(),
                                     "--late-ms",  absl::StrCat(late_ms_)};
    args.insert(args.end(), peer_args_[task].begin(), peer_args_[task].end());
    absl::StatusOr<std::unique_ptr<support::Subprocess>> p =
        support::Subprocess::Start(testing::TestPeerPath(), args);
    ASSERT_TRUE(p.ok()) << p.status();
    peer_pids_.push_back((*p)->pid());
    absl::StatusOr<std::string> ready = (*p)->WaitForLine("ready ", absl::Seconds(60));
    ASSERT_TRUE(ready.ok()) << ready.status();
    uint64_t inc = 0;
    ASSERT_TRUE(absl::SimpleHexAtoi(ready->substr(6), &inc)) << *ready;
    incarnations_[task] = inc;
    peers_[task] = *std::move(p);
  }

  ParsedKey Key(int task, const std::string& name, uint64_t incarnation = 0) {
    return *ParsedKey::Parse(ParsedKey::Create(CpuDeviceName("worker", task),
                                               incarnation ? incarnation : incarnations_[task],
                                               server_->device_name(), name));
  }

  // Recvs of `key` fail fast while a connection or channel comes back: tries again (as a job
  // would) until one delivers, within 30 s of `event`, and says how long that took.
  void ExpectDeliveredSoon(RemoteRendezvous& r, const ParsedKey& key, const std::string& event) {
    const absl::Time start = absl::Now();
    absl::Status last;
    while (absl::Now() - start < absl::Seconds(30)) {
      PendingRecv again(r, key);
      ASSERT_TRUE(again.Wait(absl::Seconds(70))) << "a recv after " << event << " hung";
      last = again.status();
      if (last.ok()) {
        std::printf("first recv after %s succeeded %s later\n", event.c_str(),
                    absl::FormatDuration(absl::Now() - start).c_str());
        return;
      }
      absl::SleepFor(absl::Milliseconds(300));
    }
    ADD_FAILURE() << "no recv succeeded within 30 s of " << event << "; last: " << last;
  }

  // A cluster of three whose task 1 receives "stream" from this task at steps kStep + 1 and
  // kStep + 2, printing "got i BYTES" or "failed i STATUS" for each. Sends both (64 MiB of
  // float i each, from the receive pool), the second once the first arrived, and returns 2 ms
  // into the second's transfer. `*baseline`: the pool's allocation count before either, which
  // tells when this task no longer holds them.
  void StreamToTask1UntilTheSecondIsInFlight(absl::Duration recv_timeout, size_t* baseline) {
    peer_args_[1] = {"--recv-from", "0", "--recv-steps", "2"};
    ASSERT_NO_FATAL_FAILURE(StartCluster(3, recv_timeout));
    ASSERT_TRUE(server_->WaitForPeers(absl::Seconds(30)).ok());
    PoolAllocator* pool = server_->recv_allocator();
    *baseline = pool->GetStats().allocations;
    const ParsedKey stream = *ParsedKey::Parse(ParsedKey::Create(
        server_->device_name(), server_->incarnation(), CpuDeviceName("worker", 1), "stream"));
    for (int i = 1; i <= 2; ++i) {
      Tensor t = *Tensor::Allocate(pool, DataType::kFloat32, TensorShape::Of({16 << 20}));
      std::fill_n(t.flat<float>(), t.NumElements(), static_cast<float>(i));
      ASSERT_TRUE((*server_->rendezvous_mgr()->Find(kStep + i))->Send(stream, t).ok());
      if (i == 1) {
        absl::StatusOr<std::string> got = peers_[1]->WaitForLine("got 1 ", absl::Seconds(30));
        ASSERT_TRUE(got.ok()) << got.status();
      }
    }
    absl::SleepFor(absl::Milliseconds(2));
  }

  // Ends both steps of StreamToTask1UntilTheSecondIsInFlight here and waits, at most until
  // `since` + `limit`, for this task's pool to hold no more than `baseline` allocations again:
  // true once it does (the sender let go of the tensors).
  bool CleanUpAndWaitForTheSenderToLetGo(size_t baseline, absl::Time since, absl::Duration limit) {
    server_->rendezvous_mgr()->Cleanup(kStep + 1);
    server_->rendezvous_mgr()->Cleanup(kStep + 2);
    PoolAllocator* pool = server_->recv_allocator();
    while (pool->GetStats().allocations != baseline && absl::Now() - since < limit) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    return pool->GetStats().allocations == baseline;
  }

  // One recv with its status.
  absl::StatusOr<Tensor> Recv(int64_t step, const ParsedKey& key) {
    absl::StatusOr<std::shared_ptr<RemoteRendezvous>> r = server_->rendezvous_mgr()->Find(step);
    if (!r.ok()) return r.status();
    absl::StatusOr<std::vector<Tensor>> got = RecvAll(**r, {key});
    if (!got.ok()) return got.status();
    return (*got)[0];
  }

  std::vector<int> ports_;
  std::string cluster_;
  std::vector<std::unique_ptr<support::Subprocess>> peers_;
  std::vector<pid_t> peer_pids_;
  std::vector<uint64_t> incarnations_;
  std::unique_ptr<Server> server_;
  int late_ms_ = 0;  // peers send "late" this long after they are ready
  std::map<int, std::vector<std::string>> peer_args_;  // more flags for a peer, by task
};

TEST_P(GrpcClusterTest, TwoProcessesExchangeEveryDtypeEmptyRank8StringsDeadAnd64MiB) {
  StartCluster(2, absl::Seconds(60), /*big=*/true);
  auto r = *server_->rendezvous_mgr()->Find(kStep);
  for (const testing::Fixture& f : testing::MakeFixtures(/*seed=*/1, /*with_big=*/true)) {
    PendingRecv recv(*r, Key(1, f.name));
    ASSERT_TRUE(recv.Wait(absl::Seconds(60))) << f.name;
    ASSERT_TRUE(recv.status().ok()) << f.name << ": " << recv.status();
    EXPECT_EQ(recv.is_dead(), f.is_dead) << f.name;
    const Tensor& got = recv.tensor();
    if (!f.is_dead) {
      EXPECT_TRUE(got.ContentEquals(f.tensor)) << f.name << " " << got.DebugString();
      if (got.TotalBytes() > 0) {
        EXPECT_EQ(got.allocator(), server_->recv_allocator()) << "lands in the pooled allocator";
      }
    }
  }
  EXPECT_GT(server_->stats().bytes.load(), int64_t{64} << 20);
  EXPECT_EQ(server_->stats().errors.load(), 0);
}

TEST_P(GrpcClusterTest, ThreeProcessesConcurrentRecvsFromTwoPeers) {
  StartCluster(3);
  std::vector<ParsedKey> keys;
  std::vector<Tensor> expected;
  for (int task = 1; task <= 2; ++task) {
    for (const testing::Fixture& f : testing::MakeFixtures(task, false)) {
      if (f.is_dead) continue;
      keys.push_back(Key(task, f.name));
      expected.push_back(f.tensor);
    }
  }
  auto r = *server_->rendezvous_mgr()->Find(kStep);
  absl::StatusOr<std::vector<Tensor>> got = RecvAll(*r, keys);
  ASSERT_TRUE(got.ok()) << got.status();
  for (size_t i = 0; i < keys.size(); ++i) {
    EXPECT_TRUE((*got)[i].ContentEquals(expected[i])) << keys[i].full_key;
  }
  // The two peers' data differ (different seeds), so nothing was crossed over.
  EXPECT_FALSE((*got)[0].ContentEquals((*got)[keys.size() / 2]));
}

TEST_P(GrpcClusterTest, RecvBeforeSendWaitsForTheProducer) {
  StartCluster(2);
  // The peer never sends "late"; task 0 sends to itself through the same rendezvous instead to
  // show local matching, while the remote recv waits and is then failed by the step cleanup.
  auto r = *server_->rendezvous_mgr()->Find(kStep + 1);
  PendingRecv recv(*r, Key(1, "late"));
  EXPECT_FALSE(recv.Wait(absl::Milliseconds(300)));
  server_->rendezvous_mgr()->Cleanup(kStep + 1);
  ASSERT_TRUE(recv.Wait(absl::Seconds(10)));
  EXPECT_EQ(recv.status().code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(recv.status().message(), HasSubstr("cleaned up"));
}

TEST_P(GrpcClusterTest, StepCleanupOnThePeer) {
  StartCluster(2);
  absl::StatusOr<grpc_transport::WorkerClient*> peer = server_->Worker(TaskName("worker", 1));
  ASSERT_TRUE(peer.ok());
  // A recv waiting on the peer for a step is failed when the peer cleans that step up.
  auto r = *server_->rendezvous_mgr()->Find(kStep + 5);
  PendingRecv recv(*r, Key(1, "never"));
  absl::SleepFor(absl::Milliseconds(200));
  ASSERT_TRUE((*peer)->CleanupStep(kStep + 5, absl::Seconds(10)).ok());
  ASSERT_TRUE(recv.Wait(absl::Seconds(10)));
  EXPECT_EQ(recv.status().code(), absl::StatusCode::kCancelled) << recv.status();
  EXPECT_THAT(recv.status().message(),
              HasSubstr(absl::StrCat("step ", kStep + 5, " was cleaned up")));
  EXPECT_THAT(recv.status().message(), HasSubstr("/job:worker/replica:0/task:1"));
  // Tensors of a cleaned-up step are gone, and asking for them says so.
  ASSERT_TRUE((*peer)->CleanupStep(kStep, absl::Seconds(10)).ok());
  absl::StatusOr<Tensor> after = Recv(kStep, Key(1, "scalar"));
  EXPECT_EQ(after.status().code(), absl::StatusCode::kFailedPrecondition) << after.status();
  EXPECT_THAT(after.status().message(), HasSubstr("already cleaned up"));
}

TEST_P(GrpcClusterTest, KilledPeerGivesUnavailableWithinTheDeadline) {
  StartCluster(2, /*recv_timeout=*/absl::Seconds(30));
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
  StartCluster(2, /*recv_timeout=*/absl::Seconds(60), /*big=*/true);
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
  StartCluster(2, /*recv_timeout=*/absl::Seconds(60));
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
  StartCluster(2, /*recv_timeout=*/absl::Seconds(60));
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
    StartCluster(2, /*recv_timeout=*/absl::Seconds(30), /*big=*/true);
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
  StartCluster(2, /*recv_timeout=*/absl::Seconds(20));
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
  StartCluster(2, /*recv_timeout=*/absl::Seconds(20), /*big=*/true);
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
  StartCluster(2, /*recv_timeout=*/absl::Milliseconds(1500));
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
  StartCluster(2, /*recv_timeout=*/absl::Seconds(60));
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

TEST_P(GrpcClusterTest, RestartedPeerIsDetectedAndItsNewIncarnationServes) {
  StartCluster(2);
  const uint64_t old_incarnation = incarnations_[1];
  ASSERT_TRUE(Recv(kStep, Key(1, "scalar")).ok());
  peers_[1]->Signal(SIGKILL);
  ASSERT_TRUE(peers_[1]->Wait(absl::Seconds(10)).ok());
  ASSERT_NO_FATAL_FAILURE(StartPeer(1));
  ASSERT_NE(incarnations_[1], old_incarnation);
  absl::StatusOr<Tensor> stale = Recv(kStep, Key(1, "medium", old_incarnation));
  // Aborted where the watchdog's probe finds the new incarnation first; Unavailable where the
  // fabric itself saw the old process go (shmem, at once, from its socket). Both name the peer,
  // and TensorFlow-style recovery treats the two alike.
  EXPECT_THAT(stale.status().code(),
              ::testing::AnyOf(absl::StatusCode::kAborted, absl::StatusCode::kUnavailable))
      << stale.status();
  EXPECT_THAT(stale.status().message(), HasSubstr("task:1")) << stale.status();
  absl::StatusOr<Tensor> fresh = Recv(kStep, Key(1, "medium"));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  for (const testing::Fixture& f : testing::MakeFixtures(1, false)) {
    if (f.name == "medium") {
      EXPECT_TRUE(fresh->ContentEquals(f.tensor));
    }
  }
}

// A sender killed and restarted in the middle of a step, while a recv of that step waits on it:
// the waiting recv ends once, with an error naming the peer, and the step goes on with the new
// incarnation, whose tensors of the same step arrive intact.
TEST_P(GrpcClusterTest, APeerRestartedMidStepFailsTheRecvWaitingOnItAndTheStepGoesOn) {
  StartCluster(2, /*recv_timeout=*/absl::Seconds(30));
  ASSERT_TRUE(Recv(kStep, Key(1, "scalar")).ok());  // the step is under way
  std::shared_ptr<RemoteRendezvous> r = *server_->rendezvous_mgr()->Find(kStep);
  PendingRecv waiting(*r, Key(1, "never"));
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time killed = absl::Now();
  peers_[1]->Signal(SIGKILL);
  ASSERT_TRUE(peers_[1]->Wait(absl::Seconds(10)).ok());
  ASSERT_NO_FATAL_FAILURE(StartPeer(1));
  ASSERT_TRUE(waiting.Wait(absl::Seconds(30))) << "the recv outlived its peer's restart";
  EXPECT_LT(absl::Now() - killed, absl::Seconds(15));
  EXPECT_THAT(waiting.status().code(),
              ::testing::AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kAborted))
      << waiting.status();
  EXPECT_THAT(waiting.status().message(), HasSubstr("task:1")) << waiting.status();
  // A recv may fail fast while the connection or channel to the new process comes up.
  ASSERT_NO_FATAL_FAILURE(ExpectDeliveredSoon(*r, Key(1, "scalar"), "the restart"));
  absl::StatusOr<Tensor> fresh = Recv(kStep, Key(1, "medium"));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  for (const testing::Fixture& f : testing::MakeFixtures(1, false)) {
    if (f.name == "medium") {
      EXPECT_TRUE(fresh->ContentEquals(f.tensor));
    }
  }
}

TEST_P(GrpcClusterTest, MalformedRequestsAreRejectedAndThePeerKeepsServing) {
  StartCluster(2);
  absl::StatusOr<grpc_transport::WorkerClient*> peer = server_->Worker(TaskName("worker", 1));
  ASSERT_TRUE(peer.ok());
  auto raw_recv = [&](const std::string& key, int64_t step) {
    proto::RecvTensorRequest request;
    request.set_step_id(step);
    request.set_rendezvous_key(key);
    grpc::ByteBuffer req, resp;
    bool own;
    EXPECT_TRUE(
        grpc::SerializationTraits<proto::RecvTensorRequest>::Serialize(request, &req, &own).ok());
    auto ctx = std::make_shared<grpc::ClientContext>();
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    Notification done;
    grpc::Status status;
    (*peer)->RecvTensorAsync(ctx, &req, &resp, key, step, [&](grpc::Status s) {
      status = s;
      done.Notify();
    });
    done.WaitForNotification();
    return status;
  };
  if (GetParam() == "grpc+verbs" || GetParam() == "grpc+verbs-copy") {
    // These tasks receive over their channels and do not serve RecvTensor at all.
    grpc::Status refused = raw_recv(Key(1, "dtype/float32").full_key, kStep);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNIMPLEMENTED) << refused.error_message();
    absl::StatusOr<Tensor> good = Recv(kStep, Key(1, "dtype/float32"));
    EXPECT_TRUE(good.ok()) << good.status();
    return;
  }
  grpc::Status garbage = raw_recv("not a key", kStep);
  EXPECT_EQ(garbage.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(garbage.error_message(), HasSubstr("malformed rendezvous key"));
  // A key that names another task as its source.
  grpc::Status wrong_task = raw_recv(
      Key(1, "x").full_key.replace(Key(1, "x").full_key.find("task:1"), 6, "task:0"), kStep);
  EXPECT_EQ(wrong_task.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << wrong_task.error_message();
  // Still serving.
  absl::StatusOr<Tensor> good = Recv(kStep, Key(1, "dtype/float32"));
  EXPECT_TRUE(good.ok()) << good.status();
}

TEST_P(GrpcClusterTest, KeysNamingTasksOutsideTheClusterFail) {
  StartCluster(2);
  ParsedKey key = *ParsedKey::Parse(
      ParsedKey::Create(CpuDeviceName("worker", 9), 1, server_->device_name(), "x"));
  absl::StatusOr<Tensor> got = Recv(kStep, key);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(got.status().message(), HasSubstr("not in the cluster spec"));
}

TEST_P(GrpcClusterTest, PortInUseAndUnknownTaskAreClearErrors) {
  StartCluster(2);
  ServerOptions options;
  options.cluster = *ClusterSpec::Parse(cluster_);
  options.job = "worker";
  options.task = 1;  // its port is held by the peer process
  absl::StatusOr<std::unique_ptr<Server>> clash = Server::Create(options);
  EXPECT_EQ(clash.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(clash.status().message(), HasSubstr("in use"));
  options.task = 5;
  EXPECT_EQ(Server::Create(options).status().code(), absl::StatusCode::kNotFound);
  options.task = 0;
  options.job = "ps";
  EXPECT_EQ(Server::Create(options).status().code(), absl::StatusCode::kNotFound);
  options.job = "worker";
  options.protocol = "carrier-pigeon";
  absl::StatusOr<std::unique_ptr<Server>> bad = Server::Create(options);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("available: grpc"));
}

TEST_P(GrpcClusterTest, WaitForPeersNamesMissingTasks) {
  StartCluster(2);
  EXPECT_TRUE(server_->WaitForPeers(absl::Seconds(10)).ok());
  peers_[1]->Signal(SIGKILL);
  ASSERT_TRUE(peers_[1]->Wait(absl::Seconds(10)).ok());
  // A fresh server (no recorded incarnations) cannot reach the dead task.
  server_.reset();
  ServerOptions options;
  options.cluster = *ClusterSpec::Parse(cluster_);
  options.job = "worker";
  options.task = 0;
  server_ = *Server::Create(options);
  absl::Status s = server_->WaitForPeers(absl::Milliseconds(800));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("/job:worker/replica:0/task:1 at 127.0.0.1:"));
}

INSTANTIATE_TEST_SUITE_P(Protocols, GrpcClusterTest,
                         ::testing::Values("grpc", "grpc+verbs", "grpc+verbs-copy", "grpc+gdr"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name) {
                             if (!absl::ascii_isalnum(c)) c = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace tensorverbs
