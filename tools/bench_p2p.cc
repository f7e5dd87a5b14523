// `tensorverbs bench p2p` and `tensorverbs bench rate`: one receiver and one sender process
// (PairBench), each protocol in turn, in one run, with the raw fabric and memcpy as ceilings.
//
// p2p, per size: latency is a chain of single recvs (each started from the previous one's
// callback), bandwidth a stream with a window of recvs outstanding; every recv is its own step
// with the same key, as a training loop's are, and the sender has produced the tensor before
// it is asked for (a passive Send), so what is timed is the transport. CPU time of both
// processes and the copies the transports made are sampled around the bandwidth stream.
//
// rate: many small tensors outstanding at once; tensors per second per protocol and per
// message-slot count and batch limit of the verbs protocols (1 slot, batch 1 is the seed's
// stop-and-wait buffer), beside the raw fabric's rate of small writes measured in the same run.
//
// Both repeat each measurement (--repeat) after a warm-up and report the median and the range:
// on a small shared machine one run's figure can be off by half.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "src/common/config.h"
#include "src/common/status_macros.h"
#include "src/fabric/fabric.h"
#include "tools/bench_cluster.h"
#include "tools/bench_device.h"
#include "tools/bench_fabric.h"
#include "tools/bench_util.h"
#include "tools/commands.h"
#include "tools/netns.h"

namespace tensorverbs::tools {
namespace {

// The peer's network namespace for --netns; false (said on stderr) when it cannot be made.
bool MakeNetnsHost(const char* command, std::unique_ptr<NetnsHost>* out) {
  absl::StatusOr<std::unique_ptr<NetnsHost>> host = NetnsHost::Create();
  if (!host.ok()) {
    std::fprintf(stderr, "tensorverbs bench %s --netns: %s\n", command,
                 std::string(host.status().message()).c_str());
    return false;
  }
  *out = *std::move(host);
  return true;
}

bool IsVerbsProtocol(const std::string& p) { return p != "grpc"; }

// The fabric the verbs protocols will use here, by the same policy as the servers.
absl::StatusOr<fabric::Capabilities> ProbeFabric(bool all_local) {
  ASSIGN_OR_RETURN(std::unique_ptr<fabric::Domain> d,
                   fabric::OpenFabric(fabric::FabricChoice::FromConfig(Config::Get(), all_local)));
  return d->capabilities();
}

// The raw fabric write the verbs protocols use here, per size, measured as a ceiling in the same
// run (`window` writes in flight); says on stdout why when it cannot be measured.
void MeasureCeiling(const std::vector<size_t>& sizes, int window, const NetnsHost* netns,
                    std::vector<FabricRow>* rows, std::string* name) {
  absl::StatusOr<fabric::Capabilities> caps = ProbeFabric(/*all_local=*/netns == nullptr);
  if (!caps.ok()) {
    std::printf("\nraw fabric: skipped: %s\n", std::string(caps.status().message()).c_str());
    return;
  }
  FabricBenchSpec spec;
  spec.backend = caps->backend;
  spec.provider = caps->backend == "ofi" ? caps->provider : "";
  spec.sizes = sizes;
  spec.compare = false;
  spec.window = window;
  if (netns) spec.peer_prefix = netns->ExecPrefix();
  *name = absl::StrCat(caps->backend, " (", caps->provider, ")");
  absl::StatusOr<std::vector<FabricRow>> got = MeasureFabric(spec);
  if (!got.ok()) {
    std::printf("raw fabric: failed: %s\n", got.status().ToString().c_str());
    return;
  }
  *rows = *std::move(got);
}

struct P2PRow {
  std::string protocol;
  std::string fabric;
  size_t size = 0;
  int lat_iters = 0, bw_iters = 0, window = 0, repeat = 1;
  // Medians over the repetitions; the ranges beside them.
  double p50_us = 0, p99_us = 0, bw_gbps = 0;
  Spread p50, bw;
  double copies_per_transfer = 0, cpu_s_per_gb = 0;
  // Device tensors: copies between host and GPU per transfer, and the path that implies
  // ("proxy", "direct", or "host" when no device tensor moved).
  double device_copies_per_transfer = 0;
  std::string path;
};

int LatencyIters(size_t size) {
  return static_cast<int>(std::clamp<size_t>((size_t{512} << 20) / size, 8, 2000));
}
int BandwidthIters(size_t size) {
  return static_cast<int>(std::clamp<size_t>((size_t{1} << 30) / size, 8, 20000));
}
int BandwidthWindow(size_t size) {
  if (size <= (size_t{64} << 10)) return 64;
  if (size <= (size_t{1} << 20)) return 16;
  return static_cast<int>(std::clamp<size_t>((size_t{512} << 20) / size, 2, 8));
}

// A training loop keeps only a few steps alive; so does the benchmark: steps are pre-sent,
// received and cleaned up in batches, so that the rendezvous tables stay small.
constexpr int64_t kStepsPerBatch = 2048;

struct PhaseResult {
  std::vector<double> latency_us;
  absl::Duration elapsed;        // summed over the batches' recv streams
  PairBench::Usage local, peer;  // CPU and copies during those streams
};

// `count` recvs of `keys` (one step per keys.size() recvs), at most `window` outstanding.
absl::StatusOr<PhaseResult> RunPhase(PairBench& bench, const std::string& prefix,
                                     const std::vector<ParsedKey>& keys, size_t size, uint32_t seed,
                                     int64_t count, int window, bool usage, int64_t* next_step,
                                     Allocator* allocator = nullptr) {
  PhaseResult result;
  const int64_t per_step = static_cast<int64_t>(keys.size());
  const int64_t batch_steps = std::max<int64_t>(1, kStepsPerBatch / per_step);
  for (int64_t done = 0; done < count;) {
    const int64_t recvs = std::min(count - done, batch_steps * per_step);
    const int64_t steps = (recvs + per_step - 1) / per_step;
    const int64_t first = *next_step;
    *next_step += steps;
    RETURN_IF_ERROR(bench.PeerSend(prefix, static_cast<int>(per_step), size, first, steps, seed));
    PairBench::Usage local0, peer0;
    if (usage) {
      local0 = bench.LocalUsage();
      ASSIGN_OR_RETURN(peer0, bench.PeerUsage());
    }
    ASSIGN_OR_RETURN(RecvRunResult run, RunRecvs(bench.server(), keys, first, recvs, window, size,
                                                 seed, absl::Minutes(5), allocator));
    if (usage) {
      const PairBench::Usage local1 = bench.LocalUsage();
      ASSIGN_OR_RETURN(const PairBench::Usage peer1, bench.PeerUsage());
      result.local.cpu_seconds += local1.cpu_seconds - local0.cpu_seconds;
      result.local.copies += local1.copies - local0.copies;
      result.peer.cpu_seconds += peer1.cpu_seconds - peer0.cpu_seconds;
      result.peer.copies += peer1.copies - peer0.copies;
      result.local.device_copies += local1.device_copies - local0.device_copies;
      result.peer.device_copies += peer1.device_copies - peer0.device_copies;
      result.local.device_direct += local1.device_direct - local0.device_direct;
      result.peer.device_direct += peer1.device_direct - peer0.device_direct;
    }
    result.elapsed += run.elapsed;
    result.latency_us.insert(result.latency_us.end(), run.latency_us.begin(), run.latency_us.end());
    RETURN_IF_ERROR(bench.Cleanup(first, steps));
    done += recvs;
  }
  return result;
}

absl::Status RunProtocol(const std::string& protocol, const BenchP2POptions& o,
                         const DevicePair& devices, const std::vector<size_t>& sizes,
                         const NetnsHost* netns, int64_t* next_step, std::vector<P2PRow>* rows) {
  BenchServerOptions server;
  server.protocol = protocol;
  server.poll_mode = o.poll_mode;
  server.callback_threads = o.callback_threads;
  server.send_device = devices.src.host_accessible() ? "cpu" : devices.src.ToString();
  const bool on_gpu = !devices.src.host_accessible() || !devices.dst.host_accessible();
  ASSIGN_OR_RETURN(std::unique_ptr<PairBench> bench, PairBench::Start(server, netns));
  // Device recvs land in the receiver's GPU pool; host ones in its registered pool (null).
  Allocator* dst = nullptr;
  if (!devices.dst.host_accessible()) {
    ASSIGN_OR_RETURN(dst, AllocatorFor(devices.dst, bench->server()));
  }
  const std::string fabric = bench->fabric();
  std::printf("\n%s over %s, 2 processes%s, %s -> %s\n", protocol.c_str(), fabric.c_str(),
              netns ? " in two network namespaces (veth)" : "",
              devices.src.host_accessible() ? "cpu" : devices.src.ToString().c_str(),
              devices.dst.host_accessible() ? "cpu" : devices.dst.ToString().c_str());
  std::printf("%10s %9s %22s %10s %9s %7s %24s %12s %10s%s\n", "#bytes", "lat iters", "p50[us]",
              "p99[us]", "bw iters", "window", "BW[GB/s]", "copies/xfer", "CPU s/GB",
              on_gpu ? "  path (device copies/xfer)" : "");
  const std::vector<ParsedKey> keys = bench->Keys("p2p", 1);
  for (size_t size : sizes) {
    P2PRow row;
    row.protocol = protocol;
    row.fabric = fabric;
    row.size = size;
    row.lat_iters = o.iters > 0 ? o.iters : LatencyIters(size);
    row.bw_iters = o.iters > 0 ? o.iters : BandwidthIters(size);
    row.window = o.window > 0 ? o.window : BandwidthWindow(size);
    row.repeat = o.repeat;
    const uint32_t seed = static_cast<uint32_t>(size % 9973) + 1;
    // Warm-up: one unmeasured bandwidth stream, as long as a measured one, so that meta-data
    // caches, channel state, pool growth with its first-touch page faults and registration all
    // happen before anything is timed.
    RETURN_IF_ERROR(
        RunPhase(*bench, "p2p", keys, size, seed, row.bw_iters, row.window, false, next_step, dst)
            .status());
    std::vector<double> p50s, p99s, bws, copies, cpu, device_copies, direct;
    for (int rep = 0; rep < o.repeat; ++rep) {
      ASSIGN_OR_RETURN(PhaseResult lat, RunPhase(*bench, "p2p", keys, size, seed, row.lat_iters, 1,
                                                 false, next_step, dst));
      p50s.push_back(Percentile(lat.latency_us, 0.5));
      p99s.push_back(Percentile(lat.latency_us, 0.99));
      ASSIGN_OR_RETURN(PhaseResult bw, RunPhase(*bench, "p2p", keys, size, seed, row.bw_iters,
                                                row.window, true, next_step, dst));
      const double bytes = static_cast<double>(size) * row.bw_iters;
      bws.push_back(bytes / absl::ToDoubleSeconds(bw.elapsed) / 1e9);
      copies.push_back(static_cast<double>(bw.local.copies + bw.peer.copies) / row.bw_iters);
      cpu.push_back((bw.local.cpu_seconds + bw.peer.cpu_seconds) / (bytes / 1e9));
      device_copies.push_back(static_cast<double>(bw.local.device_copies + bw.peer.device_copies) /
                              row.bw_iters);
      direct.push_back(static_cast<double>(bw.local.device_direct + bw.peer.device_direct) /
                       row.bw_iters);
    }
    row.p50 = SpreadOf(p50s);
    row.bw = SpreadOf(bws);
    row.p50_us = row.p50.median;
    row.p99_us = SpreadOf(p99s).median;
    row.bw_gbps = row.bw.median;
    row.copies_per_transfer = SpreadOf(copies).median;
    row.cpu_s_per_gb = SpreadOf(cpu).median;
    row.device_copies_per_transfer = SpreadOf(device_copies).median;
    // Which way device tensors went: copies through host memory, or written where they are.
    if (on_gpu) {
      row.path = row.device_copies_per_transfer > 0 ? "proxy"
                 : SpreadOf(direct).median > 0      ? "direct"
                                                    : "host";
    }
    std::printf(
        "%10s %9d %22s %10.2f %9d %7d %24s %12.2f %10.3f%s\n", SizeName(size).c_str(),
        row.lat_iters, FormatSpread(row.p50, 2, o.repeat).c_str(), row.p99_us, row.bw_iters,
        row.window, FormatSpread(row.bw, 3, o.repeat).c_str(), row.copies_per_transfer,
        row.cpu_s_per_gb,
        on_gpu ? absl::StrFormat("  %s (%.2f)", row.path, row.device_copies_per_transfer).c_str()
               : "");
    std::fflush(stdout);
    rows->push_back(row);
  }
  return absl::OkStatus();
}

const P2PRow* FindRow(const std::vector<P2PRow>& rows, const std::string& protocol, size_t size) {
  for (const P2PRow& r : rows) {
    if (r.protocol == protocol && r.size == size) return &r;
  }
  return nullptr;
}

const FabricRow* FindFabricRow(const std::vector<FabricRow>& rows, size_t size) {
  for (const FabricRow& r : rows) {
    if (r.size == size) return &r;
  }
  return nullptr;
}

}  // namespace

int RunBenchP2P(const BenchP2POptions& o) {
  absl::StatusOr<std::vector<size_t>> sizes = ParseSizeList(o.sizes);
  absl::StatusOr<std::vector<std::string>> protocols = ParseProtocolList(o.protocols);
  absl::StatusOr<DevicePair> devices = ParseDevicePair(o.device);
  for (const absl::Status& s : {sizes.status(), protocols.status(), devices.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "tensorverbs bench p2p: %s\n", std::string(s.message()).c_str());
      return 2;
    }
  }
  for (const MemoryPlacement& p : {devices->src, devices->dst}) {
    if (absl::Status a = CheckDevice(p); !a.ok()) {
      std::fprintf(stderr, "tensorverbs bench p2p: --device %s: %s\n", o.device.c_str(),
                   std::string(a.message()).c_str());
      return 1;
    }
  }
  const bool on_gpu = !devices->src.host_accessible() || !devices->dst.host_accessible();
  std::unique_ptr<NetnsHost> netns;
  if (o.netns && !MakeNetnsHost("p2p", &netns)) return 1;

  // Ceilings, measured in the same run: memcpy, and the raw fabric the verbs protocols use.
  std::printf(
      "tensorverbs bench p2p: sizes %s; protocols %s; per size a warm-up stream, then %d "
      "measured repetition%s%s\n",
      o.sizes.c_str(), absl::StrJoin(*protocols, ", ").c_str(), o.repeat, o.repeat == 1 ? "" : "s",
      o.repeat == 1 ? "" : " (median [min-max])");
  std::printf("\nmemcpy between pre-faulted buffers (one copy, one core)\n%10s %10s\n", "#bytes",
              "GB/s");
  std::map<size_t, double> memcpy_gbps;
  for (size_t size : *sizes) {
    memcpy_gbps[size] = MeasureMemcpyGbps(size);
    std::printf("%10s %10.3f\n", SizeName(size).c_str(), memcpy_gbps[size]);
  }
  // The proxy path's copy stages: cudaMemcpy between pinned host memory and the GPUs.
  std::map<size_t, CopyBandwidth> d2h, h2d;
  if (on_gpu) {
    std::printf(
        "\ncudaMemcpy between pinned host memory and the GPU, and within the GPU (best of 5)\n"
        "%10s %14s %14s %14s\n",
        "#bytes", "D2H GB/s", "H2D GB/s", "D2D GB/s");
    for (size_t size : *sizes) {
      const int src = devices->src.host_accessible() ? -1 : devices->src.device;
      const int dst = devices->dst.host_accessible() ? -1 : devices->dst.device;
      for (int dev : {src, dst}) {
        if (dev < 0) continue;
        absl::StatusOr<CopyBandwidth> bw = MeasureDeviceCopies(dev, size);
        if (!bw.ok()) {
          std::fprintf(stderr, "tensorverbs bench p2p: %s\n", bw.status().ToString().c_str());
          return 1;
        }
        if (dev == src) d2h[size] = *bw;
        if (dev == dst) h2d[size] = *bw;
      }
      std::printf(
          "%10s %14s %14s %14s\n", SizeName(size).c_str(),
          d2h.count(size) ? absl::StrFormat("%.2f", d2h[size].device_to_host_gbps).c_str() : "-",
          h2d.count(size) ? absl::StrFormat("%.2f", h2d[size].host_to_device_gbps).c_str() : "-",
          h2d.count(size) ? absl::StrFormat("%.2f", h2d[size].device_to_device_gbps).c_str() : "-");
    }
  }
  std::vector<FabricRow> fabric_rows;
  std::string fabric_name;
  if (o.baselines) MeasureCeiling(*sizes, /*window=*/16, netns.get(), &fabric_rows, &fabric_name);

  std::vector<P2PRow> rows;
  int64_t next_step = 1;
  for (const std::string& protocol : *protocols) {
    absl::Status s = RunProtocol(protocol, o, *devices, *sizes, netns.get(), &next_step, &rows);
    if (!s.ok()) {
      std::fprintf(stderr, "tensorverbs bench p2p: %s: %s\n", protocol.c_str(),
                   s.ToString().c_str());
      return 1;
    }
  }

  // Ratios to the ceilings, per protocol and size.
  std::printf("\nbandwidth relative to the raw fabric write (%s) and to memcpy\n%10s",
              fabric_name.empty() ? "not measured" : fabric_name.c_str(), "#bytes");
  for (const std::string& p : *protocols) std::printf(" %22s", p.c_str());
  std::printf("\n");
  for (size_t size : *sizes) {
    std::printf("%10s", SizeName(size).c_str());
    const FabricRow* f = FindFabricRow(fabric_rows, size);
    for (const std::string& p : *protocols) {
      const P2PRow* r = FindRow(rows, p, size);
      std::string cell = "-";
      if (r != nullptr) {
        // Without the raw fabric's row (--no-baselines) there is no ratio to print, not 0.
        const std::string fab =
            f != nullptr ? absl::StrFormat("%.2fx fab", r->bw_gbps / f->bw_gbps) : "- fab";
        cell =
            absl::StrFormat("%s %.2fx mcpy", fab, r->bw_gbps / std::max(memcpy_gbps[size], 1e-9));
      }
      std::printf(" %22s", cell.c_str());
    }
    std::printf("\n");
  }

  // On GPUs: each protocol against its slowest stage (device-to-host, the fabric write for the
  // verbs protocols, host-to-device), all measured in this run.
  if (on_gpu) {
    std::printf(
        "\nproxy path relative to its slowest stage (D2H, fabric write, H2D); direct path "
        "relative to the cudaMemcpy of its one copy\n");
    for (const P2PRow& r : rows) {
      if (r.path == "direct") {
        // The one copy the direct path makes, done by cudaMemcpy: device to device, or host to
        // device, or device to host where one end is host memory.
        const bool src_gpu = !devices->src.host_accessible(),
                   dst_gpu = !devices->dst.host_accessible();
        const char* kind = src_gpu && dst_gpu ? "D2D" : src_gpu ? "D2H" : "H2D";
        const double ceiling =
            src_gpu && dst_gpu ? (h2d.count(r.size) ? h2d[r.size].device_to_device_gbps : 0)
            : src_gpu          ? (d2h.count(r.size) ? d2h[r.size].device_to_host_gbps : 0)
                               : (h2d.count(r.size) ? h2d[r.size].host_to_device_gbps : 0);
        if (ceiling <= 0) continue;
        std::printf(
            "  %s %s: direct %.2f GB/s = %.2f x %s cudaMemcpy (%.2f GB/s); %.2f device "
            "copies per transfer\n",
            r.protocol.c_str(), SizeName(r.size).c_str(), r.bw_gbps, r.bw_gbps / ceiling, kind,
            ceiling, r.device_copies_per_transfer);
        continue;
      }
      double slowest = 1e30;
      std::string which;
      auto consider = [&](double gbps, const char* name) {
        if (gbps > 0 && gbps < slowest) {
          slowest = gbps;
          which = name;
        }
      };
      if (d2h.count(r.size)) consider(d2h[r.size].device_to_host_gbps, "D2H");
      if (h2d.count(r.size)) consider(h2d[r.size].host_to_device_gbps, "H2D");
      const FabricRow* f = FindFabricRow(fabric_rows, r.size);
      if (f != nullptr && IsVerbsProtocol(r.protocol)) consider(f->bw_gbps, "fabric write");
      if (which.empty()) continue;
      std::printf("  %s %s: %.2f GB/s = %.2f x %s (%.2f GB/s); %.2f copies per transfer\n",
                  r.protocol.c_str(), SizeName(r.size).c_str(), r.bw_gbps, r.bw_gbps / slowest,
                  which.c_str(), slowest, r.copies_per_transfer);
    }
  }

  // The goals of the comparison, as ratios of this run.
  std::printf("\nsummary\n");
  const size_t kBig = size_t{64} << 20, kSmall = 4;
  if (const P2PRow* v = FindRow(rows, "grpc+verbs", kBig)) {
    if (const FabricRow* f = FindFabricRow(fabric_rows, kBig)) {
      std::printf(
          "  64MiB: grpc+verbs %.2f GB/s = %.2f x the raw fabric write (%.2f GB/s); goal >= 0.85\n",
          v->bw_gbps, v->bw_gbps / f->bw_gbps, f->bw_gbps);
    }
    if (const P2PRow* g = FindRow(rows, "grpc", kBig)) {
      std::printf("  64MiB: grpc+verbs = %.2f x grpc (%.2f GB/s); goal >= 3\n",
                  v->bw_gbps / g->bw_gbps, g->bw_gbps);
    }
  }
  if (const P2PRow* v = FindRow(rows, "grpc+verbs", kSmall)) {
    if (const FabricRow* f = FindFabricRow(fabric_rows, kSmall)) {
      const double rtt = 2 * f->p50_us;
      std::printf(
          "  4B: grpc+verbs recv latency p50 %.2f us = %.2f x the raw fabric round trip "
          "(%.2f us); goal <= 3\n",
          v->p50_us, v->p50_us / rtt, rtt);
    }
  }

  if (!o.json.empty()) {
    nlohmann::json out = nlohmann::json::array();
    for (const P2PRow& r : rows) {
      nlohmann::json j = {{"protocol", r.protocol},
                          {"fabric", r.fabric},
                          {"size_bytes", r.size},
                          {"bandwidth_gbps", r.bw_gbps},
                          {"p50_us", r.p50_us},
                          {"p99_us", r.p99_us},
                          {"copies_per_transfer", r.copies_per_transfer},
                          {"cpu_s_per_gb", r.cpu_s_per_gb},
                          {"lat_iters", r.lat_iters},
                          {"bw_iters", r.bw_iters},
                          {"window", r.window},
                          {"repeat", r.repeat},
                          {"p50_us_min", r.p50.min},
                          {"p50_us_max", r.p50.max},
                          {"bandwidth_gbps_min", r.bw.min},
                          {"bandwidth_gbps_max", r.bw.max},
                          {"memcpy_gbps", memcpy_gbps[r.size]},
                          {"src_device", devices->src.ToString()},
                          {"dst_device", devices->dst.ToString()},
                          {"ratio_to_memcpy", r.bw_gbps / std::max(memcpy_gbps[r.size], 1e-9)}};
      if (d2h.count(r.size)) j["cuda_d2h_gbps"] = d2h[r.size].device_to_host_gbps;
      if (h2d.count(r.size) && h2d[r.size].device_to_device_gbps > 0) {
        j["cuda_d2d_gbps"] = h2d[r.size].device_to_device_gbps;
      }
      if (!r.path.empty()) {
        j["path"] = r.path;
        j["device_copies_per_transfer"] = r.device_copies_per_transfer;
      }
      if (h2d.count(r.size)) j["cuda_h2d_gbps"] = h2d[r.size].host_to_device_gbps;
      if (const FabricRow* f = FindFabricRow(fabric_rows, r.size)) {
        j["fabric_write_gbps"] = f->bw_gbps;
        j["ratio_to_fabric_write"] = r.bw_gbps / f->bw_gbps;
        j["fabric_round_trip_us"] = 2 * f->p50_us;
      }
      out.push_back(j);
    }
    for (const FabricRow& f : fabric_rows) {
      out.push_back({{"protocol", "fabric-write"},
                     {"fabric", fabric_name},
                     {"size_bytes", f.size},
                     {"bandwidth_gbps", f.bw_gbps},
                     {"p50_us", f.p50_us},
                     {"p99_us", f.p99_us},
                     {"round_trip_us", 2 * f.p50_us}});
    }
    for (const auto& [size, gbps] : memcpy_gbps) {
      out.push_back({{"protocol", "memcpy"}, {"size_bytes", size}, {"bandwidth_gbps", gbps}});
    }
    if (!WriteJsonRows(o.json, out, "tensorverbs bench p2p")) return 1;
  }
  if (!o.plot.empty()) {
    PlotPanel bw{"bandwidth", "tensor size", "GB/s", true, true, {}, {}};
    PlotPanel lat{
        "recv latency p50 (raw fabric: one-way)", "tensor size", "us", true, true, {}, {}};
    // One series per protocol and one for the raw fabric, in both panels.
    auto add = [&bw, &lat](const std::string& title, double size, double gbps, double us) {
      if (bw.series.empty() || bw.series.back().title != title) {
        bw.series.push_back({title, {}, {}});
        lat.series.push_back({title, {}, {}});
      }
      bw.series.back().x.push_back(size);
      bw.series.back().y.push_back(gbps);
      lat.series.back().x.push_back(size);
      lat.series.back().y.push_back(us);
    };
    for (const std::string& p : *protocols) {
      for (const P2PRow& r : rows) {
        if (r.protocol == p) add(p, r.size, r.bw_gbps, r.p50_us);
      }
    }
    for (const FabricRow& f : fabric_rows) add("raw fabric write", f.size, f.bw_gbps, f.p50_us);
    for (size_t size : *sizes) {
      bw.x_ticks.emplace_back(static_cast<double>(size), SizeName(size));
      lat.x_ticks.emplace_back(static_cast<double>(size), SizeName(size));
    }
    PlotSeries m{"memcpy", {}, {}};
    for (const auto& [size, gbps] : memcpy_gbps) {
      m.x.push_back(size);
      m.y.push_back(gbps);
    }
    bw.series.push_back(m);
    absl::Status s =
        WritePngPlot(o.plot,
                     absl::StrCat("tensorverbs bench p2p", netns ? " (netns)" : "", ", fabric ",
                                  fabric_name.empty() ? "-" : fabric_name),
                     {bw, lat});
    if (!s.ok()) {
      std::fprintf(stderr, "tensorverbs bench p2p: --plot: %s\n", std::string(s.message()).c_str());
      return 1;
    }
    std::printf("plot: %s\n", o.plot.c_str());
  }
  return 0;
}

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
  // The ceiling: the raw fabric's windowed small writes with immediate, in the same run.
  std::vector<FabricRow> fabric_rows;
  std::string fabric_name;
  if (o.baselines) {
    MeasureCeiling(*sizes, std::min(o.window, 64), netns.get(), &fabric_rows, &fabric_name);
    std::printf("\n");
  }
  std::vector<RateRow> rows;
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
  for (const std::string& protocol : *protocols) {
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
      absl::StatusOr<std::unique_ptr<PairBench>> bench = PairBench::Start(server, netns.get());
      if (!bench.ok()) {
        std::fprintf(stderr, "tensorverbs bench rate: %s: %s\n", protocol.c_str(),
                     bench.status().ToString().c_str());
        return 1;
      }
      for (size_t size : *sizes) {
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
          std::fprintf(stderr, "tensorverbs bench rate: %s, %d slots, batch %d, %s: %s\n",
                       protocol.c_str(), n, batch, SizeName(size).c_str(),
                       run.status().ToString().c_str());
          return 1;
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
        rows.push_back(row);
      }
    }
  }
  // Tensors per second against the raw fabric's writes per second: a tensor takes at least one
  // content write, so this is the protocol's per-tensor overhead on top of the fabric's.
  if (!fabric_rows.empty()) {
    std::printf("\nrate relative to the raw fabric's small writes (%s, window %d)\n",
                fabric_name.c_str(), std::min(o.window, 64));
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
  if (!o.json.empty()) {
    nlohmann::json out = nlohmann::json::array();
    for (const RateRow& r : rows) {
      out.push_back({{"protocol", r.protocol},
                     {"fabric", r.fabric},
                     {"message_slots", r.slots},
                     {"message_batch", r.batch},
                     {"netns", netns != nullptr},
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
    if (!WriteJsonRows(o.json, out, "tensorverbs bench rate")) return 1;
  }
  return 0;
}

}  // namespace tensorverbs::tools
