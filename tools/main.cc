// tensorverbs: the command-line tool. `tensorverbs --help` lists the subcommands.
#include <CLI/CLI.hpp>

#include <cstdio>

#include "src/common/config.h"
#include "src/server/server.h"
#include "absl/strings/str_join.h"
#include "tools/commands.h"

int main(int argc, char** argv) {
  using namespace tensorverbs::tools;
  CLI::App app{"tensorverbs: RDMA tensor transport (grpc, grpc+verbs) with server, demo and tools"};
  app.require_subcommand(1);
  const std::string protocols = absl::StrJoin(tensorverbs::AvailableProtocols(), ", ");

  ServerCommandOptions server;
  CLI::App* server_cmd = app.add_subcommand("server", "Run one task of a cluster until SIGTERM/SIGINT");
  server_cmd->add_option("--cluster", server.cluster,
                         "Cluster spec: ps=host:port;worker=host:port,host:port or JSON")
      ->required();
  server_cmd->add_option("--job", server.job, "This task's job name")->required();
  server_cmd->add_option("--task", server.task, "This task's index in its job")->required();
  server_cmd->add_option("--protocol", server.protocol, "Protocol (" + protocols + ")")
      ->default_val("grpc");
  server_cmd->add_flag("--wait-for-peers", server.wait_for_peers,
                       "Wait until every other task answers (TENSORVERBS_CONNECT_TIMEOUT_MS)");

  DemoOptions demo;
  CLI::App* demo_cmd = app.add_subcommand(
      "demo", "Train a small model with 1 ps + K workers as local processes");
  demo_cmd->add_option("--protocol", demo.protocol,
                       "Protocol (" + protocols + "); default: the best available");
  demo_cmd->add_option("--steps", demo.steps, "Training steps")->default_val(20);
  demo_cmd->add_option("--workers", demo.workers, "Worker tasks")->default_val(2);
  demo_cmd->add_option("--learning-rate", demo.learning_rate, "SGD learning rate")->default_val(0.2);

  CLI::App* info_cmd = app.add_subcommand(
      "info", "Show the fabric backends and providers usable here and the configuration");

  BenchFabricOptions bench;
  CLI::App* bench_cmd = app.add_subcommand("bench", "Benchmarks");
  bench_cmd->require_subcommand(1);
  CLI::App* bench_fabric = bench_cmd->add_subcommand(
      "fabric", "Write-with-immediate bandwidth and latency per size between two processes");
  bench_fabric->add_option("--backend", bench.backend, "Fabric backend (ofi, loopback)")
      ->default_val("ofi");
  bench_fabric->add_option("--providers", bench.providers,
                           "Comma-separated libfabric providers")->default_val("shm,tcp;ofi_rxm");
  bench_fabric->add_option("--sizes", bench.sizes, "Comma-separated sizes: 4B,4KiB,1MiB,...")
      ->default_val("4B,64B,1KiB,4KiB,64KiB,1MiB,16MiB,64MiB,256MiB");
  bench_fabric->add_option("--iters", bench.iters, "Iterations per size (default: by size)");
  bench_fabric->add_option("--window", bench.window, "Writes in flight for bandwidth")
      ->default_val(16);
  bench_fabric->add_flag("!--no-compare", bench.compare, "Do not run fi_pingpong");
  bench_fabric->add_option("--json", bench.json, "Write JSON rows to this file");

  BenchFabricOptions peer;
  CLI::App* peer_cmd = app.add_subcommand("bench-fabric-peer", "Target side of bench fabric");
  peer_cmd->group("");
  peer_cmd->add_option("--backend", peer.backend)->required();
  peer_cmd->add_option("--providers", peer.providers)->required();
  peer_cmd->add_option("--max-size", peer.max_size)->required();

  DemoTaskOptions task;
  CLI::App* task_cmd = app.add_subcommand("demo-task", "One task of the demo (started by demo)");
  task_cmd->group("");  // internal
  task_cmd->add_option("--cluster", task.cluster)->required();
  task_cmd->add_option("--job", task.job)->required();
  task_cmd->add_option("--task", task.task)->required();
  task_cmd->add_option("--protocol", task.protocol)->required();
  task_cmd->add_option("--steps", task.steps)->required();
  task_cmd->add_option("--step-base", task.step_base)->required();
  task_cmd->add_option("--learning-rate", task.learning_rate)->required();

  CLI11_PARSE(app, argc, argv);

  if (absl::Status s = tensorverbs::Config::EnvironmentStatus(); !s.ok()) {
    std::fprintf(stderr, "tensorverbs: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (server_cmd->parsed()) return RunServerCommand(server);
  if (demo_cmd->parsed()) return RunDemoCommand(demo);
  if (task_cmd->parsed()) return RunDemoTask(task);
  if (info_cmd->parsed()) return RunInfoCommand();
  if (bench_fabric->parsed()) return RunBenchFabric(bench);
  if (peer_cmd->parsed()) return RunBenchFabricPeer(peer);
  return 2;
}
