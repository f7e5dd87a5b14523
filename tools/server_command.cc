#include <cstdio>

#include "absl/strings/str_format.h"
#include "src/common/config.h"
#include "src/server/server.h"
#include "src/support/process_util.h"
#include "tensorverbs/placement.h"
#include "tools/commands.h"
#include "tools/placement_flags.h"
#include "tools/stats.h"

namespace tensorverbs::tools {

int RunServerCommand(const ServerCommandOptions& given) {
  ServerCommandOptions options = given;
  absl::StatusOr<TaskPlacement> placement =
      PlacementFromFlags(options.cluster_from, options.cluster, options.job, options.task);
  if (!placement.ok()) {
    std::fprintf(stderr, "tensorverbs server: %s\n",
                 std::string(placement.status().message()).c_str());
    return 2;
  }
  const ClusterSpec* cluster = &placement->cluster;
  options.job = placement->job;
  options.task = placement->task;
  support::BlockTerminationSignals();
  ServerOptions server_options = ServerOptions::FromConfig(Config::Get());
  server_options.cluster = *cluster;
  server_options.job = options.job;
  server_options.task = options.task;
  server_options.protocol = options.protocol;
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Create(server_options);
  if (!server.ok()) {
    std::fprintf(stderr, "tensorverbs server: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::printf("tensorverbs server: task %s serving protocol %s on %s (incarnation %016llx)\n",
              (*server)->task_name().c_str(), (*server)->protocol().c_str(),
              cluster->TaskAddress(options.job, options.task)->c_str(),
              static_cast<unsigned long long>((*server)->incarnation()));
  std::fflush(stdout);
  std::unique_ptr<MetricsFileWriter> metrics;
  if (!options.metrics_file.empty()) {
    if (options.metrics_interval_ms <= 0) {
      std::fprintf(stderr, "tensorverbs server: --metrics-interval-ms must be positive\n");
      return 2;
    }
    Server* s = server->get();
    metrics = std::make_unique<MetricsFileWriter>(options.metrics_file,
                                                  absl::Milliseconds(options.metrics_interval_ms),
                                                  [s] { return s->CollectStats(); });
  }
  if (options.wait_for_peers) {
    absl::Status s = (*server)->WaitForPeers(Config::Get().connect_timeout);
    if (!s.ok()) {
      std::fprintf(stderr, "tensorverbs server: %s\n", s.ToString().c_str());
      return 1;
    }
    std::printf("tensorverbs server: all peers are up\n");
    std::fflush(stdout);
  }
  int sig = support::WaitForTerminationSignal();
  std::printf("tensorverbs server: signal %d, shutting down\n", sig);
  std::fflush(stdout);
  metrics.reset();  // its last write, while the server still answers
  (*server)->Stop();
  return 0;
}

int RunStatsCommand(const StatsCommandOptions& options) {
  absl::StatusOr<proto::GetStatsResponse> stats =
      FetchStats(options.address, options.as_task, absl::Milliseconds(options.timeout_ms));
  if (!stats.ok()) {
    std::fprintf(stderr, "tensorverbs stats: %s\n", stats.status().ToString().c_str());
    return 1;
  }
  const std::string out = options.json         ? FormatStatsJson(*stats)
                          : options.prometheus ? FormatPrometheus(*stats)
                                               : FormatStatsTable(*stats);
  std::fputs(out.c_str(), stdout);
  return 0;
}

}  // namespace tensorverbs::tools
