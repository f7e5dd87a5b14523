// A network partition under a running job: task 1 (a tv_test_peer process) in its own network
// namespace, task 0 in this process, the veth link between them taken down while recvs wait
// and a 64 MiB tensor is in flight, then brought back up. Needs root; skips elsewhere.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/server/server.h"
#include "tensorverbs/device_name.h"
#include "tensorverbs/placement.h"
#include "tests/support/fixtures.h"
#include "tests/support/pending_recv.h"
#include "tests/support/subprocess.h"
#include "tools/netns.h"

namespace tensorverbs {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr int64_t kStep = 7;
// Spare tensors the peer sends beside the fixtures, one for each try after the heal.
constexpr int kSpares = 100;

class PartitionTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<tools::NetnsHost>> host = tools::NetnsHost::Create(61);
    if (!host.ok()) GTEST_SKIP() << "no network namespaces here: " << host.status().message();
    host_ = *std::move(host);
  }

  void TearDown() override {
    if (host_ != nullptr) (void)host_->SetLinkUp(true);
    if (peer_ != nullptr) {
      peer_->Signal(SIGTERM);
      if (!peer_->Wait(absl::Seconds(20)).ok()) peer_->Signal(SIGKILL);
    }
    server_.reset();
    peer_.reset();
    host_.reset();  // deletes the namespace and the link
  }

  // Task 1 in the namespace, sending the standard fixtures (with the 64 MiB one) at kStep;
  // task 0 here, with a 2 s peer timeout and a 60 s recv timeout.
  void StartJob() {
    absl::StatusOr<std::vector<int>> ports = PickFreePorts(2);
    ASSERT_TRUE(ports.ok()) << ports.status();
    const std::string cluster = absl::StrCat("worker=", host_->local_address(), ":", (*ports)[0],
                                             ",", host_->remote_address(), ":", (*ports)[1]);
    std::vector<std::string> args = host_->ExecPrefix();
    const std::string program = args.front();
    args.erase(args.begin());
    for (const std::string& a :
         {testing::TestPeerPath(), std::string("--cluster"), cluster, std::string("--job"),
          std::string("worker"), std::string("--task"), std::string("1"), std::string("--step"),
          absl::StrCat(kStep), std::string("--seed"), std::string("1"), std::string("--dst"),
          CpuDeviceName("worker", 0), std::string("--big"), std::string("1"),
          std::string("--protocol"), GetParam(), std::string("--spares"),
          absl::StrCat(kSpares)}) {
      args.push_back(a);
    }
    absl::StatusOr<std::unique_ptr<support::Subprocess>> peer =
        support::Subprocess::Start(program, args);
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *std::move(peer);
    absl::StatusOr<std::string> ready = peer_->WaitForLine("ready ", absl::Seconds(60));
    ASSERT_TRUE(ready.ok()) << ready.status();
    ASSERT_TRUE(absl::SimpleHexAtoi(ready->substr(6), &incarnation_)) << *ready;

    ServerOptions options;
    options.cluster = *ClusterSpec::Parse(cluster);
    options.job = "worker";
    options.task = 0;
    options.protocol = GetParam();
    options.transfer.recv_timeout = absl::Seconds(60);
    options.transfer.peer_timeout = absl::Seconds(2);
    absl::StatusOr<std::unique_ptr<Server>> server = Server::Create(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->WaitForPeers(absl::Seconds(30)).ok());
  }

  ParsedKey Key(const std::string& name) {
    return *ParsedKey::Parse(
        ParsedKey::Create(CpuDeviceName("worker", 1), incarnation_, server_->device_name(), name));
  }

  static Tensor Fixture(const std::string& name) {
    for (const testing::Fixture& f : testing::MakeFixtures(/*seed=*/1, /*with_big=*/true)) {
      if (f.name == name) return f.tensor;
    }
    return Tensor();
  }

  std::unique_ptr<tools::NetnsHost> host_;
  std::unique_ptr<support::Subprocess> peer_;
  std::unique_ptr<Server> server_;
  uint64_t incarnation_ = 0;
};

// While partitioned, a waiting recv fails UNAVAILABLE naming the peer within about the peer
// timeout (not at its 60 s deadline) and the recv whose bytes were in flight ends once, intact
// or with an error; once healed, the same two tasks exchange tensors again without a restart.
TEST_P(PartitionTest, RecvsFailWithinThePeerTimeoutAndTheJobGoesOnOnceHealed) {
  ASSERT_NO_FATAL_FAILURE(StartJob());
  std::shared_ptr<RemoteRendezvous> r = *server_->rendezvous_mgr()->Find(kStep);
  {
    PendingRecv warm(*r, Key("scalar"));  // channels and connections are up, as in a job
    ASSERT_TRUE(warm.Wait(absl::Seconds(30)));
    ASSERT_TRUE(warm.status().ok()) << warm.status();
  }

  PendingRecv never(*r, Key("never"));  // the peer never sends it
  PendingRecv big(*r, Key("big"));
  absl::SleepFor(absl::Milliseconds(2));
  const absl::Time cut = absl::Now();
  ASSERT_TRUE(host_->SetLinkUp(false).ok());

  ASSERT_TRUE(never.Wait(absl::Seconds(40))) << "the recv waited past the partition";
  const absl::Duration detected = absl::Now() - cut;
  EXPECT_LT(detected, absl::Seconds(15));
  EXPECT_EQ(never.status().code(), absl::StatusCode::kUnavailable) << never.status();
  EXPECT_THAT(never.status().message(), HasSubstr("task:1"));
  ASSERT_TRUE(big.Wait(absl::Seconds(40))) << "the in-flight recv hung";
  if (big.status().ok()) {
    EXPECT_TRUE(big.tensor().ContentEquals(Fixture("big"))) << "completed with wrong bytes";
  } else {
    EXPECT_THAT(big.status().code(),
                AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kAborted,
                      absl::StatusCode::kCancelled, absl::StatusCode::kDeadlineExceeded))
        << big.status();
    EXPECT_THAT(big.status().message(), HasSubstr("task:1"));
  }
  std::printf("partition detected after %s; in-flight recv: %s\n",
              absl::FormatDuration(detected).c_str(), big.status().ToString().c_str());

  ASSERT_TRUE(host_->SetLinkUp(true).ok());
  // gRPC reconnects with backoff and grpc+verbs sets its channel up again on the next recv; a
  // recv made meanwhile fails fast, so the job (as a user's would) tries again. Each try asks
  // for a key of its own: a try that failed after the sender answered it (the answer or, over
  // grpc+gdr, the read of the lent tensor cut off by a connection the partition broke) consumed
  // its tensor, as a recv does in any step, and a second recv of that key would rightly wait
  // for a tensor that is never sent again.
  const absl::Time healed = absl::Now();
  absl::Status last;
  bool delivered = false;
  for (int i = 0; !delivered && i < kSpares && absl::Now() - healed < absl::Seconds(45); ++i) {
    PendingRecv again(*r, Key(absl::StrCat("spare", i)));
    ASSERT_TRUE(again.Wait(absl::Seconds(70))) << "a recv after the heal hung";
    last = again.status();
    if (last.ok()) {
      EXPECT_TRUE(again.tensor().ContentEquals(testing::MakeSpare(/*seed=*/1)));
      delivered = true;
    } else {
      std::printf("try %d after the heal (%s in): %s\n", i,
                  absl::FormatDuration(absl::Now() - healed).c_str(), last.ToString().c_str());
      EXPECT_THAT(last.message(), HasSubstr("task:1")) << last;
      absl::SleepFor(absl::Milliseconds(500));
    }
  }
  EXPECT_TRUE(delivered) << "no recv succeeded within 45 s of the heal; last: " << last;
  std::printf("first recv after the heal succeeded %s later\n",
              absl::FormatDuration(absl::Now() - healed).c_str());
}

INSTANTIATE_TEST_SUITE_P(Protocols, PartitionTest,
                         ::testing::Values("grpc", "grpc+verbs", "grpc+gdr"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param;
                           for (char& c : name) {
                             if (c == '+') c = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace tensorverbs
