// Every protocol between real processes on 127.0.0.1: task 0 runs in the test, the other tasks
// are tv_test_peer processes that send the standard fixtures. What needs separate processes
// (killed, restarted and unreachable peers, ports held by another process, tensors crossing
// process boundaries) is here; protocol behaviour that one process shows is in
// tests/conformance/protocol_conformance_test.cc.
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

TEST_P(GrpcClusterTest, TwoProcessesExchangeEveryDtypeEmptyRank8StringsDeadAnd64MiB) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, absl::Seconds(60), /*big=*/true));
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
  ASSERT_NO_FATAL_FAILURE(StartCluster(3));
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
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
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
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
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

TEST_P(GrpcClusterTest, RestartedPeerIsDetectedAndItsNewIncarnationServes) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
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
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, /*recv_timeout=*/absl::Seconds(30)));
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
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
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
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
  ParsedKey key = *ParsedKey::Parse(
      ParsedKey::Create(CpuDeviceName("worker", 9), 1, server_->device_name(), "x"));
  absl::StatusOr<Tensor> got = Recv(kStep, key);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(got.status().message(), HasSubstr("not in the cluster spec"));
}

TEST_P(GrpcClusterTest, PortInUseAndUnknownTaskAreClearErrors) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
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
  ASSERT_NO_FATAL_FAILURE(StartCluster(2));
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
