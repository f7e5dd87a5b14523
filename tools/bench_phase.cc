#include "tools/bench_phase.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "src/common/config.h"
#include "src/common/status_macros.h"
#include "src/fabric/fabric.h"

namespace tensorverbs::tools {
namespace {

// The fabric the verbs protocols will use here, by the same policy as the servers.
absl::StatusOr<fabric::Capabilities> ProbeFabric(bool all_local) {
  ASSIGN_OR_RETURN(std::unique_ptr<fabric::Domain> d,
                   fabric::OpenFabric(fabric::FabricChoice::FromConfig(Config::Get(), all_local)));
  return d->capabilities();
}

}  // namespace

bool MakeNetnsHost(const char* command, std::unique_ptr<NetnsHost>* out,
                   const std::string& link_rate, int rails) {
  NetnsHost::Options options;
  options.rate = link_rate;
  options.rails = rails;
  absl::StatusOr<std::unique_ptr<NetnsHost>> host = NetnsHost::Create(0, options);
  if (!host.ok()) {
    std::fprintf(stderr, "tensorverbs bench %s --netns: %s\n", command,
                 std::string(host.status().message()).c_str());
    return false;
  }
  *out = *std::move(host);
  return true;
}

bool IsVerbsProtocol(const std::string& p) { return p != "grpc"; }

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
  if (netns) {
    spec.peer_prefix = netns->ExecPrefix();
    spec.source = netns->local_address();
    spec.peer_source = netns->remote_address();
  }
  *name = absl::StrCat(caps->backend, " (", caps->provider, ")");
  absl::StatusOr<std::vector<FabricRow>> got = MeasureFabric(spec);
  if (!got.ok()) {
    std::printf("raw fabric: failed: %s\n", got.status().ToString().c_str());
    return;
  }
  *rows = *std::move(got);
}

const FabricRow* FindFabricRow(const std::vector<FabricRow>& rows, size_t size) {
  for (const FabricRow& r : rows) {
    if (r.size == size) return &r;
  }
  return nullptr;
}

absl::StatusOr<PhaseResult> RunPhase(PairBench& bench, const std::string& prefix,
                                     const std::vector<ParsedKey>& keys, size_t size, uint32_t seed,
                                     int64_t count, int window, bool usage, int64_t* next_step,
                                     Allocator* allocator) {
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

}  // namespace tensorverbs::tools
