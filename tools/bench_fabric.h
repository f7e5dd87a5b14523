// The raw-fabric measurement behind `tensorverbs bench fabric`, reusable by the protocol
// benchmarks as their ceiling: write-with-immediate bandwidth (ib_write_bw style, a window of
// writes in flight) and ping-pong latency (ib_write_lat style) between this process and a
// `bench-fabric-peer` child, both busy-polling one endpoint and one registered buffer.
//
// Runs on the calling (main) thread; starts and reaps the peer process.
#ifndef TENSORVERBS_TOOLS_BENCH_FABRIC_H_
#define TENSORVERBS_TOOLS_BENCH_FABRIC_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tensorverbs::tools {

struct FabricRow {
  std::string provider;
  size_t size = 0;
  int lat_iters = 0, bw_iters = 0;
  double bw_gbps = 0;             // windowed write-with-imm, GB/s (10^9)
  double p50_us = 0, p99_us = 0;  // one-way (half the round trip)
  double pingpong_mbps = 0;       // both directions / time, as fi_pingpong counts
  double pingpong_us = 0;         // mean one-way, as fi_pingpong's usec/xfer
  double fi_us = -1, fi_mbps = -1;
  double memcpy_gbps = 0;  // one core's memcpy of the size, same run (0: not measured)
};

struct FabricBenchSpec {
  std::string backend = "ofi";
  std::string provider;  // empty: the backend's default
  std::vector<size_t> sizes;
  int iters = 0;        // 0: chosen per size
  int window = 16;      // writes in flight for bandwidth
  bool compare = true;  // also run fi_pingpong (not across network namespaces)
  // Command prefix the peer runs under, e.g. {"/usr/sbin/ip", "netns", "exec", "tv-b"}.
  std::vector<std::string> peer_prefix;
  // The addresses each side's endpoint binds to (fabric::DomainOptions::source_address): on one
  // host the loopback interface, so that no other job's interface carries the measurement;
  // across a veth pair (peer_prefix), its two ends.
  std::string source = "127.0.0.1";
  std::string peer_source = "127.0.0.1";
  bool print = true;  // a table row per size on stdout
};

// Unavailable when the backend or provider cannot open here.
absl::StatusOr<std::vector<FabricRow>> MeasureFabric(const FabricBenchSpec& spec);

}  // namespace tensorverbs::tools

#endif  // TENSORVERBS_TOOLS_BENCH_FABRIC_H_
