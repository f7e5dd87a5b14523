// InProcessCluster: tasks of one cluster as Servers in the test's own process, on free
// 127.0.0.1 ports, over a chosen protocol and fabric, with the accessors the protocol
// conformance suites share (a step's rendezvous, keys between tasks, pattern tensors in a
// task's registered pool). Used from the test's main thread; Stop() before the tensors a test
// received outlive the servers' pools.
#ifndef TENSORVERBS_TESTS_SUPPORT_INPROCESS_CLUSTER_H_
#define TENSORVERBS_TESTS_SUPPORT_INPROCESS_CLUSTER_H_

#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/protocol/message.h"
#include "src/server/server.h"
#include "tensorverbs/placement.h"
#include "tests/support/fixtures.h"
#include "tests/support/pending_recv.h"

namespace tensorverbs::testing {

// The grpc+verbs engine's names, for every test that looks inside it (its options, counters,
// limits). Tests use these and never the engine's own namespace or header, so that moving or
// renaming the engine changes this block only.
using VerbsTransport = ::tensorverbs::verbs::VerbsTransport;
using VerbsOptions = ::tensorverbs::verbs::VerbsOptions;
using VerbsStats = ::tensorverbs::protocol::VerbsStats;
inline constexpr size_t kMaxKeyBytes = ::tensorverbs::protocol::kMaxNameLength;
inline constexpr uint32_t kVerbsWireVersion = ::tensorverbs::protocol::kWireVersion;

struct ClusterOptions {
  std::string protocol = "grpc+verbs";
  std::string fabric = "loopback";
  std::string provider;
  absl::Duration recv_timeout = absl::Seconds(60);
  uint64_t max_tensor_bytes = kDefaultMaxTensorBytes;  // what each task accepts from a peer
  int64_t max_peer_steps = 1024;  // steps peers' requests may start on each task
  // Adjusts every server's grpc+verbs options after the defaults above.
  std::function<void(ServerOptions&)> tune;
  // Per-task protocol overrides (task i gets protocols[i] where given).
  std::vector<std::string> protocols;
  // Authentication; `security_for(t)` overrides it per task where set.
  rpc::SecurityOptions security;
  std::function<rpc::SecurityOptions(int)> security_for;
  // Every task's device copier (a stand-in on machines without a GPU); it outlives the cluster.
  DeviceCopier* device_copier = nullptr;
  // Every task's direct device path and device pools (stand-ins; see ServerOptions).
  std::shared_ptr<fabric::DeviceMemory> device_memory;
  std::function<absl::StatusOr<std::unique_ptr<PoolAllocator>>(int device)> device_pool_factory;
};

class InProcessCluster {
 public:
  ~InProcessCluster() { Stop(); }

  absl::Status Start(int n, const ClusterOptions& o) {
    Stop();
    absl::StatusOr<std::vector<int>> ports = PickFreePorts(n);
    if (!ports.ok()) return ports.status();
    std::vector<std::string> addrs;
    for (int p : *ports) addrs.push_back(absl::StrCat("127.0.0.1:", p));
    const std::string cluster = absl::StrCat("worker=", absl::StrJoin(addrs, ","));
    for (int t = 0; t < n; ++t) {
      ServerOptions options;
      options.cluster = *ClusterSpec::Parse(cluster);
      options.job = "worker";
      options.task = t;
      options.protocol = t < static_cast<int>(o.protocols.size()) ? o.protocols[t] : o.protocol;
      options.transfer.recv_timeout = o.recv_timeout;
      options.max_tensor_bytes = o.max_tensor_bytes;
      options.max_peer_steps = o.max_peer_steps;
      options.security = o.security_for ? o.security_for(t) : o.security;
      options.device_copier = o.device_copier;
      options.device_memory = o.device_memory;
      options.device_pool_factory = o.device_pool_factory;
      options.verbs.fabric = o.fabric;
      options.verbs.ofi_provider = o.provider;
      // A probe answered by a server TSan slows tenfold, on two loaded cores, can take seconds
      // (it runs on the progress thread). A grpc+gdr test over libfabric shm under TSan once
      // went 20 s without an answer: the watchdog closed the channel mid-test, and libfabric
      // shm, whose peer is in the same process, crashed in its next poll.
      options.transfer.peer_timeout = absl::Seconds(kUnderThreadSanitizer ? 60 : 5);
      // Generous: under TSan on two cores hundreds of RecvTensor calls can queue ahead of a
      // grpc+gdr channel set-up.
      options.transfer.connect_timeout = absl::Seconds(60);
      if (o.tune) o.tune(options);
      absl::StatusOr<std::unique_ptr<Server>> server = Server::Create(options);
      if (!server.ok()) return server.status();
      servers_.push_back(*std::move(server));
    }
    return absl::OkStatus();
  }

  void Stop() {
    // Every task stops writing before any closes: over shm between servers of one process, a
    // write into a closed peer's region would land in unmapped memory.
    for (auto& s : servers_) {
      if (s) s->StopTraffic();
    }
    for (auto& s : servers_) {
      if (s) s->Stop();
    }
    servers_.clear();
  }

  Server& server(int t) { return *servers_[t]; }
  VerbsTransport& transport(int t) { return *servers_[t]->verbs_transport(); }
  std::shared_ptr<RemoteRendezvous> Step(int task, int64_t step) {
    return *server(task).rendezvous_mgr()->Find(step);
  }
  // The key of tensor `name` sent by task `src` to task `dst`.
  ParsedKey Key(int src, const std::string& name, int dst = 0) {
    return *ParsedKey::Parse(ParsedKey::Create(server(src).device_name(), server(src).incarnation(),
                                               server(dst).device_name(), name));
  }
  // A pattern tensor in task's registered pool (where a training step's tensors live).
  Tensor PoolTensor(int task, DataType dtype, std::vector<int64_t> dims, uint32_t seed) {
    Tensor t = *Tensor::Allocate(server(task).recv_allocator(), dtype, *TensorShape::Create(dims));
    FillPattern(t, seed);
    return t;
  }

 private:
  std::vector<std::unique_ptr<Server>> servers_;
};

// A parameterized test over an InProcessCluster, with its accessors; subclasses start it.
template <typename Param>
class ClusterTest : public ::testing::TestWithParam<Param> {
 protected:
  void TearDown() override { cluster_.Stop(); }

  void StartWith(int n, const ClusterOptions& o) {
    absl::Status s = cluster_.Start(n, o);
    ASSERT_TRUE(s.ok()) << s;
  }
  Server& server(int t) { return cluster_.server(t); }
  VerbsTransport& transport(int t) { return cluster_.transport(t); }
  std::shared_ptr<RemoteRendezvous> Step(int task, int64_t step) {
    return cluster_.Step(task, step);
  }
  ParsedKey Key(int src, const std::string& name, int dst = 0) {
    return cluster_.Key(src, name, dst);
  }
  Tensor PoolTensor(int task, DataType dtype, std::vector<int64_t> dims, uint32_t seed) {
    return cluster_.PoolTensor(task, dtype, std::move(dims), seed);
  }

  InProcessCluster cluster_;
  absl::Duration recv_timeout_ = absl::Seconds(60);
  uint64_t max_tensor_bytes_ = kDefaultMaxTensorBytes;
  int64_t max_peer_steps_ = 1024;
  DeviceCopier* device_copier_ = nullptr;
  std::shared_ptr<fabric::DeviceMemory> device_memory_;
  std::function<absl::StatusOr<std::unique_ptr<PoolAllocator>>(int device)> device_pool_factory_;
};

}  // namespace tensorverbs::testing

#endif  // TENSORVERBS_TESTS_SUPPORT_INPROCESS_CLUSTER_H_
