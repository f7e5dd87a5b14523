// `tensorverbs bench scale` (tools/commands.h): the cost of a cluster as its task count grows.
// Each task is a child process (`bench-scale-task`) that times its own set-up and steps (an
// all-to-all, or a parameter-server layout: --pattern) and reads its own resources from /proc; the
// launcher starts N of them, collects one JSON line from each and reports, per N, the slowest
// task's set-up and first step, the median task's steady step, and the mean per task (and per
// channel) of memory, registrations, descriptors and threads. With --start gated a task's set-up
// is timed from the moment every task's server stands, not from its own start, which on a
// machine with fewer cores than tasks includes the others' starts. Then, with every task idle, up
// to 16 of them in turn time their progress loop's idle turn alone (QuietIdleTurns).

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "src/common/config.h"
#include "src/common/status_macros.h"
#include "src/fabric/fabric.h"
#include "src/server/server.h"
#include "src/support/process_util.h"
#include "src/support/subprocess.h"
#include "tensorverbs/device_name.h"
#include "tensorverbs/event.h"
#include "tensorverbs/placement.h"
#include "tools/bench_cluster.h"
#include "tools/bench_util.h"
#include "tools/commands.h"
#include "tools/netns.h"
#include "tools/placement_flags.h"

namespace tensorverbs::tools {
namespace {

constexpr char kJob[] = "worker";
// How many tasks time their idle turns alone (spread over the ranks), and for how long each.
constexpr int kQuietTasks = 16;
constexpr absl::Duration kQuietSpan = absl::Milliseconds(300);

// What an idle turn costs this task while every other task of the cluster is idle too (the
// launcher asks one task at a time, once all reported). The turns timed during the steps run
// on a machine the other tasks load, which says little about the turn's own work; here that
// work, with this task's channels, peers and endpoint, is what is left. This thread drives the
// progress loop with nothing to do for kQuietSpan, in waits of 20 us, shorter than the idle
// spin (TENSORVERBS_POLL_SPIN_US, 50 by default), so that it goes from turn to turn without
// parking or sleeping. IdleTurnCost gives the medians of the last 64 timed turns (one in 16 is
// timed), the span's last millisecond or two: by then caches hold the loop's working set.
nlohmann::json QuietIdleTurns(Server* server) {
  auto* verbs = server->verbs_transport();
  if (verbs == nullptr)
    return {{"idle_turn_us", 0.0}, {"idle_turn_cpu_us", 0.0}, {"turns_timed", 0}};
  verbs->RestartIdleTurnCost();
  Event never;
  const absl::Time end = absl::Now() + kQuietSpan;
  for (absl::Time now = absl::Now(); now < end; now = absl::Now()) {
    verbs->DriveUntil(never, now + absl::Microseconds(20));
  }
  const auto turn = verbs->IdleTurnCost();
  return {{"idle_turn_us", turn ? absl::ToDoubleMicroseconds(turn->wall) : 0.0},
          {"idle_turn_cpu_us", turn ? absl::ToDoubleMicroseconds(turn->cpu) : 0.0},
          {"turns_timed", verbs->IdleTurnsTimed()}};
}

absl::Status RunTask(const BenchScaleTaskOptions& o, nlohmann::json* result) {
  const absl::Time start = absl::Now();
  ASSIGN_OR_RETURN(TaskPlacement placement,
                   PlacementFromFlags(o.cluster_from, o.cluster, o.job, o.task));
  const ClusterSpec& cluster = placement.cluster;
  const int task = placement.task;
  if (placement.job != kJob) {
    return absl::InvalidArgumentError(
        absl::StrCat("bench scale's tasks are of job '", kJob, "', not '", placement.job, "'"));
  }
  ASSIGN_OR_RETURN(size_t bytes, ParseSize(o.bytes));
  ServerOptions options = ServerOptions::FromConfig(Config::Get());
  options.cluster = cluster;
  options.job = kJob;
  options.task = task;
  o.server.Apply(&options);
  ASSIGN_OR_RETURN(std::unique_ptr<Server> server, Server::Create(options));
  const absl::Time created = absl::Now();
  if (o.gated) {
    std::printf("created\n");
    std::fflush(stdout);
    std::string go;
    if (!std::getline(std::cin, go) || go != "go") {
      return absl::AbortedError("bench scale: the launcher did not say 'go' after the start");
    }
  }
  const absl::Time setup_start = absl::Now();
  // The set-up's work, apart from how long the machine made it wait: this process's CPU time
  // (all its threads, answering the peers' probes too).
  const double setup_cpu_start = CpuSeconds();
  const int n = static_cast<int>(cluster.TaskAddresses().size());
  if (o.ps < 0 || o.ps >= n) {
    return absl::InvalidArgumentError(
        absl::StrCat("bench scale: ", o.ps, " parameter servers among ", n, " tasks"));
  }
  // The peers this task exchanges with: every other task, or its side of the ps layout.
  auto exchanges_with = [&](int p) {
    if (p == task) return false;
    if (o.ps == 0) return true;
    return (task < o.ps) != (p < o.ps);
  };
  // A ps layout's task waits for the tasks it exchanges with alone, as such a job would: a
  // worker's start costs K probes, not N.
  if (o.ps > 0) {
    std::vector<std::string> partners;
    for (int p = 0; p < n; ++p) {
      if (exchanges_with(p)) partners.push_back(TaskName(kJob, p));
    }
    RETURN_IF_ERROR(server->WaitForPeers(partners, absl::Minutes(5)));
  } else {
    RETURN_IF_ERROR(server->WaitForPeers(absl::Minutes(5)));
  }
  if (o.channels_at_start) RETURN_IF_ERROR(server->SetUpChannels(absl::Minutes(5)));
  const absl::Time connected = absl::Now();
  const double setup_cpu_ms = (CpuSeconds() - setup_cpu_start) * 1e3;
  // Every such peer's keys for this step's tensor, both ways.
  std::vector<ParsedKey> to, from;
  for (int p = 0; p < n; ++p) {
    if (!exchanges_with(p)) continue;
    ASSIGN_OR_RETURN(uint64_t inc, server->PeerIncarnation(TaskName(kJob, p), absl::Minutes(1)));
    to.push_back(
        MakeKeys(server->device_name(), server->incarnation(), CpuDeviceName(kJob, p), {"a2a"})[0]);
    from.push_back(MakeKeys(CpuDeviceName(kJob, p), inc, server->device_name(), {"a2a"})[0]);
  }
  ASSIGN_OR_RETURN(TensorShape shape,
                   TensorShape::Create({static_cast<int64_t>(std::max<size_t>(bytes / 4, 1))}));
  ASSIGN_OR_RETURN(Tensor tensor,
                   Tensor::Allocate(server->recv_allocator(), DataType::kFloat32, shape));
  FillBenchPattern(tensor.data(), tensor.TotalBytes(), static_cast<uint32_t>(task));
  std::vector<double> step_ms;
  double first_ms = 0;
  for (int s = 0; s <= o.steps; ++s) {
    const int64_t step = 1 + s;
    const absl::Time t0 = absl::Now();
    ASSIGN_OR_RETURN(std::shared_ptr<RemoteRendezvous> r, server->rendezvous_mgr()->Find(step));
    for (const ParsedKey& k : to) RETURN_IF_ERROR(r->Send(k, tensor));
    ASSIGN_OR_RETURN(std::vector<Tensor> got, RecvAll(*r, from));
    const double ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
    if (s == 0) {
      first_ms = ms;
      // The idle turns timed from here on are the steady steps', not the start's, when every
      // task was still being set up and a turn ran on caches the start had emptied.
      if (auto* verbs = server->verbs_transport()) verbs->RestartIdleTurnCost();
    } else {
      step_ms.push_back(ms);
    }
    // A peer's step s tensors were taken once it has received ours of step s + 1: s - 1 is done.
    if (s > 0) server->rendezvous_mgr()->Cleanup(step - 1);
  }
  int64_t registered = 0, channels = 0;
  double idle_turn_us = 0, idle_turn_cpu_us = 0;  // 0 where no progress loop runs (grpc alone)
  if (auto* verbs = server->verbs_transport()) {
    const auto gauges = verbs->registration_gauges();
    registered = gauges.bytes + gauges.endpoint_bytes;
    channels = static_cast<int64_t>(verbs->NumReadyChannels());
    if (const auto turn = verbs->IdleTurnCost()) {  // the wall and CPU time of one
      idle_turn_us = absl::ToDoubleMicroseconds(turn->wall);
      idle_turn_cpu_us = absl::ToDoubleMicroseconds(turn->cpu);
    }
  }
  *result = {{"task", task},
             {"create_ms", absl::ToDoubleMilliseconds(created - start)},
             {"setup_ms", absl::ToDoubleMilliseconds(connected - setup_start)},
             {"setup_cpu_ms", setup_cpu_ms},
             {"first_step_ms", first_ms},
             {"step_ms", step_ms},
             {"rss_bytes", support::ResidentBytes()},
             {"pss_bytes", support::ProportionalBytes()},
             {"registered_bytes", registered},
             {"fds", support::OpenDescriptors()},
             {"threads", support::ThreadCount()},
             {"channels", channels},
             {"idle_turn_us", idle_turn_us},
             {"idle_turn_cpu_us", idle_turn_cpu_us},
             {"endpoints", fabric::ReadFabricProcessStats().provider_endpoints}};
  std::printf("result %s\n", result->dump().c_str());
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line) && line != "exit") {
    if (line != "quiet") continue;
    const nlohmann::json quiet = QuietIdleTurns(server.get());
    std::printf("quiet %s\n", quiet.dump().c_str());
    std::fflush(stdout);
  }
  server->Stop();
  return absl::OkStatus();
}

struct ScaleRow {
  int tasks = 0;
  double setup_ms = 0;       // the slowest task's WaitForPeers (and SetUpChannels, at-start)
  double setup_ms_p50 = 0;   // the median task's (a worker's, in a ps layout)
  double setup_cpu_ms_p50 = 0;  // the median task's CPU time in its set-up
  double first_step_ms = 0;  // the slowest task's first all-to-all
  double step_ms_p50 = 0;    // the median over tasks of each task's median step
  // Means per task.
  double rss_mib = 0, pss_mib = 0, registered_mib = 0, fds = 0, threads = 0, channels = 0;
  double endpoints = 0;  // libfabric endpoints (fabric::FabricProcessStats)
  double idle_turn_us = 0;  // the median over tasks of an idle progress turn's median
  double idle_turn_cpu_us = 0;  // the same of the loop thread's CPU time in such a turn
  // The same two, of up to kQuietTasks tasks that timed their turns alone (QuietIdleTurns), and
  // the CPU time of the costliest of them.
  double quiet_turn_us = 0, quiet_turn_cpu_us = 0, quiet_turn_cpu_us_max = 0;
  int64_t quiet_turn_max_channels = 0;  // that task's channels
};

// The launcher's side of QuietIdleTurns: up to kQuietTasks tasks, spread evenly over the ranks
// (task 0, a parameter server in a ps layout, among them), asked one at a time. A task that
// fails it leaves its row without the figure ("quiet": {"error": ...}), not the run without
// its other results.
BenchLayout::Phases::After QuietPhase(int tasks) {
  return [tasks](int i, support::Subprocess& task, nlohmann::json& result) -> absl::Status {
    // i * sampled mod tasks takes each multiple of gcd(sampled, tasks) below `tasks` equally
    // often, so exactly `sampled` values of i fall below `sampled`.
    const int sampled = std::min(tasks, kQuietTasks);
    if ((i * sampled) % tasks >= sampled) return absl::OkStatus();
    absl::StatusOr<std::string> line = Tell(task, "quiet").ok()
                                           ? Expect(task, "quiet ", absl::Minutes(1))
                                           : absl::UnavailableError("the task closed its input");
    result["quiet"] = line.ok() ? nlohmann::json::parse(*line, nullptr, false)
                                : nlohmann::json{{"error", line.status().ToString()}};
    return absl::OkStatus();
  };
}

absl::StatusOr<ScaleRow> RunOne(int tasks, int ps, const BenchScaleOptions& o) {
  std::unique_ptr<BenchLayout> layout;
  if (o.launcher == "srun") {
    ASSIGN_OR_RETURN(layout, BenchLayout::CreateUnderSrun({{kJob, tasks}}));
  } else {
    ASSIGN_OR_RETURN(layout, BenchLayout::Create(tasks, o.netns, o.hosts));
  }
  const std::string cluster = absl::StrCat(kJob, "=", absl::StrJoin(layout->addresses(), ","));
  BenchServerOptions server;
  server.protocol = o.protocol;
  server.poll_mode = o.poll_mode;
  ASSIGN_OR_RETURN(
      std::vector<nlohmann::json> results,
      layout->Run(
          [&](int i) {
            std::vector<std::string> args = {"bench-scale-task"};
            for (std::string& a : layout->PlacementArgs(cluster, kJob, i)) {
              args.push_back(std::move(a));
            }
            args.insert(args.end(), {"--steps", absl::StrCat(o.steps), "--bytes", o.bytes});
            if (o.channels == "at-start") args.push_back("--channels-at-start");
            if (o.start == "gated") args.push_back("--gated");
            if (ps > 0) args.insert(args.end(), {"--ps", absl::StrCat(ps)});
            for (const std::string& a : server.ToArgs()) args.push_back(a);
            return args;
          },
          absl::Minutes(10), "bench scale",
          {.gate = o.start == "gated" ? "created" : "", .after = QuietPhase(tasks)}));
  ScaleRow row;
  row.tasks = tasks;
  std::vector<double> medians, idle_turns, idle_turns_cpu, setups, quiet, quiet_cpu, setup_cpu;
  for (const nlohmann::json& r : results) {
    setup_cpu.push_back(r.value("setup_cpu_ms", 0.0));
    if (r.contains("quiet") && r["quiet"].is_object()) {
      const nlohmann::json& q = r["quiet"];
      if (q.value("idle_turn_us", 0.0) > 0) quiet.push_back(q.value("idle_turn_us", 0.0));
      if (q.value("idle_turn_cpu_us", 0.0) > 0) {
        quiet_cpu.push_back(q.value("idle_turn_cpu_us", 0.0));
        if (quiet_cpu.back() > row.quiet_turn_cpu_us_max) {
          row.quiet_turn_cpu_us_max = quiet_cpu.back();
          row.quiet_turn_max_channels = r.value("channels", int64_t{0});
        }
      }
    }
    setups.push_back(r.value("setup_ms", 0.0));
    if (r.value("idle_turn_us", 0.0) > 0) idle_turns.push_back(r.value("idle_turn_us", 0.0));
    if (r.value("idle_turn_cpu_us", 0.0) > 0) {
      idle_turns_cpu.push_back(r.value("idle_turn_cpu_us", 0.0));
    }
    row.setup_ms = std::max(row.setup_ms, r.value("setup_ms", 0.0));
    row.first_step_ms = std::max(row.first_step_ms, r.value("first_step_ms", 0.0));
    std::vector<double> steps = r["step_ms"].get<std::vector<double>>();
    if (!steps.empty()) medians.push_back(Percentile(steps, 0.5));
    row.rss_mib += r.value("rss_bytes", 0.0) / 1048576.0 / tasks;
    row.pss_mib += r.value("pss_bytes", 0.0) / 1048576.0 / tasks;
    row.registered_mib += r.value("registered_bytes", 0.0) / 1048576.0 / tasks;
    row.fds += r.value("fds", 0.0) / tasks;
    row.threads += r.value("threads", 0.0) / tasks;
    row.channels += r.value("channels", 0.0) / tasks;
    row.endpoints += r.value("endpoints", 0.0) / tasks;
  }
  if (!medians.empty()) row.step_ms_p50 = Percentile(medians, 0.5);
  if (!setups.empty()) row.setup_ms_p50 = Percentile(setups, 0.5);
  if (!setup_cpu.empty()) row.setup_cpu_ms_p50 = Percentile(setup_cpu, 0.5);
  if (!idle_turns.empty()) row.idle_turn_us = Percentile(idle_turns, 0.5);
  if (!idle_turns_cpu.empty()) row.idle_turn_cpu_us = Percentile(idle_turns_cpu, 0.5);
  if (!quiet.empty()) row.quiet_turn_us = Percentile(quiet, 0.5);
  if (!quiet_cpu.empty()) row.quiet_turn_cpu_us = Percentile(quiet_cpu, 0.5);
  return row;
}

}  // namespace

int RunBenchScaleTask(const BenchScaleTaskOptions& o) {
  return RunBenchTaskProcess([&o] {
    nlohmann::json result;
    return RunTask(o, &result);
  });
}

int RunBenchScale(const BenchScaleOptions& o) {
  absl::StatusOr<std::vector<int>> counts = ParseCountList(o.tasks, "--tasks", 2, 256);
  int ps = 0;
  if (o.pattern != "all-to-all") {
    const absl::string_view k = absl::StripPrefix(o.pattern, "ps:");
    if (k.size() == o.pattern.size() || !absl::SimpleAtoi(k, &ps) || ps < 1) {
      std::fprintf(stderr,
                   "tensorverbs bench scale: --pattern is all-to-all or ps:K (K parameter "
                   "servers, K >= 1), not '%s'\n",
                   o.pattern.c_str());
      return 2;
    }
    for (int n : counts.ok() ? *counts : std::vector<int>()) {
      if (n <= ps) {
        std::fprintf(stderr, "tensorverbs bench scale: ps:%d needs more than %d tasks, not %d\n",
                     ps, ps, n);
        return 2;
      }
    }
  }
  if (!counts.ok()) {
    std::fprintf(stderr, "tensorverbs bench scale: %s\n",
                 std::string(counts.status().message()).c_str());
    return 2;
  }
  if (o.launcher == "srun" && o.start == "gated") {
    std::fprintf(stderr,
                 "tensorverbs bench scale: --start gated is not available with --launcher srun "
                 "(every task reads the same input); leave out --start, or launch locally\n");
    return 2;
  }
  if (o.launcher == "srun" && o.netns) {
    std::fprintf(stderr,
                 "tensorverbs bench scale: --launcher srun places the tasks where Slurm does; "
                 "leave out --netns and --hosts\n");
    return 2;
  }
  if (o.steps < 1 || !ParseSize(o.bytes).ok() || (o.hosts > 0 && !o.netns) || o.hosts < 0) {
    std::fprintf(stderr,
                 "tensorverbs bench scale: --steps must be >= 1, --bytes a size, and --hosts "
                 "needs --netns\n");
    return 2;
  }
  std::printf("bench scale: %s, %s of %s tensors, %d steps, channels %s, start %s%s\n",
              o.protocol.c_str(), o.pattern.c_str(), o.bytes.c_str(), o.steps, o.channels.c_str(),
              o.start.c_str(),
              o.launcher == "srun" ? ", each count one Slurm job step"
              : !o.netns           ? ", every task on this host"
              : o.hosts > 0 ? absl::StrCat(", ", o.hosts, " hosts (netns), in blocks").c_str()
                            : ", one netns per task");
  std::printf("%6s %10s %10s %13s %12s %10s %9s %9s %14s %8s %8s %9s %10s %13s %13s %13s %13s\n",
              "tasks", "setup ms", "setup p50", "setup CPU p50", "1st step ms", "step ms",
              "RSS MiB", "PSS MiB", "registered MiB", "fds", "threads", "channels", "endpoints",
              "idle turn us", "idle CPU us", "quiet turn us", "quiet CPU us");
  nlohmann::json rows = nlohmann::json::array();
  bool failed = false;
  for (int n : *counts) {
    absl::StatusOr<ScaleRow> row = RunOne(n, ps, o);
    if (!row.ok()) {
      // Where a cluster stops working is a result too: reported, and the other counts still run.
      std::printf("%6d failed: %s\n", n, row.status().ToString().c_str());
      std::fflush(stdout);
      rows.push_back({{"tasks", n},
                      {"protocol", o.protocol},
                      {"netns", o.netns},
                      {"hosts", o.hosts},
                      {"error", row.status().ToString()}});
      failed = true;
      continue;
    }
    std::printf(
        "%6d %10.1f %10.1f %13.1f %12.2f %10.3f %9.1f %9.1f %14.1f %8.1f %8.1f %9.1f %10.1f "
        "%13.2f %13.2f %13.2f %13.2f\n",
        n, row->setup_ms, row->setup_ms_p50, row->setup_cpu_ms_p50, row->first_step_ms,
        row->step_ms_p50, row->rss_mib, row->pss_mib, row->registered_mib, row->fds, row->threads,
        row->channels, row->endpoints, row->idle_turn_us, row->idle_turn_cpu_us, row->quiet_turn_us,
        row->quiet_turn_cpu_us);
    std::fflush(stdout);
    rows.push_back({{"tasks", n},
                    {"protocol", o.protocol},
                    {"bytes", o.bytes},
                    {"netns", o.netns},
                    {"hosts", o.hosts},
                    {"launcher", o.launcher},
                    {"channels_set_up", o.channels},
                    {"start", o.start},
                    {"pattern", o.pattern},
                    {"setup_ms", row->setup_ms},
                    {"setup_ms_p50", row->setup_ms_p50},
                    {"setup_cpu_ms_p50", row->setup_cpu_ms_p50},
                    {"first_step_ms", row->first_step_ms},
                    {"step_ms_p50", row->step_ms_p50},
                    {"rss_mib_per_task", row->rss_mib},
                    {"pss_mib_per_task", row->pss_mib},
                    {"registered_mib_per_task", row->registered_mib},
                    {"fds_per_task", row->fds},
                    {"threads_per_task", row->threads},
                    {"channels_per_task", row->channels},
                    {"endpoints_per_task", row->endpoints},
                    {"idle_turn_us", row->idle_turn_us},
                    {"idle_turn_cpu_us", row->idle_turn_cpu_us},
                    {"quiet_turn_us", row->quiet_turn_us},
                    {"quiet_turn_cpu_us", row->quiet_turn_cpu_us},
                    {"quiet_turn_cpu_us_max", row->quiet_turn_cpu_us_max},
                    {"quiet_turn_max_channels", row->quiet_turn_max_channels}});
  }
  if (!o.json.empty() && !WriteJsonRows(o.json, rows, "tensorverbs bench scale")) return 1;
  return failed ? 1 : 0;
}

}  // namespace tensorverbs::tools
