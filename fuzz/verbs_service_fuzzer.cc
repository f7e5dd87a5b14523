// Fuzzes the grpc+verbs control plane as an outsider or a faulty member would call it: Connect
// and CheckChannel requests built from the input (task names real and made up, incarnations,
// fabrics, protocols, endpoint addresses, keys and slot counts), sent over gRPC to a live
// two-task cluster in this process on the loopback fabric. Neither task may crash or hang: every
// call is answered before its deadline, and after every input task 1 still answers a
// well-formed probe at once.
#include <fuzzer/FuzzedDataProvider.h>
#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "fuzz/fuzz_check.h"
#include "proto/verbs.grpc.pb.h"
#include "src/server/server.h"
#include "tensorverbs/placement.h"

namespace {

using namespace tensorverbs;

struct Cluster {
  std::vector<std::unique_ptr<Server>> servers;
  std::vector<std::string> tasks;
  std::unique_ptr<proto::VerbsService::Stub> stub;  // to task 1
};

Cluster* StartCluster() {
  auto* cluster = new Cluster;
  absl::StatusOr<std::vector<int>> ports = PickFreePorts(2);
  FUZZ_CHECK(ports.ok(), "free ports");
  std::vector<std::string> addresses;
  for (int port : *ports) addresses.push_back(absl::StrCat("127.0.0.1:", port));
  absl::StatusOr<ClusterSpec> spec =
      ClusterSpec::Parse(absl::StrCat("worker=", absl::StrJoin(addresses, ",")));
  FUZZ_CHECK(spec.ok(), "the cluster spec");
  for (int task = 0; task < 2; ++task) {
    ServerOptions options;
    options.cluster = *spec;
    options.job = "worker";
    options.task = task;
    options.protocol = "grpc+verbs";
    options.verbs.fabric = "loopback";
    absl::StatusOr<std::unique_ptr<Server>> server = Server::Create(options);
    FUZZ_CHECK(server.ok(), std::string(server.status().message()).c_str());
    cluster->servers.push_back(*std::move(server));
    cluster->tasks.push_back(absl::StrCat("/job:worker/replica:0/task:", task));
  }
  FUZZ_CHECK(cluster->servers[0]->WaitForPeers(absl::Seconds(30)).ok(), "the tasks connect");
  cluster->stub = proto::VerbsService::NewStub(
      grpc::CreateChannel(addresses[1], grpc::InsecureChannelCredentials()));
  return cluster;
}

std::string PickTask(FuzzedDataProvider& in, const Cluster& cluster) {
  switch (in.ConsumeIntegralInRange(0, 3)) {
    case 0:
      return cluster.tasks[0];
    case 1:
      return cluster.tasks[1];
    case 2:
      return "/job:worker/replica:0/task:7";
    default:
      return in.ConsumeRandomLengthString(300);
  }
}

grpc::Status Call(const Cluster& cluster, bool connect, const proto::ConnectRequest& c,
                  const proto::CheckChannelRequest& check) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  if (connect) {
    proto::ConnectResponse response;
    return cluster.stub->Connect(&context, c, &response);
  }
  proto::CheckChannelResponse response;
  return cluster.stub->CheckChannel(&context, check, &response);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Cluster* cluster = StartCluster();
  FuzzedDataProvider in(data, size);
  const bool connect = in.ConsumeBool();
  proto::ConnectRequest c;
  proto::CheckChannelRequest check;
  if (connect) {
    c.set_task_name(PickTask(in, *cluster));
    c.set_incarnation(in.ConsumeBool() ? cluster->servers[0]->incarnation()
                                       : in.ConsumeIntegral<uint64_t>());
    c.set_expected_incarnation(in.ConsumeBool() ? cluster->servers[1]->incarnation()
                                                : in.ConsumeIntegral<uint64_t>());
    c.set_fabric(in.ConsumeBool() ? "loopback" : in.ConsumeRandomLengthString(64));
    c.set_channel_id(in.ConsumeIntegral<uint64_t>());
    c.set_protocol(in.ConsumeBool() ? "grpc+verbs" : in.ConsumeRandomLengthString(32));
    proto::ChannelEnd* end = c.mutable_end();
    end->set_rx_addr(in.ConsumeIntegral<uint64_t>());
    end->set_rx_key(in.ConsumeRandomLengthString(80));
    end->set_rx_slots(in.ConsumeBool() ? 8 : in.ConsumeIntegral<uint32_t>());
    end->set_wire_version(in.ConsumeBool() ? 3 : in.ConsumeIntegral<uint32_t>());
    end->set_endpoint_address(in.ConsumeRemainingBytesAsString());
  } else {
    check.set_task_name(PickTask(in, *cluster));
    check.set_channel_id(in.ConsumeIntegral<uint64_t>());
  }
  const grpc::Status status = Call(*cluster, connect, c, check);
  FUZZ_CHECK(status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED,
             "a control call is answered");
  // Task 1 still answers a well-formed probe from its real peer at once.
  proto::CheckChannelRequest probe;
  probe.set_task_name(cluster->tasks[0]);
  const grpc::Status alive = Call(*cluster, false, c, probe);
  FUZZ_CHECK(alive.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED &&
                 alive.error_code() != grpc::StatusCode::UNAVAILABLE,
             "the task still answers");
  return 0;
}
