// `tensorverbs bench p2p`: one receiver and one sender process (PairBench), each protocol in
// turn, in one run, with the raw fabric, memcpy and (for device tensors) cudaMemcpy as ceilings.
//
// Per size, latency is a chain of single recvs (each started from the previous one's callback),
// bandwidth a stream with a window of recvs outstanding; every recv is its own step with the
// same key, as a training loop's are, and the sender has produced the tensor before it is asked
// for (a passive Send), so what is timed is the transport. CPU time of both processes and the
// copies the transports made are sampled around the bandwidth stream. Each measurement is
// repeated (--repeat) after a warm-up and reported as its median and range: on a small shared
// machine one run's figure can be off by half.
//
// The measurements (MeasureCeilings, RunProtocol) and the reports (ratios, the GPU stages, the
// goals, JSON, plot) are separate functions; all run on the tool's main thread.
#include <algorithm>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "src/common/status_macros.h"
#include "tools/bench_cluster.h"
#include "tools/bench_device.h"
#include "tools/bench_fabric.h"
#include "tools/bench_phase.h"
#include "tools/bench_util.h"
#include "tools/commands.h"
#include "tools/netns.h"

namespace tensorverbs::tools {
namespace {

// The pairs of --mixed.
constexpr char kSameHostAlone[] = "same host, alone";
constexpr char kOtherHostAlone[] = "other host, alone";
constexpr char kSameHostMixed[] = "same host, mixed";
constexpr char kOtherHostMixed[] = "other host, mixed";

struct P2PRow {
  std::string protocol;
  std::string fabric;
  std::string pair;  // with --mixed, one of the four above
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

bool CrossesHosts(const P2PRow& r) {
  return r.pair == kOtherHostAlone || r.pair == kOtherHostMixed;
}

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

// What each protocol is held against, all measured in this run.
struct Ceilings {
  std::map<size_t, double> memcpy_gbps;
  // cudaMemcpy between pinned host memory and the GPUs (the proxy path's copy stages): the
  // source GPU's D2H, the destination GPU's H2D and D2D.
  std::map<size_t, CopyBandwidth> d2h, h2d;
  std::vector<FabricRow> fabric_rows;  // the raw fabric write (empty with --no-baselines)
  std::string fabric_name;
  // With --mixed: fabric_rows is the same-host fabric's, and these the network fabric's
  // between the two hosts.
  std::vector<FabricRow> network_rows;
  std::string network_name;
};

absl::Status MeasureCeilings(const BenchP2POptions& o, const DevicePair& devices,
                             const std::vector<size_t>& sizes, bool on_gpu, const NetnsHost* netns,
                             Ceilings& c) {
  std::printf("\nmemcpy between pre-faulted buffers (one copy, one core)\n%10s %10s\n", "#bytes",
              "GB/s");
  for (size_t size : sizes) {
    c.memcpy_gbps[size] = MeasureMemcpyGbps(size);
    std::printf("%10s %10.3f\n", SizeName(size).c_str(), c.memcpy_gbps.at(size));
  }
  // The proxy path's copy stages: cudaMemcpy between pinned host memory and the GPUs.
  if (on_gpu) {
    std::printf(
        "\ncudaMemcpy between pinned host memory and the GPU, and within the GPU (best of 5)\n"
        "%10s %14s %14s %14s\n",
        "#bytes", "D2H GB/s", "H2D GB/s", "D2D GB/s");
    for (size_t size : sizes) {
      const int src = devices.src.host_accessible() ? -1 : devices.src.device;
      const int dst = devices.dst.host_accessible() ? -1 : devices.dst.device;
      for (int dev : {src, dst}) {
        if (dev < 0) continue;
        absl::StatusOr<CopyBandwidth> bw = MeasureDeviceCopies(dev, size);
        if (!bw.ok()) {
          return bw.status();
        }
        if (dev == src) c.d2h[size] = *bw;
        if (dev == dst) c.h2d[size] = *bw;
      }
      std::printf(
          "%10s %14s %14s %14s\n", SizeName(size).c_str(),
          c.d2h.count(size) ? absl::StrFormat("%.2f", c.d2h.at(size).device_to_host_gbps).c_str()
                            : "-",
          c.h2d.count(size) ? absl::StrFormat("%.2f", c.h2d.at(size).host_to_device_gbps).c_str()
                            : "-",
          c.h2d.count(size) ? absl::StrFormat("%.2f", c.h2d.at(size).device_to_device_gbps).c_str()
                            : "-");
    }
  }
  if (o.baselines) {
    MeasureCeiling(sizes, /*window=*/16, o.mixed ? nullptr : netns, &c.fabric_rows, &c.fabric_name);
    if (o.mixed) MeasureCeiling(sizes, /*window=*/16, netns, &c.network_rows, &c.network_name);
  }

  return absl::OkStatus();
}

BenchServerOptions ServerFor(const std::string& protocol, const BenchP2POptions& o,
                             const DevicePair& devices) {
  BenchServerOptions server;
  server.protocol = protocol;
  server.poll_mode = o.poll_mode;
  server.callback_threads = o.callback_threads;
  server.send_device = devices.src.host_accessible() ? "cpu" : devices.src.ToString();
  return server;
}

// Each size between `bench`'s receiver and its current sender, appended to `rows`.
absl::Status MeasureSizes(PairBench& bench, const std::string& protocol, const std::string& pair,
                          const BenchP2POptions& o, const DevicePair& devices,
                          const std::vector<size_t>& sizes, int64_t* next_step,
                          std::vector<P2PRow>* rows);

absl::Status RunProtocol(const std::string& protocol, const BenchP2POptions& o,
                         const DevicePair& devices, const std::vector<size_t>& sizes,
                         const NetnsHost* netns, int64_t* next_step, std::vector<P2PRow>* rows) {
  ASSIGN_OR_RETURN(std::unique_ptr<PairBench> bench,
                   PairBench::Start(ServerFor(protocol, o, devices), netns));
  std::printf("\n%s over %s, 2 processes%s, %s -> %s\n", protocol.c_str(), bench->fabric().c_str(),
              netns ? " in two network namespaces (veth)" : "",
              devices.src.host_accessible() ? "cpu" : devices.src.ToString().c_str(),
              devices.dst.host_accessible() ? "cpu" : devices.dst.ToString().c_str());
  return MeasureSizes(*bench, protocol, "", o, devices, sizes, next_step, rows);
}

// --mixed: the pair alone on this host and alone across two hosts, then inside a cluster of two
// hosts whose every task opens both fabrics: its same-host pair and a pair across the hosts.
absl::Status RunMixed(const std::string& protocol, const BenchP2POptions& o,
                      const DevicePair& devices, const std::vector<size_t>& sizes,
                      const NetnsHost& netns, int64_t* next_step, std::vector<P2PRow>* rows) {
  const BenchServerOptions server = ServerFor(protocol, o, devices);
  for (const NetnsHost* host : {static_cast<const NetnsHost*>(nullptr), &netns}) {
    const char* pair = host == nullptr ? kSameHostAlone : kOtherHostAlone;
    ASSIGN_OR_RETURN(std::unique_ptr<PairBench> alone, PairBench::Start(server, host));
    std::printf("\n%s, %s: 2 processes%s, task 1 -> task 0 over %s\n", protocol.c_str(), pair,
                host == nullptr ? "" : " in two network namespaces", alone->fabric().c_str());
    RETURN_IF_ERROR(MeasureSizes(*alone, protocol, pair, o, devices, sizes, next_step, rows));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<PairBench> mixed, PairBench::StartMixed(server, netns));
  const char* pairs[] = {kSameHostMixed, kOtherHostMixed};
  for (int peer = 0; peer < 2; ++peer) {
    mixed->UseSender(peer);
    std::printf(
        "\n%s, %s: 3 processes on 2 hosts (tasks 0 and 1 here, task 2 in a network "
        "namespace), task %d -> task 0 over %s\n",
        protocol.c_str(), pairs[peer], peer + 1, mixed->fabric().c_str());
    RETURN_IF_ERROR(
        MeasureSizes(*mixed, protocol, pairs[peer], o, devices, sizes, next_step, rows));
  }
  return absl::OkStatus();
}

absl::Status MeasureSizes(PairBench& bench, const std::string& protocol, const std::string& pair,
                          const BenchP2POptions& o, const DevicePair& devices,
                          const std::vector<size_t>& sizes, int64_t* next_step,
                          std::vector<P2PRow>* rows) {
  const bool on_gpu = !devices.src.host_accessible() || !devices.dst.host_accessible();
  // Device recvs land in the receiver's GPU pool; host ones in its registered pool (null).
  Allocator* dst = nullptr;
  if (!devices.dst.host_accessible()) {
    ASSIGN_OR_RETURN(dst, AllocatorFor(devices.dst, bench.server()));
  }
  const std::string fabric = bench.fabric();
  std::printf("%10s %9s %22s %10s %9s %7s %24s %12s %10s%s\n", "#bytes", "lat iters", "p50[us]",
              "p99[us]", "bw iters", "window", "BW[GB/s]", "copies/xfer", "CPU s/GB",
              on_gpu ? "  path (device copies/xfer)" : "");
  const std::vector<ParsedKey> keys = bench.Keys("p2p", 1);
  for (size_t size : sizes) {
    P2PRow row;
    row.protocol = protocol;
    row.fabric = fabric;
    row.pair = pair;
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
        RunPhase(bench, "p2p", keys, size, seed, row.bw_iters, row.window, false, next_step, dst)
            .status());
    std::vector<double> p50s, p99s, bws, copies, cpu, device_copies, direct;
    for (int rep = 0; rep < o.repeat; ++rep) {
      ASSIGN_OR_RETURN(PhaseResult lat, RunPhase(bench, "p2p", keys, size, seed, row.lat_iters, 1,
                                                 false, next_step, dst));
      p50s.push_back(Percentile(lat.latency_us, 0.5));
      p99s.push_back(Percentile(lat.latency_us, 0.99));
      ASSIGN_OR_RETURN(PhaseResult bw, RunPhase(bench, "p2p", keys, size, seed, row.bw_iters,
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

const P2PRow* FindRow(const std::vector<P2PRow>& rows, const std::string& protocol, size_t size,
                      const std::string& pair = "") {
  for (const P2PRow& r : rows) {
    if (r.protocol == protocol && r.size == size && r.pair == pair) return &r;
  }
  return nullptr;
}

// --mixed: each pair of the mixed cluster against its own ceiling, in this run: the same-host
// pair against the same pair alone on its host, the cross-host pair against the raw network
// write.
void PrintMixed(const std::vector<std::string>& protocols, const std::vector<size_t>& sizes,
                const std::vector<P2PRow>& rows, const Ceilings& c) {
  std::printf(
      "\nmixed cluster: same-host pair / the pair alone (goal >= 0.8), cross-host pair / raw "
      "%s write (goal >= 0.9), and the cross-host pair alone / the raw write\n%10s",
      c.network_name.empty() ? "network" : c.network_name.c_str(), "#bytes");
  for (const std::string& p : protocols) std::printf(" %44s", p.c_str());
  std::printf("\n");
  for (size_t size : sizes) {
    std::printf("%10s", SizeName(size).c_str());
    const FabricRow* net = FindFabricRow(c.network_rows, size);
    for (const std::string& p : protocols) {
      // A pair's bandwidth over a ceiling's, or "-" where either was not measured.
      auto ratio = [&](const char* pair, double ceiling) -> std::string {
        const P2PRow* r = FindRow(rows, p, size, pair);
        if (r == nullptr || ceiling <= 0) return "-";
        return absl::StrFormat("%.2fx", r->bw_gbps / ceiling);
      };
      const P2PRow* alone = FindRow(rows, p, size, kSameHostAlone);
      const double net_gbps = net != nullptr ? net->bw_gbps : 0;
      std::printf(" %44s", absl::StrCat("same ", ratio(kSameHostMixed, alone ? alone->bw_gbps : 0),
                                        ", cross ", ratio(kOtherHostMixed, net_gbps), " (alone ",
                                        ratio(kOtherHostAlone, net_gbps), ")")
                               .c_str());
    }
    std::printf("\n");
  }
}

// Bandwidth relative to the ceilings, per protocol and size.
void PrintRatios(const std::vector<std::string>& protocols, const std::vector<size_t>& sizes,
                 const std::vector<P2PRow>& rows, const Ceilings& c) {
  // Ratios to the ceilings, per protocol and size.
  std::printf("\nbandwidth relative to the raw fabric write (%s) and to memcpy\n%10s",
              c.fabric_name.empty() ? "not measured" : c.fabric_name.c_str(), "#bytes");
  for (const std::string& p : protocols) std::printf(" %22s", p.c_str());
  std::printf("\n");
  for (size_t size : sizes) {
    std::printf("%10s", SizeName(size).c_str());
    const FabricRow* f = FindFabricRow(c.fabric_rows, size);
    for (const std::string& p : protocols) {
      const P2PRow* r = FindRow(rows, p, size);
      std::string cell = "-";
      if (r != nullptr) {
        // Without the raw fabric's row (--no-baselines) there is no ratio to print, not 0.
        const std::string fab =
            f != nullptr ? absl::StrFormat("%.2fx fab", r->bw_gbps / f->bw_gbps) : "- fab";
        cell = absl::StrFormat("%s %.2fx mcpy", fab,
                               r->bw_gbps / std::max(c.memcpy_gbps.at(size), 1e-9));
      }
      std::printf(" %22s", cell.c_str());
    }
    std::printf("\n");
  }
}

// On GPUs: each protocol against its slowest stage (device-to-host, the fabric write for the
// verbs protocols, host-to-device), all measured in this run.
void PrintDeviceStages(const DevicePair& devices, const std::vector<P2PRow>& rows,
                       const Ceilings& c) {
  std::printf(
      "\nproxy path relative to its slowest stage (D2H, fabric write, H2D); direct path "
      "relative to the cudaMemcpy of its one copy\n");
  for (const P2PRow& r : rows) {
    if (r.path == "direct") {
      // The one copy the direct path makes, done by cudaMemcpy: device to device, or host to
      // device, or device to host where one end is host memory.
      const bool src_gpu = !devices.src.host_accessible(), dst_gpu = !devices.dst.host_accessible();
      const char* kind = src_gpu && dst_gpu ? "D2D" : src_gpu ? "D2H" : "H2D";
      const double ceiling =
          src_gpu && dst_gpu ? (c.h2d.count(r.size) ? c.h2d.at(r.size).device_to_device_gbps : 0)
          : src_gpu          ? (c.d2h.count(r.size) ? c.d2h.at(r.size).device_to_host_gbps : 0)
                             : (c.h2d.count(r.size) ? c.h2d.at(r.size).host_to_device_gbps : 0);
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
    if (c.d2h.count(r.size)) consider(c.d2h.at(r.size).device_to_host_gbps, "D2H");
    if (c.h2d.count(r.size)) consider(c.h2d.at(r.size).host_to_device_gbps, "H2D");
    const FabricRow* f = FindFabricRow(c.fabric_rows, r.size);
    if (f != nullptr && IsVerbsProtocol(r.protocol)) consider(f->bw_gbps, "fabric write");
    if (which.empty()) continue;
    std::printf("  %s %s: %.2f GB/s = %.2f x %s (%.2f GB/s); %.2f copies per transfer\n",
                r.protocol.c_str(), SizeName(r.size).c_str(), r.bw_gbps, r.bw_gbps / slowest,
                which.c_str(), slowest, r.copies_per_transfer);
  }
}

// The goals of the comparison, as ratios of this run.
void PrintGoals(const std::vector<P2PRow>& rows, const Ceilings& c) {
  std::printf("\nsummary\n");
  const size_t kBig = size_t{64} << 20, kSmall = 4;
  if (const P2PRow* v = FindRow(rows, "grpc+verbs", kBig)) {
    if (const FabricRow* f = FindFabricRow(c.fabric_rows, kBig)) {
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
    if (const FabricRow* f = FindFabricRow(c.fabric_rows, kSmall)) {
      const double rtt = 2 * f->p50_us;
      std::printf(
          "  4B: grpc+verbs recv latency p50 %.2f us = %.2f x the raw fabric round trip "
          "(%.2f us); goal <= 3\n",
          v->p50_us, v->p50_us / rtt, rtt);
    }
  }
}

nlohmann::json P2PJson(const DevicePair& devices, const std::vector<P2PRow>& rows,
                       const Ceilings& c) {
  nlohmann::json out = nlohmann::json::array();
  for (const P2PRow& r : rows) {
    nlohmann::json j = {{"protocol", r.protocol},
                        {"fabric", r.fabric},
                        {"pair", r.pair},
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
                        {"c.memcpy_gbps", c.memcpy_gbps.at(r.size)},
                        {"src_device", devices.src.ToString()},
                        {"dst_device", devices.dst.ToString()},
                        {"ratio_to_memcpy", r.bw_gbps / std::max(c.memcpy_gbps.at(r.size), 1e-9)}};
    if (c.d2h.count(r.size)) j["cuda_d2h_gbps"] = c.d2h.at(r.size).device_to_host_gbps;
    if (c.h2d.count(r.size) && c.h2d.at(r.size).device_to_device_gbps > 0) {
      j["cuda_d2d_gbps"] = c.h2d.at(r.size).device_to_device_gbps;
    }
    if (!r.path.empty()) {
      j["path"] = r.path;
      j["device_copies_per_transfer"] = r.device_copies_per_transfer;
    }
    if (c.h2d.count(r.size)) j["cuda_h2d_gbps"] = c.h2d.at(r.size).host_to_device_gbps;
    // A cross-host pair of --mixed is held against the network fabric; the rest against the
    // fabric they run over.
    if (const FabricRow* f =
            FindFabricRow(CrossesHosts(r) ? c.network_rows : c.fabric_rows, r.size)) {
      j["fabric_write_gbps"] = f->bw_gbps;
      j["ratio_to_fabric_write"] = r.bw_gbps / f->bw_gbps;
      j["fabric_round_trip_us"] = 2 * f->p50_us;
    }
    out.push_back(j);
  }
  for (const auto* set : {&c.fabric_rows, &c.network_rows}) {
    for (const FabricRow& f : *set) {
      out.push_back({{"protocol", "fabric-write"},
                     {"fabric", set == &c.fabric_rows ? c.fabric_name : c.network_name},
                     {"size_bytes", f.size},
                     {"bandwidth_gbps", f.bw_gbps},
                     {"p50_us", f.p50_us},
                     {"p99_us", f.p99_us},
                     {"round_trip_us", 2 * f.p50_us}});
    }
  }
  for (const auto& [size, gbps] : c.memcpy_gbps) {
    out.push_back({{"protocol", "memcpy"}, {"size_bytes", size}, {"bandwidth_gbps", gbps}});
  }
  return out;
}

bool WriteP2PPlot(const std::string& path, const std::vector<std::string>& protocols,
                  const std::vector<size_t>& sizes, const std::vector<P2PRow>& rows,
                  const Ceilings& c, bool netns) {
  PlotPanel bw{"bandwidth", "tensor size", "GB/s", true, true, {}, {}};
  PlotPanel lat{"recv latency p50 (raw fabric: one-way)", "tensor size", "us", true, true, {}, {}};
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
  for (const std::string& p : protocols) {
    for (const P2PRow& r : rows) {
      if (r.protocol == p) {
        add(r.pair.empty() ? p : absl::StrCat(p, " (", r.pair, ")"), r.size, r.bw_gbps, r.p50_us);
      }
    }
  }
  for (const FabricRow& f : c.fabric_rows) add("raw fabric write", f.size, f.bw_gbps, f.p50_us);
  for (const FabricRow& f : c.network_rows) {
    add("raw network fabric write", f.size, f.bw_gbps, f.p50_us);
  }
  for (size_t size : sizes) {
    bw.x_ticks.emplace_back(static_cast<double>(size), SizeName(size));
    lat.x_ticks.emplace_back(static_cast<double>(size), SizeName(size));
  }
  PlotSeries m{"memcpy", {}, {}};
  for (const auto& [size, gbps] : c.memcpy_gbps) {
    m.x.push_back(size);
    m.y.push_back(gbps);
  }
  bw.series.push_back(m);
  absl::Status s =
      WritePngPlot(path,
                   absl::StrCat("tensorverbs bench p2p", netns ? " (netns)" : "", ", fabric ",
                                c.fabric_name.empty() ? "-" : c.fabric_name),
                   {bw, lat});
  if (!s.ok()) {
    std::fprintf(stderr, "tensorverbs bench p2p: --plot: %s\n", std::string(s.message()).c_str());
    return false;
  }
  std::printf("plot: %s\n", path.c_str());
  return true;
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
  if (!o.link_rate.empty() && !o.netns) {
    std::fprintf(stderr,
                 "tensorverbs bench p2p: --link-rate limits the --netns link; add --netns\n");
    return 2;
  }
  if (o.rails > 1 && (!o.netns || o.mixed)) {
    std::fprintf(stderr,
                 "tensorverbs bench p2p: --rails joins the --netns hosts by several links; add "
                 "--netns (not with --mixed)\n");
    return 2;
  }
  std::unique_ptr<NetnsHost> netns;
  if ((o.netns || o.mixed) && !MakeNetnsHost("p2p", &netns, o.link_rate, o.rails)) return 1;
  if (!o.link_rate.empty()) {
    std::printf("the peer's link%s limited to %s each way (tc tbf)\n", o.rails > 1 ? "s" : "",
                o.link_rate.c_str());
  }
  if (o.rails > 1) std::printf("%d rails: a lane of every channel on each\n", o.rails);
  // Ceilings, measured in the same run: memcpy, and the raw fabric the verbs protocols use.
  std::printf(
      "tensorverbs bench p2p: sizes %s; protocols %s; per size a warm-up stream, then %d "
      "measured repetition%s%s\n",
      o.sizes.c_str(), absl::StrJoin(*protocols, ", ").c_str(), o.repeat, o.repeat == 1 ? "" : "s",
      o.repeat == 1 ? "" : " (median [min-max])");
  Ceilings c;
  if (absl::Status s = MeasureCeilings(o, *devices, *sizes, on_gpu, netns.get(), c); !s.ok()) {
    std::fprintf(stderr, "tensorverbs bench p2p: %s\n", s.ToString().c_str());
    return 1;
  }

  std::vector<P2PRow> rows;
  int64_t next_step = 1;
  for (const std::string& protocol : *protocols) {
    absl::Status s =
        o.mixed ? RunMixed(protocol, o, *devices, *sizes, *netns, &next_step, &rows)
                : RunProtocol(protocol, o, *devices, *sizes, netns.get(), &next_step, &rows);
    if (!s.ok()) {
      std::fprintf(stderr, "tensorverbs bench p2p: %s: %s\n", protocol.c_str(),
                   s.ToString().c_str());
      return 1;
    }
  }

  if (o.mixed) {
    PrintMixed(*protocols, *sizes, rows, c);
  } else {
    PrintRatios(*protocols, *sizes, rows, c);
    if (on_gpu) PrintDeviceStages(*devices, rows, c);
    PrintGoals(rows, c);
  }
  if (!o.json.empty() &&
      !WriteJsonRows(o.json, P2PJson(*devices, rows, c), "tensorverbs bench p2p")) {
    return 1;
  }
  if (!o.plot.empty() && !WriteP2PPlot(o.plot, *protocols, *sizes, rows, c, netns != nullptr)) {
    return 1;
  }
  return 0;
}

}  // namespace tensorverbs::tools
