// The grpc+verbs protocol between servers of one process, over each fabric that runs here:
// loopback (with fault injection), libfabric shm and libfabric tcp;ofi_rxm. Task 0 receives;
// the other tasks send. Multi-process behaviour (killed and restarted peers) is in
// tests/integration.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "src/common/mutex.h"
#include "src/fabric/loopback/loopback.h"
#include "src/rendezvous/device_name.h"
#include "src/server/server.h"
#include "tests/support/fixtures.h"
#include "tools/process_util.h"

namespace tensorverbs {
namespace {

using ::testing::HasSubstr;

struct FabricParam {
  const char* name;
  const char* fabric;
  const char* provider;
};

// A recv whose outcome the test collects later; counts callback invocations.
class PendingRecv {
 public:
  PendingRecv(RemoteRendezvous& r, const ParsedKey& key, RecvArgs args = RecvArgs()) {
    r.RecvAsync(key, args, [this](const absl::Status& s, const Tensor& t, bool dead) {
      MutexLock lock(&mu_);
      status_ = s;
      tensor_ = t;
      is_dead_ = dead;
      ++calls_;
    });
  }
  // Waits for the callback; false on timeout.
  bool Wait(absl::Duration timeout = absl::Seconds(30)) {
    MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return calls_ > 0; },
                                timeout);
  }
  absl::Status status() {
    MutexLock lock(&mu_);
    return status_;
  }
  Tensor tensor() {
    MutexLock lock(&mu_);
    return tensor_;
  }
  bool is_dead() {
    MutexLock lock(&mu_);
    return is_dead_;
  }
  int calls() {
    MutexLock lock(&mu_);
    return calls_;
  }

 private:
  Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  Tensor tensor_ ABSL_GUARDED_BY(mu_);
  bool is_dead_ ABSL_GUARDED_BY(mu_) = false;
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
};

class VerbsProtocolTest : public ::testing::TestWithParam<FabricParam> {
 protected:
  void TearDown() override {
    for (auto& s : servers_) {
      if (s) s->Stop();
    }
    servers_.clear();
  }

  // `n` tasks in this process; `tune` adjusts every server's grpc+verbs options.
  void StartCluster(int n, std::function<void(protocol::VerbsOptions&)> tune = nullptr) {
    absl::StatusOr<std::vector<int>> ports = tools::PickFreePorts(n);
    ASSERT_TRUE(ports.ok());
    std::vector<std::string> addrs;
    for (int p : *ports) addrs.push_back(absl::StrCat("127.0.0.1:", p));
    const std::string cluster = absl::StrCat("worker=", absl::StrJoin(addrs, ","));
    for (int t = 0; t < n; ++t) {
      ServerOptions options;
      options.cluster = *ClusterSpec::Parse(cluster);
      options.job = "worker";
      options.task = t;
      options.protocol = "grpc+verbs";
      options.recv_timeout = absl::Seconds(60);
      options.verbs.fabric = GetParam().fabric;
      options.verbs.ofi_provider = GetParam().provider;
      options.verbs.peer_timeout = absl::Seconds(5);
      options.verbs.connect_timeout = absl::Seconds(20);
      if (tune) tune(options.verbs);
      absl::StatusOr<std::unique_ptr<Server>> server = Server::Create(options);
      ASSERT_TRUE(server.ok()) << server.status();
      servers_.push_back(*std::move(server));
    }
  }

  Server& server(int t) { return *servers_[t]; }
  protocol::VerbsTransport& transport(int t) { return *servers_[t]->verbs_transport(); }

  std::shared_ptr<RemoteRendezvous> Step(int task, int64_t step) {
    return *server(task).rendezvous_mgr()->Find(step);
  }

  ParsedKey Key(int src, const std::string& name, int dst = 0) {
    return *ParsedKey::Parse(ParsedKey::Create(server(src).device_name(),
                                               server(src).incarnation(),
                                               server(dst).device_name(), name));
  }

  // A tensor in the sender's registered pool (where a training step's tensors live).
  Tensor PoolTensor(int task, DataType dtype, std::vector<int64_t> dims, uint32_t seed) {
    Tensor t = *Tensor::Allocate(server(task).recv_allocator(), dtype, *TensorShape::Create(dims));
    testing::FillPattern(t, seed);
    return t;
  }

  std::vector<std::unique_ptr<Server>> servers_;
};

TEST_P(VerbsProtocolTest, EveryFixtureArrivesIntactWithItsDeadness) {
  StartCluster(2);
  const bool big = std::string(GetParam().name) != "ofi_tcp";  // tcp moves 64 MiB slowly here
  std::vector<testing::Fixture> fixtures = testing::MakeFixtures(/*seed=*/7, big);
  auto sender = Step(1, 1);
  auto receiver = Step(0, 1);
  std::vector<std::unique_ptr<PendingRecv>> recvs;
  for (const testing::Fixture& f : fixtures) {
    recvs.push_back(std::make_unique<PendingRecv>(*receiver, Key(1, f.name)));
  }
  for (const testing::Fixture& f : fixtures) {
    ASSERT_TRUE(sender->Send(Key(1, f.name), f.tensor, f.is_dead).ok());
  }
  for (size_t i = 0; i < fixtures.size(); ++i) {
    const testing::Fixture& f = fixtures[i];
    ASSERT_TRUE(recvs[i]->Wait(absl::Seconds(60))) << f.name;
    ASSERT_TRUE(recvs[i]->status().ok()) << f.name << ": " << recvs[i]->status();
    EXPECT_EQ(recvs[i]->is_dead(), f.is_dead) << f.name;
    if (!f.is_dead) {
      EXPECT_TRUE(recvs[i]->tensor().ContentEquals(f.tensor))
          << f.name << ": got " << recvs[i]->tensor().DebugString();
    }
    EXPECT_EQ(recvs[i]->calls(), 1) << f.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Fabrics, VerbsProtocolTest,
                         ::testing::Values(FabricParam{"loopback", "loopback", ""},
                                           FabricParam{"ofi_shm", "ofi", "shm"},
                                           FabricParam{"ofi_tcp", "ofi", "tcp;ofi_rxm"}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace tensorverbs
