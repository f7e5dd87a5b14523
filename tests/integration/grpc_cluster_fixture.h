// The fixture of the multi-process gRPC cluster tests (grpc_integration_test.cc,
// grpc_fault_test.cc): task 0 runs in the test's process, the other tasks are tv_test_peer
// processes that send the standard fixtures; helpers start, freeze, kill and restart them and
// receive from them. Parameterized by protocol. Each test runs it on its own thread.
#ifndef TENSORVERBS_TESTS_INTEGRATION_GRPC_CLUSTER_FIXTURE_H_
#define TENSORVERBS_TESTS_INTEGRATION_GRPC_CLUSTER_FIXTURE_H_

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
#include "src/server/server.h"
#include "tensorverbs/device_name.h"
#include "tensorverbs/placement.h"
#include "tests/support/fixtures.h"
#include "tests/support/pending_recv.h"
#include "tests/support/shm_regions.h"
#include "tests/support/subprocess.h"

namespace tensorverbs::cluster_testing {

using ::testing::HasSubstr;
using testing::Subprocess;

inline constexpr int64_t kStep = 42;

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
    absl::StatusOr<std::vector<int>> ports = PickFreePorts(n);
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
    options.transfer.recv_timeout = recv_timeout;
    options.protocol = GetParam();
    options.transfer.peer_timeout = absl::Seconds(2);
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

}  // namespace tensorverbs::cluster_testing

#endif  // TENSORVERBS_TESTS_INTEGRATION_GRPC_CLUSTER_FIXTURE_H_
