#include <cstdio>

#include "absl/strings/str_format.h"
#include "src/common/config.h"
#include "src/server/server.h"
#include "tools/commands.h"
#include "src/support/process_util.h"

namespace tensorverbs::tools {

int RunServerCommand(const ServerCommandOptions& options) {
  absl::StatusOr<ClusterSpec> cluster = ClusterSpec::Parse(options.cluster);
  if (!cluster.ok()) {
    std::fprintf(stderr, "tensorverbs server: %s\n", std::string(cluster.status().message()).c_str());
    return 2;
  }
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
  (*server)->Stop();
  return 0;
}

}  // namespace tensorverbs::tools
