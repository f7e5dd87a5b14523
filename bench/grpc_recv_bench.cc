// Throughput and latency of one `grpc` protocol recv, between two tasks on 127.0.0.1 (two
// Servers in this process, each with its own gRPC server and client threads). Each iteration
// sends a tensor of the given size on task 1 under a fresh step and receives it on task 0.
//
//   build/bench/grpc_recv_bench --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include "absl/strings/str_cat.h"
#include "src/server/server.h"
#include "tensorverbs/device_name.h"
#include "tensorverbs/placement.h"

namespace tensorverbs {
namespace {

struct Pair {
  std::unique_ptr<Server> receiver, sender;
};

Pair& GetPair() {
  static Pair* pair = [] {
    auto* p = new Pair;
    std::vector<int> ports = *PickFreePorts(2);
    ClusterSpec cluster =
        *ClusterSpec::Parse(absl::StrCat("worker=127.0.0.1:", ports[0], ",127.0.0.1:", ports[1]));
    ServerOptions o;
    o.cluster = cluster;
    o.job = "worker";
    o.task = 0;
    p->receiver = *Server::Create(o);
    o.task = 1;
    p->sender = *Server::Create(o);
    return p;
  }();
  return *pair;
}

void BM_GrpcRecv(benchmark::State& state) {
  Pair& pair = GetPair();
  const int64_t bytes = state.range(0);
  Tensor t = Tensor::Make(DataType::kUInt8, TensorShape::Of({bytes}));
  std::memset(t.data(), 7, t.TotalBytes());
  ParsedKey key = *ParsedKey::Parse(ParsedKey::Create(
      pair.sender->device_name(), pair.sender->incarnation(), pair.receiver->device_name(), "t"));
  static int64_t step = 1;
  for (auto _ : state) {
    ++step;
    auto send_side = *pair.sender->rendezvous_mgr()->Find(step);
    if (!send_side->Send(key, t).ok()) state.SkipWithError("send failed");
    auto recv_side = *pair.receiver->rendezvous_mgr()->Find(step);
    absl::StatusOr<std::vector<Tensor>> got = RecvAll(*recv_side, {key});
    if (!got.ok()) state.SkipWithError(std::string(got.status().message()).c_str());
    pair.sender->rendezvous_mgr()->Cleanup(step);
    pair.receiver->rendezvous_mgr()->Cleanup(step);
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}
BENCHMARK(BM_GrpcRecv)
    ->Arg(4)
    ->Arg(4 << 10)
    ->Arg(1 << 20)
    ->Arg(16 << 20)
    ->Arg(64 << 20)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace tensorverbs

BENCHMARK_MAIN();
