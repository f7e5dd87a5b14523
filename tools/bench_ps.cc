// `tensorverbs bench ps`: the seeds' headline scenario. P parameter-server tasks hold a real
// model's trainable variables (TF's round-robin placement); each of K worker tasks fetches
// every variable each step and sends a gradient of the same shape back; the step is
// synchronous (a ps sends step s+1's weights after it has every worker's step-s gradients).
// There is no compute: what is timed is the transport, which is what the protocols differ in.
//
// Every task is a child process (`tensorverbs bench-ps-task`), on this host or, with --netns,
// each in its own network namespace on a bridge. The launcher only starts them and collects one
// JSON result line from each.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/common/checksum.h"
#include "src/common/config.h"
#include "src/common/status_macros.h"
#include "src/server/server.h"
#include "src/support/process_util.h"
#include "src/support/subprocess.h"
#include "tensorverbs/device_name.h"
#include "tensorverbs/placement.h"
#include "tools/bench_cluster.h"
#include "tools/bench_models.h"
#include "tools/bench_util.h"
#include "tools/commands.h"
#include "tools/netns.h"
#include "tools/placement_flags.h"

namespace tensorverbs::tools {
namespace {

constexpr char kPs[] = "ps";
constexpr char kWorker[] = "worker";

// "<prefix><variable name>" for each variable.
std::vector<std::string> Names(const std::string& prefix,
                               const std::vector<const ModelVariable*>& vars) {
  std::vector<std::string> names;
  for (const ModelVariable* v : vars) names.push_back(prefix + v->name);
  return names;
}

absl::StatusOr<std::vector<Tensor>> PoolTensors(Server& server,
                                                const std::vector<const ModelVariable*>& vars,
                                                uint32_t seed) {
  std::vector<Tensor> out;
  for (const ModelVariable* v : vars) {
    ASSIGN_OR_RETURN(TensorShape shape, TensorShape::Create(v->shape));
    ASSIGN_OR_RETURN(Tensor t,
                     Tensor::Allocate(server.recv_allocator(), DataType::kFloat32, shape));
    FillBenchPattern(t.data(), t.TotalBytes(), seed + static_cast<uint32_t>(out.size()));
    out.push_back(std::move(t));
  }
  return out;
}

// Checks the start of a received tensor against what its sender filled it with: enough to
// catch a wrong, stale or shifted tensor, and cheap enough to sit inside a timed step (a whole
// 392 MiB VGG16 variable would add a pattern fill and two CRC passes to it). The pattern is
// generated 8 bytes at a time, so a prefix of a multiple of 8 is the pattern of that length.
constexpr size_t kVerifyBytes = size_t{64} << 10;

absl::Status Verify(const Tensor& t, uint32_t seed, const std::string& what) {
  const size_t n = std::min(t.TotalBytes(), kVerifyBytes);
  if (Crc32c(t.data(), n) != BenchPatternCrc(n, seed)) {
    return absl::DataLossError(absl::StrCat(what, " arrived with the wrong bytes"));
  }
  return absl::OkStatus();
}

absl::Status RunTask(const BenchPsTaskOptions& o, nlohmann::json* result) {
  ASSIGN_OR_RETURN(ModelSpec model, GetModel(o.model));
  ASSIGN_OR_RETURN(TaskPlacement placement,
                   PlacementFromFlags(o.cluster_from, o.cluster, o.job, o.task));
  const ClusterSpec& cluster = placement.cluster;
  const std::string& job = placement.job;
  const int task = placement.task;
  ServerOptions options = ServerOptions::FromConfig(Config::Get());
  options.cluster = cluster;
  options.job = job;
  options.task = task;
  o.server.Apply(&options);
  options.transfer.recv_timeout = absl::Minutes(5);
  ASSIGN_OR_RETURN(std::unique_ptr<Server> server, Server::Create(options));
  RETURN_IF_ERROR(server->WaitForPeers(absl::Minutes(2)));
  const int num_ps = static_cast<int>(cluster.TaskAddresses().size()) - o.workers;
  if (num_ps < 1 || o.workers < 1) return absl::InvalidArgumentError("bad cluster for bench ps");
  auto device = [](const char* job, int task) { return CpuDeviceName(job, task); };
  auto incarnation = [&](const char* job, int task) -> absl::StatusOr<uint64_t> {
    return server->PeerIncarnation(TaskName(job, task), absl::Seconds(30));
  };
  // TF's replica_device_setter: variable i lives on ps i mod P.
  std::vector<std::vector<const ModelVariable*>> on_ps(num_ps);
  for (size_t i = 0; i < model.variables.size(); ++i) {
    on_ps[i % num_ps].push_back(&model.variables[i]);
  }
  const int total_steps = o.warmup + o.steps + 1;
  std::vector<double> step_ms, fetch_ms;
  const double cpu0 = CpuSeconds();
  const int64_t copies0 = server->stats().copies.load();
  absl::Time measured_start;
  if (job == kPs) {
    const std::vector<const ModelVariable*>& mine = on_ps[task];
    ASSIGN_OR_RETURN(std::vector<Tensor> weights, PoolTensors(*server, mine, 1000 * task));
    std::vector<std::vector<ParsedKey>> to_worker, from_worker;
    for (int w = 0; w < o.workers; ++w) {
      ASSIGN_OR_RETURN(uint64_t inc, incarnation(kWorker, w));
      to_worker.push_back(MakeKeys(server->device_name(), server->incarnation(), device(kWorker, w),
                                   Names("var/", mine)));
      from_worker.push_back(
          MakeKeys(device(kWorker, w), inc, server->device_name(), Names("grad/", mine)));
    }
    for (int s = 0; s < total_steps; ++s) {
      const int64_t step = o.step_base + s;
      const absl::Time t0 = absl::Now();
      if (s == o.warmup) measured_start = t0;
      ASSIGN_OR_RETURN(std::shared_ptr<RemoteRendezvous> r, server->rendezvous_mgr()->Find(step));
      for (int w = 0; w < o.workers; ++w) {
        for (size_t v = 0; v < mine.size(); ++v)
          RETURN_IF_ERROR(r->Send(to_worker[w][v], weights[v]));
      }
      if (s == total_steps - 1) {
        // The last weights only end the workers' last measured step: wait until they are taken.
        const absl::Time deadline = absl::Now() + absl::Minutes(5);
        while (r->NumPendingSends() > 0 && absl::Now() < deadline) {
          absl::SleepFor(absl::Milliseconds(2));
        }
        break;
      }
      for (int w = 0; w < o.workers; ++w) {
        ASSIGN_OR_RETURN(std::vector<Tensor> grads, RecvAll(*r, from_worker[w]));
        // Spot-check one gradient per worker and step (the whole model would cost a CRC pass).
        if (!grads.empty()) {
          const size_t v = static_cast<size_t>(s) % grads.size();
          RETURN_IF_ERROR(Verify(grads[v], 5000 * (w + 1) + 100 * task + v,
                                 absl::StrCat("gradient ", mine[v]->name, " of worker ", w)));
        }
      }
      server->rendezvous_mgr()->Cleanup(step);
      if (s >= o.warmup && s < o.warmup + o.steps) {
        step_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
      }
    }
  } else {
    // Everything this worker fetches, ps by ps, and the gradients it sends back.
    std::vector<const ModelVariable*> all;
    std::vector<ParsedKey> fetch, push;
    std::vector<uint32_t> fetch_seeds, push_seeds;
    for (int p = 0; p < num_ps; ++p) {
      ASSIGN_OR_RETURN(uint64_t inc, incarnation(kPs, p));
      std::vector<ParsedKey> f =
          MakeKeys(device(kPs, p), inc, server->device_name(), Names("var/", on_ps[p]));
      std::vector<ParsedKey> g = MakeKeys(server->device_name(), server->incarnation(),
                                          device(kPs, p), Names("grad/", on_ps[p]));
      for (size_t v = 0; v < on_ps[p].size(); ++v) {
        all.push_back(on_ps[p][v]);
        fetch.push_back(f[v]);
        push.push_back(g[v]);
        fetch_seeds.push_back(1000 * p + static_cast<uint32_t>(v));
        push_seeds.push_back(5000 * (task + 1) + 100 * p + static_cast<uint32_t>(v));
      }
    }
    // Gradients are produced into the registered pool, as a worker's compute would.
    std::vector<Tensor> grads;
    for (size_t i = 0; i < all.size(); ++i) {
      ASSIGN_OR_RETURN(std::vector<Tensor> one, PoolTensors(*server, {all[i]}, push_seeds[i]));
      grads.push_back(std::move(one[0]));
    }
    absl::Time previous;
    for (int s = 0; s < total_steps; ++s) {
      const int64_t step = o.step_base + s;
      const absl::Time t0 = absl::Now();
      if (s == o.warmup) measured_start = t0;
      if (s > o.warmup && s <= o.warmup + o.steps) {
        step_ms.push_back(absl::ToDoubleMilliseconds(t0 - previous));
      }
      previous = t0;
      ASSIGN_OR_RETURN(std::shared_ptr<RemoteRendezvous> r, server->rendezvous_mgr()->Find(step));
      ASSIGN_OR_RETURN(std::vector<Tensor> weights, RecvAll(*r, fetch));
      if (s >= o.warmup && s < o.warmup + o.steps) {
        fetch_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
      }
      const size_t v = static_cast<size_t>(s) % weights.size();
      RETURN_IF_ERROR(Verify(weights[v], fetch_seeds[v], absl::StrCat("variable ", all[v]->name)));
      weights.clear();
      // Every ps has step s-1's gradients of every worker (it sent step s): s-1 is done here.
      if (s > 0) server->rendezvous_mgr()->Cleanup(step - 1);
      if (s == total_steps - 1) break;  // the last fetch only closes the last measured step
      for (size_t i = 0; i < grads.size(); ++i) RETURN_IF_ERROR(r->Send(push[i], grads[i]));
    }
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - measured_start);
  *result = {{"job", job},
             {"task", task},
             {"step_ms", step_ms},
             {"fetch_ms", fetch_ms},
             {"cpu_s", CpuSeconds() - cpu0},
             {"wall_s", seconds},
             {"copies", server->stats().copies.load() - copies0},
             {"fabric",
              server->verbs_transport() ? server->verbs_transport()->fabric_name() : "tcp (gRPC)"}};
  // Each channel's own fabric (a task with peers on its host and elsewhere has two).
  if (auto* verbs = server->verbs_transport()) {
    std::map<std::string, int> channels;
    for (const auto& c : verbs->ChannelSnapshots(absl::Seconds(10))) {
      if (c.state == "ready") ++channels[c.fabric];
    }
    (*result)["channels"] = channels;
  }
  // Report, then keep serving until the launcher says every task is done: the peers' last
  // transfers may still be reading this task's memory.
  std::printf("result %s\n", result->dump().c_str());
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line) && line != "exit") {
  }
  server->Stop();
  return absl::OkStatus();
}

struct PsRow {
  std::string model, protocol, fabric;
  std::string channels;        // ready channels of every task, by fabric: "shmem (shmem) x12, ..."
  std::string fabric_setting;  // the TENSORVERBS_FABRIC it ran with (empty: the environment's)
  int workers = 0, ps = 0;
  double step_ms_p50 = 0, step_ms_p90 = 0;
  double gbps = 0;  // weights and gradients moved per second
  double copies_per_step = 0;
  double cpu_s_per_step = 0;
};

absl::StatusOr<PsRow> RunConfig(const std::string& model_name, const std::string& protocol,
                                const std::string& fabric, int workers, const BenchPsOptions& o,
                                int64_t step_base) {
  ASSIGN_OR_RETURN(ModelSpec model, GetModel(model_name));
  const int tasks = o.ps + workers;
  // With --hosts, the ps shares its host with the first workers (tasks in blocks).
  std::unique_ptr<BenchLayout> layout;
  if (o.launcher == "srun") {
    ASSIGN_OR_RETURN(layout, BenchLayout::CreateUnderSrun({{kPs, o.ps}, {kWorker, workers}}));
  } else {
    ASSIGN_OR_RETURN(layout, BenchLayout::Create(tasks, o.netns, o.hosts));
  }
  std::vector<std::string> ps_addrs, worker_addrs;
  for (int i = 0; i < tasks; ++i) {
    (i < o.ps ? ps_addrs : worker_addrs).push_back(layout->addresses()[i]);
  }
  const std::string cluster = absl::StrCat(kPs, "=", absl::StrJoin(ps_addrs, ","), ";", kWorker,
                                           "=", absl::StrJoin(worker_addrs, ","));
  BenchServerOptions server;
  server.protocol = protocol;
  server.poll_mode = o.poll_mode;
  server.fabric = fabric;
  ASSIGN_OR_RETURN(
      std::vector<nlohmann::json> results,
      layout->Run(
          [&](int i) {
            const bool is_ps = i < o.ps;
            std::vector<std::string> args = {"bench-ps-task"};
            for (std::string& a :
                 layout->PlacementArgs(cluster, is_ps ? kPs : kWorker, is_ps ? i : i - o.ps)) {
              args.push_back(std::move(a));
            }
            args.insert(args.end(),
                        {"--model", model_name, "--workers", absl::StrCat(workers), "--steps",
                         absl::StrCat(o.steps), "--warmup", absl::StrCat(o.warmup), "--step-base",
                         absl::StrCat(step_base)});
            for (const std::string& a : server.ToArgs()) args.push_back(a);
            return args;
          },
          absl::Minutes(20), "bench ps"));
  PsRow row;
  row.model = model_name;
  row.protocol = protocol;
  row.workers = workers;
  row.ps = o.ps;
  row.fabric = results[o.ps].value("fabric", "");
  std::map<std::string, int> channels;
  for (const nlohmann::json& r : results) {
    if (!r.contains("channels")) continue;
    for (const auto& [name, count] : r["channels"].items()) channels[name] += count.get<int>();
  }
  for (const auto& [name, count] : channels) {
    absl::StrAppend(&row.channels, row.channels.empty() ? "" : ", ", name, " x", count);
  }
  // A step ends when the slowest worker has its weights: take, per step, the slowest worker.
  std::vector<double> steps(o.steps, 0);
  double copies = 0, cpu = 0;
  for (int i = 0; i < tasks; ++i) {
    copies += results[i].value("copies", 0.0);
    cpu += results[i].value("cpu_s", 0.0);
    if (i < o.ps) continue;
    std::vector<double> ms = results[i]["step_ms"].get<std::vector<double>>();
    for (size_t s = 0; s < ms.size() && s < steps.size(); ++s) steps[s] = std::max(steps[s], ms[s]);
  }
  row.step_ms_p50 = Percentile(steps, 0.5);
  row.step_ms_p90 = Percentile(steps, 0.9);
  row.gbps = 2.0 * workers * static_cast<double>(model.bytes()) / (row.step_ms_p50 / 1e3) / 1e9;
  // Counters cover the warm-up steps too (tasks cannot tell them apart from set-up).
  row.copies_per_step = copies / (o.warmup + o.steps);
  row.cpu_s_per_step = cpu / (o.warmup + o.steps);
  return row;
}

}  // namespace

int RunBenchPsTask(const BenchPsTaskOptions& o) {
  return RunBenchTaskProcess([&o] {
    nlohmann::json result;
    return RunTask(o, &result);
  });
}

int RunBenchPs(const BenchPsOptions& o) {
  std::vector<std::string> models;
  for (absl::string_view m : absl::StrSplit(o.models, ',', absl::SkipWhitespace())) {
    if (m == "all") {
      models = ModelNames();
      break;
    }
    models.emplace_back(m);
  }
  absl::StatusOr<std::vector<int>> workers = ParseCountList(o.workers, "--workers", 1, 64);
  if (!workers.ok()) {
    std::fprintf(stderr, "tensorverbs bench ps: %s\n",
                 std::string(workers.status().message()).c_str());
    return 2;
  }
  const std::vector<int> worker_counts = *std::move(workers);
  absl::StatusOr<std::vector<std::string>> parsed = ParseProtocolList(o.protocols);
  if (!parsed.ok()) {
    std::fprintf(stderr, "tensorverbs bench ps: %s\n",
                 std::string(parsed.status().message()).c_str());
    return 2;
  }
  const std::vector<std::string> protocols = *parsed;
  std::vector<std::string> fabrics;
  for (absl::string_view f : absl::StrSplit(o.fabrics, ',', absl::SkipWhitespace())) {
    fabrics.emplace_back(f);
  }
  if (fabrics.empty()) fabrics.push_back("");  // the environment's TENSORVERBS_FABRIC
  if (o.launcher == "srun" && o.netns) {
    std::fprintf(stderr,
                 "tensorverbs bench ps: --launcher srun places the tasks where Slurm does; leave "
                 "out --netns and --hosts\n");
    return 2;
  }
  if (o.hosts < 0 || (o.hosts > 0 && !o.netns)) {
    std::fprintf(stderr, "tensorverbs bench ps: --hosts needs --netns (and a count >= 1)\n");
    return 2;
  }
  if (models.empty() || worker_counts.empty() || o.ps < 1 || o.steps < 1 || o.warmup < 0) {
    std::fprintf(stderr,
                 "tensorverbs bench ps: --model, --workers, --ps and --steps must be set\n");
    return 2;
  }
  for (const std::string& m : models) {
    absl::StatusOr<ModelSpec> spec = GetModel(m);
    if (!spec.ok()) {
      std::fprintf(stderr, "tensorverbs bench ps: %s\n",
                   std::string(spec.status().message()).c_str());
      return 2;
    }
  }
  std::vector<PsRow> rows;
  int64_t step_base = 1;
  for (const std::string& m : models) {
    const ModelSpec spec = *GetModel(m);
    for (int workers : worker_counts) {
      std::printf(
          "\nbench ps: %s (%zu variables, %.2f M parameters, %.1f MiB), %d ps + %d "
          "workers%s, %d steps after %d warm-up\n",
          m.c_str(), spec.variables.size(), spec.parameters() / 1e6, spec.bytes() / 1048576.0, o.ps,
          workers,
          o.launcher == "srun" ? " launched by srun"
          : !o.netns           ? ""
          : o.hosts > 0        ? absl::StrCat(" on ", o.hosts, " hosts (netns), in blocks").c_str()
                               : " (one netns each)",
          o.steps, o.warmup);
      std::printf("%16s %12s %12s %10s %12s %12s  %s\n", "protocol", "step p50 ms", "step p90 ms",
                  "GB/s", "copies/step", "CPU s/step", "fabric");
      std::vector<PsRow> group;
      for (const std::string& protocol : protocols) {
        for (const std::string& fabric : fabrics) {
          absl::StatusOr<PsRow> row = RunConfig(m, protocol, fabric, workers, o, step_base);
          step_base += 1000;
          if (!row.ok()) {
            std::fprintf(stderr, "tensorverbs bench ps: %s, %s, %d workers: %s\n", m.c_str(),
                         protocol.c_str(), workers, row.status().ToString().c_str());
            return 1;
          }
          row->fabric_setting = fabric;
          std::printf(
              "%16s %12.1f %12.1f %10.2f %12.0f %12.2f  %s%s\n", protocol.c_str(), row->step_ms_p50,
              row->step_ms_p90, row->gbps, row->copies_per_step, row->cpu_s_per_step,
              fabric.empty() ? "" : absl::StrCat("[TENSORVERBS_FABRIC=", fabric, "] ").c_str(),
              row->fabric.c_str());
          if (!row->channels.empty()) std::printf("%16s channels: %s\n", "", row->channels.c_str());
          std::fflush(stdout);
          group.push_back(*row);
        }
      }
      // Zero copy against the best of the others, as the seeds compare.
      const PsRow* zero = nullptr;
      const PsRow* second = nullptr;
      for (const PsRow& r : group) {
        if (r.protocol == "grpc+verbs") {
          zero = &r;
        } else if (second == nullptr || r.step_ms_p50 < second->step_ms_p50) {
          second = &r;
        }
      }
      if (zero != nullptr && second != nullptr) {
        std::printf("  zero copy (grpc+verbs) vs second place (%s): %.2f x the throughput%s\n",
                    second->protocol.c_str(), second->step_ms_p50 / zero->step_ms_p50,
                    m == "vgg16" ? " (goal on VGG16: >= 1.15)" : "");
      }
      rows.insert(rows.end(), group.begin(), group.end());
    }
  }
  if (!o.json.empty()) {
    nlohmann::json out = nlohmann::json::array();
    for (const PsRow& r : rows) {
      out.push_back({{"model", r.model},
                     {"protocol", r.protocol},
                     {"fabric", r.fabric},
                     {"workers", r.workers},
                     {"ps", r.ps},
                     {"step_ms_p50", r.step_ms_p50},
                     {"step_ms_p90", r.step_ms_p90},
                     {"throughput_gbps", r.gbps},
                     {"steps_per_s", 1e3 / r.step_ms_p50},
                     {"copies_per_step", r.copies_per_step},
                     {"cpu_s_per_step", r.cpu_s_per_step},
                     {"netns", o.netns},
                     {"hosts", o.hosts},
                     {"fabric_setting", r.fabric_setting},
                     {"channels", r.channels}});
    }
    if (!WriteJsonRows(o.json, out, "tensorverbs bench ps")) return 1;
  }
  return 0;
}

}  // namespace tensorverbs::tools
