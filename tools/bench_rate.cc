// `tensorverbs bench rate`: many small tensors outstanding at once between a receiver and a
// sender process (PairBench); tensors per second per protocol and per message-slot count and
// batch limit of the verbs protocols (1 slot, batch 1 is the seed's stop-and-wait buffer),
// beside the raw fabric's rate of small writes measured in the same run. Each measurement is
// repeated (--repeat) after a warm-up, and reported as its median and range.
//
// The measurement (MeasureRates) and each report (text ratios, JSON) are separate functions;
// all run on the tool's main thread.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "src/common/status_macros.h"
#include "tools/bench_cluster.h"
#include "tools/bench_fabric.h"
#include "tools/bench_phase.h"
#include "tools/bench_util.h"
#include "tools/commands.h"
#include "tools/netns.h"

namespace tensorverbs::tools {
namespace {

struct RateRow {
  std::string protocol, fabric;
  int slots = 0;  // 0: not a verbs protocol
  int batch = 0;
  size_t size = 0;
  int64_t recvs = 0;
  double tensors_per_s = 0, p50_us = 0, p99_us = 0;  // medians over the repetitions
  double cpu_us = 0;  // CPU time of both processes per tensor (median)
  Spread rate, cpu;
};

// Every (protocol, slots, batch, size) configuration in turn, printing each row as it is done.
absl::Status MeasureRates(const BenchRateOptions& o, const std::vector<std::string>& protocols,
                          const std::vector<size_t>& sizes, const std::vector<int>& slots,
                          const std::vector<int>& batches, const NetnsHost* netns,
                          std::vector<RateRow>* rows) {
  int64_t next_step = 1;
  // Keys per step: a step of a real model carries hundreds of tensors.
  const int keys_per_step = std::min(o.window, 1000);
  std::printf(
      "tensorverbs bench rate: %d recvs per configuration, %d outstanding, %d keys per step, "
      "%d measured repetition%s%s%s\n",
      o.recvs, o.window, keys_per_step, o.repeat, o.repeat == 1 ? "" : "s",
      o.repeat == 1 ? "" : " (median [min-max])",
      netns ? ", peer in its own network namespace" : "");
  std::printf("%16s %6s %6s %8s %26s %10s %10s %12s  %s\n", "protocol", "slots", "batch", "#bytes",
              "tensors/s", "p50[us]", "p99[us]", "CPU us/xfer", "fabric");
  for (const std::string& protocol : protocols) {
    std::vector<std::pair<int, int>> configs;  // (slots, batch); (0, 0) for grpc
    if (IsVerbsProtocol(protocol)) {
      for (int n : slots) {
        for (int b : batches) configs.emplace_back(n, b);
      }
    } else {
      configs.emplace_back(0, 0);
    }
    for (const auto& [n, batch] : configs) {
      BenchServerOptions server;
      server.protocol = protocol;
      server.message_slots = n;
      server.message_batch = batch;
      server.poll_mode = o.poll_mode;
      server.callback_threads = o.callback_threads;
      absl::StatusOr<std::unique_ptr<PairBench>> bench = PairBench::Start(server, netns);
      if (!bench.ok()) {
        return absl::Status(bench.status().code(),
                            absl::StrCat(protocol, ": ", bench.status().ToString()));
      }
      for (size_t size : sizes) {
        const std::string prefix = absl::StrCat("rate", size, "_");
        const std::vector<ParsedKey> keys = (*bench)->Keys(prefix, keys_per_step);
        const uint32_t seed = static_cast<uint32_t>(size) + 7;
        // A warm-up stream as long as a measured one: the meta-data caches fill, as after a
        // training step, and pools and tables reach their steady size.
        absl::StatusOr<PhaseResult> run =
            RunPhase(**bench, prefix, keys, size, seed, std::max(keys_per_step, o.recvs), o.window,
                     false, &next_step);
        std::vector<double> rates, p50s, p99s, cpus;
        for (int rep = 0; run.ok() && rep < o.repeat; ++rep) {
          run = RunPhase(**bench, prefix, keys, size, seed, o.recvs, o.window, true, &next_step);
          if (!run.ok()) break;
          rates.push_back(o.recvs / absl::ToDoubleSeconds(run->elapsed));
          p50s.push_back(Percentile(run->latency_us, 0.5));
          p99s.push_back(Percentile(run->latency_us, 0.99));
          cpus.push_back((run->local.cpu_seconds + run->peer.cpu_seconds) * 1e6 / o.recvs);
        }
        if (!run.ok()) {
          return absl::Status(run.status().code(),
                              absl::StrCat(protocol, ", ", n, " slots, batch ", batch, ", ",
                                           SizeName(size), ": ", run.status().ToString()));
        }
        RateRow row;
        row.protocol = protocol;
        row.fabric = (*bench)->fabric();
        row.slots = n;
        row.batch = batch;
        row.size = size;
        row.recvs = o.recvs;
        row.rate = SpreadOf(rates);
        row.cpu = SpreadOf(cpus);
        row.tensors_per_s = row.rate.median;
        row.p50_us = SpreadOf(p50s).median;
        row.p99_us = SpreadOf(p99s).median;
        row.cpu_us = row.cpu.median;
        std::printf("%16s %6s %6s %8s %26s %10.1f %10.1f %12s  %s\n", protocol.c_str(),
                    n > 0 ? absl::StrCat(n).c_str() : "-",
                    batch > 0 ? absl::StrCat(batch).c_str() : "-", SizeName(size).c_str(),
                    FormatSpread(row.rate, 0, o.repeat).c_str(), row.p50_us, row.p99_us,
                    FormatSpread(row.cpu, 2, o.repeat).c_str(), row.fabric.c_str());
        std::fflush(stdout);
        rows->push_back(row);
      }
    }
  }
  return absl::OkStatus();
}

// Tensors per second against the raw fabric's writes per second (`window` in flight): a tensor
// takes at least one content write, so this is the protocol's per-tensor overhead on top of the
// fabric's.
void PrintFabricRatios(const std::vector<RateRow>& rows, const std::vector<FabricRow>& fabric_rows,
                       const std::string& fabric_name, int window) {
  if (!fabric_rows.empty()) {
    std::printf("\nrate relative to the raw fabric's small writes (%s, window %d)\n",
                fabric_name.c_str(), window);
    for (const RateRow& r : rows) {
      const FabricRow* f = FindFabricRow(fabric_rows, r.size);
      if (f == nullptr || f->bw_gbps <= 0) continue;
      const double writes_per_s = f->bw_gbps * 1e9 / static_cast<double>(r.size);
      std::printf(
          "  %s %s: %s slots, batch %s: %.0f tensors/s = %.2f x %.0f writes/s; %.2f us "
          "of CPU per tensor (goal <= 2)\n",
          r.protocol.c_str(), SizeName(r.size).c_str(),
          r.slots > 0 ? absl::StrCat(r.slots).c_str() : "-",
          r.batch > 0 ? absl::StrCat(r.batch).c_str() : "-", r.tensors_per_s,
          r.tensors_per_s / writes_per_s, writes_per_s, r.cpu_us);
    }
  }
}

// The message-slot and batching optimizations against the seed's buffer.
void PrintSlotRatios(const std::vector<RateRow>& rows) {
  // The message-slot and batching optimizations, as ratios to the seed's buffer: one slot, one
  // message per write, stop-and-wait.
  std::printf("\nrate relative to the seed's stop-and-wait buffer (1 slot, batch 1)\n");
  for (const RateRow& r : rows) {
    if (r.slots == 0 || (r.slots == 1 && r.batch == 1)) continue;
    for (const RateRow& base : rows) {
      if (base.protocol != r.protocol || base.size != r.size || base.slots != 1 ||
          base.batch != 1) {
        continue;
      }
      // With slots enough to hide the round trip, the rate is bounded by the CPU a tensor
      // costs (both processes) on the cores there are.
      const double cpu_bound = sysconf(_SC_NPROCESSORS_ONLN) / (r.cpu_us * 1e-6);
      std::printf("  %s %s: %d slots, batch %d = %.2f x%s; CPU bound at %.0f tensors/s = %.2f x\n",
                  r.protocol.c_str(), SizeName(r.size).c_str(), r.slots, r.batch,
                  r.tensors_per_s / base.tensors_per_s,
                  r.slots == 8 ? " (goal for 8 slots: >= 5)" : "", cpu_bound,
                  cpu_bound / base.tensors_per_s);
    }
  }
}

nlohmann::json RateJson(const std::vector<RateRow>& rows, const std::vector<FabricRow>& fabric_rows,
                        const BenchRateOptions& o, bool netns) {
  nlohmann::json out = nlohmann::json::array();
  for (const RateRow& r : rows) {
    out.push_back({{"protocol", r.protocol},
                   {"fabric", r.fabric},
                   {"message_slots", r.slots},
                   {"message_batch", r.batch},
                   {"netns", netns},
                   {"size_bytes", r.size},
                   {"recvs", r.recvs},
                   {"window", o.window},
                   {"tensors_per_s", r.tensors_per_s},
                   {"p50_us", r.p50_us},
                   {"p99_us", r.p99_us},
                   {"cpu_us_per_transfer", r.cpu_us},
                   {"repeat", o.repeat},
                   {"tensors_per_s_min", r.rate.min},
                   {"tensors_per_s_max", r.rate.max},
                   {"cpu_us_per_transfer_min", r.cpu.min},
                   {"cpu_us_per_transfer_max", r.cpu.max}});
    if (const FabricRow* f = FindFabricRow(fabric_rows, r.size); f != nullptr && f->bw_gbps > 0) {
      const double writes_per_s = f->bw_gbps * 1e9 / static_cast<double>(r.size);
      out.back()["fabric_writes_per_s"] = writes_per_s;
      out.back()["ratio_to_fabric_writes"] = r.tensors_per_s / writes_per_s;
    }
  }
  return out;
}

}  // namespace

int RunBenchRate(const BenchRateOptions& o) {
  absl::StatusOr<std::vector<size_t>> sizes = ParseSizeList(o.sizes);
  absl::StatusOr<std::vector<std::string>> protocols = ParseProtocolList(o.protocols);
  absl::StatusOr<std::vector<int>> slot_list = ParseCountList(o.slots, "--slots", 1, 1024);
  absl::StatusOr<std::vector<int>> batch_list = ParseCountList(o.batch, "--batch", 1, 128);
  for (const absl::Status& s :
       {sizes.status(), protocols.status(), slot_list.status(), batch_list.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "tensorverbs bench rate: %s\n", std::string(s.message()).c_str());
      return 2;
    }
  }
  const std::vector<int>& slots = *slot_list;
  const std::vector<int>& batches = *batch_list;
  if (slots.empty() || batches.empty() || o.recvs < 1 || o.window < 1) {
    std::fprintf(stderr,
                 "tensorverbs bench rate: --slots, --batch, --recvs and --window must be set\n");
    return 2;
  }
  std::unique_ptr<NetnsHost> netns;
  if (o.netns && !MakeNetnsHost("rate", &netns)) return 1;
  // The ceiling: the raw fabric's windowed small writes with immediate, in the same run.
  std::vector<FabricRow> fabric_rows;
  std::string fabric_name;
  if (o.baselines) {
    MeasureCeiling(*sizes, std::min(o.window, 64), netns.get(), &fabric_rows, &fabric_name);
    std::printf("\n");
  }
  std::vector<RateRow> rows;
  if (absl::Status s = MeasureRates(o, *protocols, *sizes, slots, batches, netns.get(), &rows);
      !s.ok()) {
    std::fprintf(stderr, "tensorverbs bench rate: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  PrintFabricRatios(rows, fabric_rows, fabric_name, std::min(o.window, 64));
  PrintSlotRatios(rows);
  if (!o.json.empty() && !WriteJsonRows(o.json, RateJson(rows, fabric_rows, o, netns != nullptr),
                                        "tensorverbs bench rate")) {
    return 1;
  }
  return 0;
}

}  // namespace tensorverbs::tools
