// `tensorverbs info`: what this host offers each fabric backend, and the configuration in effect.
#include <sys/resource.h>

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/common/config.h"
#include "src/fabric/fabric.h"
#include "src/fabric/ofi/ofi.h"
#include "src/server/server.h"
#include "tools/commands.h"

namespace tensorverbs::tools {
namespace {

std::string Bytes(rlim_t v) {
  if (v == RLIM_INFINITY) return "unlimited";
  return absl::StrCat(v / 1024, " KiB");
}

}  // namespace

int RunInfoCommand() {
  std::printf("tensorverbs info\n\nprotocols: %s\n\nfabric backends:\n",
              absl::StrJoin(AvailableProtocols(), ", ").c_str());
  for (const std::string& backend : fabric::BackendNames()) {
    fabric::DomainOptions options;
    absl::StatusOr<std::unique_ptr<fabric::Domain>> d = fabric::OpenDomain(backend, options);
    if (d.ok()) {
      const fabric::Capabilities& c = (*d)->capabilities();
      std::printf("  %-9s usable: default provider %s, %s addressing, queue depth %zu\n",
                  backend.c_str(), c.provider.c_str(), c.virtual_addressing ? "virtual" : "offset",
                  c.queue_depth);
    } else {
      std::printf("  %-9s not usable: %s\n", backend.c_str(), std::string(d.status().message()).c_str());
    }
  }
  std::printf("  %-9s not in this build yet (rdma-core backend to come)\n", "ibverbs");

  std::printf("\nlibfabric providers with RDM endpoints, RMA and remote CQ data:\n");
  std::vector<std::string> providers = fabric::ofi::ListUsableProviders();
  if (providers.empty()) std::printf("  none\n");
  for (const std::string& p : providers) std::printf("  %s\n", p.c_str());

  rlimit memlock{};
  getrlimit(RLIMIT_MEMLOCK, &memlock);
  std::printf("\nmemlock limit: soft %s, hard %s%s\n", Bytes(memlock.rlim_cur).c_str(),
              Bytes(memlock.rlim_max).c_str(),
              memlock.rlim_cur != RLIM_INFINITY && memlock.rlim_cur < (rlim_t{1} << 30)
                  ? " (RDMA NICs pin registered memory; raise it with ulimit -l for large pools)"
                  : "");

  const Config& config = Config::Get();
  std::printf("\nconfiguration (from the environment):\n");
  std::printf("  TENSORVERBS_RECV_TIMEOUT_MS     %lld\n",
              static_cast<long long>(absl::ToInt64Milliseconds(config.recv_timeout)));
  std::printf("  TENSORVERBS_CONNECT_TIMEOUT_MS  %lld\n",
              static_cast<long long>(absl::ToInt64Milliseconds(config.connect_timeout)));
  std::printf("  TENSORVERBS_POOL_REGION_MB      %lld\n",
              static_cast<long long>(config.pool_region_bytes >> 20));
  std::printf("  TENSORVERBS_CALLBACK_THREADS    %d\n", config.callback_threads);
  std::printf("  TENSORVERBS_MALLOC_TUNING       %d\n", config.malloc_tuning ? 1 : 0);
  std::printf("  TENSORVERBS_OFI_PROVIDER        %s\n",
              config.ofi_provider.empty() ? "(auto)" : config.ofi_provider.c_str());
  for (const std::string& w : config.warnings) std::printf("  warning: %s\n", w.c_str());
  return 0;
}

}  // namespace tensorverbs::tools
