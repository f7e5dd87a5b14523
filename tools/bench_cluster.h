// The two-process harness of the protocol benchmarks (`tensorverbs bench p2p` and `bench rate`).
//
// The launcher is task 0 of a two-task cluster and receives; PairBench starts task 1, the
// sender, as a child process (`tensorverbs bench-peer`, optionally inside a network namespace)
// and drives it with one command line at a time on its stdin:
//   send <prefix> <keys> <bytes> <first_step> <steps> <seed>   -> "ok"
//       pre-sends a uint8 tensor of <bytes> from its registered pool (or from a GPU, with
//       --send-device) under keys
//       <prefix>0..<prefix><keys-1> in each step of [first_step, first_step + steps)
//   cleanup <first_step> <steps>                                -> "ok"
//   usage                              -> "usage <cpu seconds> <copies> <copied bytes>"
//   quit
// Errors come back as "error <status>". RunRecvs then receives those tensors in the launcher
// with a bounded number outstanding and times each recv.
//
// All of it runs on the launcher's main thread, except the recv callbacks, which run on the
// server's callback executor and only touch RunRecvs' shared state.
#ifndef TENSORVERBS_TOOLS_BENCH_CLUSTER_H_
#define TENSORVERBS_TOOLS_BENCH_CLUSTER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/server/server.h"
#include "src/support/subprocess.h"
#include "tensorverbs/parsed_key.h"
#include "tools/netns.h"

namespace tensorverbs::tools {

// "grpc,grpc+verbs,..." (or the short names verbs, copy-verbs, gdr) -> canonical protocol names
// in the order given; empty: every available protocol, the baseline first.
absl::StatusOr<std::vector<std::string>> ParseProtocolList(const std::string& list);

// What every process of one benchmark configuration runs with.
struct BenchServerOptions {
  std::string protocol = "grpc+verbs";
  int message_slots = 0;            // 0: TENSORVERBS_MESSAGE_SLOTS
  int message_batch = 0;            // 0: TENSORVERBS_MESSAGE_BATCH
  std::string poll_mode;            // empty: TENSORVERBS_POLL_MODE
  int callback_threads = -1;        // -1: TENSORVERBS_CALLBACK_THREADS; 0: inline
  std::string send_device = "cpu";  // where the sender's tensors live: cpu, cuda, cuda:N
  std::string fabric;               // empty: TENSORVERBS_FABRIC
  // Further rails of this process (TENSORVERBS_RAILS), comma-separated; empty: the variable's.
  // Set per task (each host has its own addresses), by PairBench::Start on a railed host.
  std::string rails;

  // As command-line flags of `bench-peer` / `bench-ps-task`.
  std::vector<std::string> ToArgs() const;
  // Into a server's options.
  void Apply(ServerOptions* options) const;
};

// `tensorverbs bench-peer`: the sender of a PairBench.
struct BenchPeerOptions {
  std::string cluster;
  std::string job = "worker";
  int task = 1;
  BenchServerOptions server;
};
int RunBenchPeer(const BenchPeerOptions& options);

// `tensorverbs bench-ps-task`: one task of `bench ps` (bench_ps.cc). Prints "result <json>".
struct BenchPsTaskOptions {
  std::string cluster;
  std::string job;
  int task = -1;
  std::string cluster_from;  // "slurm": instead of cluster, job and task (BenchLayout under srun)
  std::string model;
  int workers = 1;
  int steps = 10;
  int warmup = 2;
  int64_t step_base = 1;
  BenchServerOptions server;
};
int RunBenchPsTask(const BenchPsTaskOptions& options);

// Where the tasks of a bench that runs one process per task (`bench ps`, `bench scale`) live:
// this host, or network namespaces on a bridge (netns), one per task or `hosts` of them with the
// tasks in blocks (Slurm's block distribution: task i on host i * hosts / tasks), each task on a
// free port. Run starts the processes, collects one "result <json>" line from each, then tells
// each "exit" and waits for it. Or, CreateUnderSrun, Slurm places them: Run starts one job step
// (`srun --label --input=all`), whose tasks place themselves (`--cluster-from slurm`) and whose
// labelled lines give each rank's result. Used from the launcher's thread.
class BenchLayout {
 public:
  static absl::StatusOr<std::unique_ptr<BenchLayout>> Create(int tasks, bool netns, int hosts);
  // `jobs` in rank order ({{"ps", 1}, {"worker", 2}}): TENSORVERBS_SLURM_JOBS for the step.
  // NotFound when srun is not on PATH.
  static absl::StatusOr<std::unique_ptr<BenchLayout>> CreateUnderSrun(
      const std::vector<std::pair<std::string, int>>& jobs);
  // "host:port" of each task (under srun, Slurm decides: "slurm rank R").
  const std::vector<std::string>& addresses() const { return addresses_; }
  // The arguments that place task `task` of `job` in `cluster` (under srun: the task's own
  // SLURM_* variables).
  std::vector<std::string> PlacementArgs(const std::string& cluster, const std::string& job,
                                         int task) const;
  // What Run does besides starting the tasks and collecting their results. Where `gate` is set,
  // Run waits for a line starting with it from every task, then tells each "go": what a task
  // times after that begins only once all N processes stand (`bench scale --start gated`). Once
  // every task reported, and before any is told to exit, `after` (where given) runs once per
  // task, in order, with the task's process and its result to add to: a phase that needs the
  // others idle (`bench scale`'s quiet idle turns). Under srun, whose tasks share one input,
  // `after` is skipped and a gate is refused.
  struct Phases {
    using After = std::function<absl::Status(int task, support::Subprocess&, nlohmann::json&)>;
    std::string gate;
    After after;
  };
  // Task i runs `<this executable> <args_of(i)>`; `what` names the bench in errors. Under
  // srun, every task runs args_of(0): they may differ only in their placement.
  absl::StatusOr<std::vector<nlohmann::json>> Run(
      const std::function<std::vector<std::string>(int)>& args_of, absl::Duration timeout,
      const std::string& what, const Phases& phases = {});

 private:
  BenchLayout() = default;
  absl::StatusOr<std::vector<nlohmann::json>> RunUnderSrun(const std::vector<std::string>& args,
                                                           absl::Duration timeout,
                                                           const std::string& what);
  std::unique_ptr<NetnsCluster> netns_;
  std::vector<int> host_of_;
  std::vector<std::string> addresses_;
  std::string srun_;       // srun's path: this layout runs under Slurm
  std::string srun_jobs_;  // TENSORVERBS_SLURM_JOBS for the step
};

// The body of a bench task process (`bench-ps-task`, `bench-scale-task`): runs `task`, which
// prints its own "result <json>" line; a failure is printed as "error <status>", which the
// launcher's BenchLayout::Run reports. Returns the process's exit code.
int RunBenchTaskProcess(const std::function<absl::Status()>& task);

// `tensorverbs bench-scale-task`: one task of `bench scale` (bench_scale.cc), of job "worker",
// placed by --cluster and --task or by --cluster-from (under srun). Prints "result <json>", then
// serves until its stdin says "exit".
struct BenchScaleTaskOptions {
  std::string cluster;
  std::string job;
  int task = -1;             // unset
  std::string cluster_from;  // "slurm" or "tf_config": the placement from the launcher
  int steps = 20;
  std::string bytes = "1KiB";
  bool channels_at_start = false;  // set up every channel in set-up (Server::SetUpChannels)
  // Once its server stands, print "created" and wait for "go" (BenchLayout::Phases::gate)
  // before the set-up is timed.
  bool gated = false;
  // Tasks 0..ps-1 are parameter servers, which exchange with every worker, and each worker with
  // them alone; 0: every task exchanges with every other (an all-to-all).
  int ps = 0;
  BenchServerOptions server;
};
int RunBenchScaleTask(const BenchScaleTaskOptions& options);

// This process's task (task 0, the receiver) and its peer processes, which send on command;
// the one UseSender picks is "the peer" of the calls below.
class PairBench {
 public:
  // Starts the peer (inside `netns` when given) and this process's server, and waits until
  // both see each other (channels set up, for grpc+verbs).
  static absl::StatusOr<std::unique_ptr<PairBench>> Start(const BenchServerOptions& options,
                                                          const NetnsHost* netns);
  // A pair inside a cluster of two hosts: task 1 shares this host (and network namespace),
  // task 2 runs inside `netns`, so each task opens the same-host fabric for one peer and the
  // network fabric for the other. Peer 0 is task 1, peer 1 task 2; peer 0 sends first.
  static absl::StatusOr<std::unique_ptr<PairBench>> StartMixed(const BenchServerOptions& options,
                                                               const NetnsHost& netns);
  PairBench(const PairBench&) = delete;
  PairBench& operator=(const PairBench&) = delete;
  ~PairBench();  // tells the peers to quit and stops the server

  Server& server() { return *server_; }
  int peers() const { return static_cast<int>(peers_.size()); }
  void UseSender(int peer) { sender_ = peer; }
  // The fabric this task receives from the peer over, as its channel says: "shmem (shmem)",
  // "ofi (tcp;ofi_rxm)", "ibverbs (mlx5_0:1)"; "tcp (gRPC)" for the grpc protocol.
  std::string fabric() const;

  // The keys the peer sends under `prefix`: <prefix>0 .. <prefix><keys-1>.
  std::vector<ParsedKey> Keys(const std::string& prefix, int keys) const;

  absl::Status PeerSend(const std::string& prefix, int keys, size_t bytes, int64_t first_step,
                        int64_t steps, uint32_t seed);
  // Cleans the steps up on every task.
  absl::Status Cleanup(int64_t first_step, int64_t steps);

  struct Usage {
    double cpu_seconds = 0;
    int64_t copies = 0;
    int64_t copied_bytes = 0;
    // Device tensors: copies between host and GPU memory (the proxy path's), and tensors the
    // fabric wrote from or into GPU memory directly (sends and recvs).
    int64_t device_copies = 0;
    int64_t device_direct = 0;
  };
  absl::StatusOr<Usage> PeerUsage();
  Usage LocalUsage() const;

 private:
  PairBench() = default;
  // Task 0 here at `hosts[0]`, task i a child process at `hosts[i]` run behind `prefixes[i]`
  // (the namespace's exec prefix, or nothing); `rails[i]`, where given, task i's further rails
  // (BenchServerOptions::rails).
  static absl::StatusOr<std::unique_ptr<PairBench>> StartTasks(
      const BenchServerOptions& options, const std::vector<std::string>& hosts,
      const std::vector<std::vector<std::string>>& prefixes,
      const std::vector<std::string>& rails = {});

  struct Peer {
    std::unique_ptr<support::Subprocess> process;
    std::string device;
    uint64_t incarnation = 0;
  };
  std::vector<Peer> peers_;
  int sender_ = 0;
  std::unique_ptr<Server> server_;
};

struct RecvRunResult {
  std::vector<double> latency_us;  // per recv, from RecvAsync to its callback
  absl::Duration elapsed;          // first start to last completion
};

// Receives `count` tensors with at most `window` outstanding (window 1: each recv starts from
// the previous one's callback). Recv i is keys[i % keys.size()] in step first_step + i /
// keys.size(). Every tensor must have `bytes` bytes; the first and the last are checked,
// once the run is over and outside its time, against the pattern of `seed`. The first error (or
// `timeout`) ends the run. Tensors land in memory of `allocator` (null: the task's pool).
absl::StatusOr<RecvRunResult> RunRecvs(Server& server, const std::vector<ParsedKey>& keys,
                                       int64_t first_step, int64_t count, int window, size_t bytes,
                                       uint32_t seed, absl::Duration timeout,
                                       Allocator* allocator = nullptr);

}  // namespace tensorverbs::tools

#endif  // TENSORVERBS_TOOLS_BENCH_CLUSTER_H_
