// The subcommands of the `tensorverbs` tool. Each runs on the main thread and returns the
// process exit code (0 success, 1 failure, 2 bad usage); messages go to stdout and stderr.
#ifndef TENSORVERBS_TOOLS_COMMANDS_H_
#define TENSORVERBS_TOOLS_COMMANDS_H_

#include <cstdint>
#include <string>

namespace tensorverbs::tools {

struct ServerCommandOptions {
  std::string cluster;
  std::string cluster_from;  // "slurm" or "tf_config": the cluster, job and task from there
  std::string job;
  int task = -1;
  std::string protocol = "grpc";
  bool wait_for_peers = false;
  std::string metrics_file;  // Prometheus text, rewritten every metrics_interval_ms
  int metrics_interval_ms = 10000;
};
int RunServerCommand(const ServerCommandOptions& options);

struct StatsCommandOptions {
  std::string address;  // host:port of a task
  bool json = false;
  bool prometheus = false;
  std::string as_task;  // with security: the task whose credentials the call presents
  int timeout_ms = 10000;
};
int RunStatsCommand(const StatsCommandOptions& options);

struct DemoOptions {
  std::string protocol;  // empty: the best available
  int steps = 20;
  int workers = 2;
  float learning_rate = 0.2f;
  // Where the model's tensors live and travel: cpu, or cuda[:N] (weights and gradients in
  // every task's pool of that GPU's memory; the math itself runs on the CPU).
  std::string device = "cpu";
  // How the tasks start: "local" (processes of this host) or "srun" (one Slurm job step of
  // 1 + workers tasks, each placed by the SLURM_* variables, `demo-task --cluster-from slurm`).
  std::string launcher = "local";
};
int RunDemoCommand(const DemoOptions& options);

// One process of the demo cluster (started by RunDemoCommand).
struct DemoTaskOptions {
  std::string cluster;
  std::string job;
  int task = -1;
  std::string cluster_from;  // "slurm" or "tf_config": instead of cluster, job and task
  std::string protocol;
  int steps = 20;
  int64_t step_base = 1;
  float learning_rate = 0.2f;
  std::string device = "cpu";
};
int RunDemoTask(const DemoTaskOptions& options);

struct BenchFabricOptions {
  std::string backend = "ofi";
  std::string providers = "shm,tcp;ofi_rxm";  // comma-separated
  std::string sizes = "4B,64B,1KiB,4KiB,64KiB,1MiB,16MiB,64MiB,256MiB";
  int iters = 0;  // 0: chosen per size
  int window = 16;
  bool compare = true;  // also run fi_pingpong
  std::string json;
  std::string max_size;  // peer only
  std::string source;    // peer only: fabric::DomainOptions::source_address
};
int RunBenchFabric(const BenchFabricOptions& options);
int RunBenchFabricPeer(const BenchFabricOptions& options);

// `tensorverbs bench p2p`: bandwidth, latency, copies and CPU per protocol and size between
// two processes, with the raw fabric write and memcpy measured in the same run.
struct BenchP2POptions {
  std::string sizes = "4B,4KiB,64KiB,1MiB,16MiB,64MiB,256MiB";
  std::string protocols;  // empty: every available protocol
  std::string json;
  std::string plot;
  bool netns = false;  // the peer in its own network namespace, joined by veth
  // With netns: the veth link limited to this rate each way (tc tbf, "2gbit"); empty: unlimited.
  std::string link_rate;
  // With netns: the hosts joined by this many rails (veth pairs, each limited to link_rate),
  // each task with a lane on every rail (TENSORVERBS_RAILS).
  int rails = 1;
  // Also a pair inside a two-host cluster (a third task in a network namespace), beside the
  // pair alone, so each pair runs over the fabric chosen for it.
  bool mixed = false;
  int iters = 0;              // 0: chosen per size
  int window = 0;             // bandwidth recvs outstanding; 0: chosen per size
  std::string poll_mode;      // empty: TENSORVERBS_POLL_MODE
  int callback_threads = -1;  // -1: TENSORVERBS_CALLBACK_THREADS; 0: inline
  bool baselines = true;      // measure the raw fabric write too
  int repeat = 3;             // measured repetitions per size (after a warm-up); medians reported
  // Where the sender's and the receiver's tensors live: "SRC[,DST]", each cpu, cuda, cuda:N.
  std::string device = "cpu";
};
int RunBenchP2P(const BenchP2POptions& options);

// `tensorverbs bench rate`: small tensors per second with many recvs outstanding, per protocol
// and per message-slot count.
struct BenchRateOptions {
  std::string sizes = "4B,64B,1KiB,4KiB";
  std::string protocols;
  std::string slots = "1,8";
  std::string batch = "1,32";
  bool netns = false;
  int recvs = 20000;
  int window = 256;
  std::string json;
  std::string poll_mode;
  int callback_threads = -1;
  int repeat = 3;         // measured repetitions per configuration; medians reported
  bool baselines = true;  // measure the raw fabric's small-write rate too
};
int RunBenchRate(const BenchRateOptions& options);

// `tensorverbs bench ps`: parameter-server training steps of a real model's variables, P ps +
// K workers as processes, per protocol.
struct BenchPsOptions {
  std::string models = "vgg16";  // comma-separated, or "all"
  std::string workers = "2";     // comma-separated worker counts
  int ps = 1;
  std::string protocols;  // empty: every available protocol
  int steps = 10;
  int warmup = 2;
  bool netns = false;  // every task in its own network namespace on a bridge
  // With netns: this many hosts (namespaces on a bridge), the tasks spread over them in blocks
  // (0: one host per task).
  int hosts = 0;
  // Comma-separated TENSORVERBS_FABRIC values, each run in turn on the same layout (empty: the
  // environment's).
  std::string fabrics;
  std::string json;
  std::string poll_mode;
  // "local" (this host, or --netns) or "srun" (one Slurm job step per run; TENSORVERBS_SLURM_PORT
  // is each node's first task port).
  std::string launcher = "local";
};
int RunBenchPs(const BenchPsOptions& options);

// `tensorverbs bench scale`: how a cluster's costs grow with its task count. For each N, N
// tasks (child processes, on this host or spread over --hosts network namespaces) wait for
// their peers, then exchange a small tensor with every peer each step (all-to-all) or with
// their side of a parameter-server layout. Reported per N: the set-up's time (from each task's
// start, or with --start gated once all stand) and CPU time, the first step, the steady step
// time, per task the memory, registered bytes, descriptors, threads, channels and endpoints,
// and the idle progress turn during the steps and, once all are idle, timed alone
// (bench_scale.cc).
struct BenchScaleOptions {
  std::string tasks = "2,4,8,16";  // comma-separated task counts
  std::string protocol = "grpc+verbs";
  int steps = 20;
  std::string bytes = "1KiB";  // each tensor of the all-to-all
  bool netns = false;
  int hosts = 0;  // with netns: this many hosts, tasks in blocks (0: one host per task)
  std::string json;
  std::string poll_mode;
  std::string launcher = "local";  // "local" (processes here, or --netns) or "srun"
  // "on-demand": each channel set up by the first tensor of its pair (the default); "at-start":
  // every task sets up a channel to every peer during set-up.
  std::string channels = "on-demand";
  // "all-to-all": each task exchanges a tensor with every other each step; "ps:K": tasks
  // 0..K-1 are parameter servers, each worker exchanges with those K alone, and they with every
  // worker.
  std::string pattern = "all-to-all";
  // "as-launched": each task times its set-up from its own server's start, while the others may
  // still be starting; "gated": from the moment every task's server stands (not under srun).
  std::string start = "as-launched";
};
int RunBenchScale(const BenchScaleOptions& options);

// Prints the fabric backends and libfabric providers usable here, the memlock limit and the
// configuration in effect.
int RunInfoCommand();
// Prints the README's configuration table `table` (tensorverbs or rdma) from the settings
// table; the build compares it with the README (cmake/CheckSettingsTable.cmake).
int RunSettingsMarkdown(const std::string& table);

}  // namespace tensorverbs::tools

#endif  // TENSORVERBS_TOOLS_COMMANDS_H_
