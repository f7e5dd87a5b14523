#include "src/fabric/fabric.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/common/config.h"
#include "src/fabric/ibverbs/ibverbs.h"
#include "src/fabric/loopback/loopback.h"
#include "src/fabric/ofi/ofi.h"

namespace tensorverbs::fabric {

std::vector<std::string> BackendNames() {
#if defined(TENSORVERBS_HAVE_IBVERBS)
  return {"loopback", "ofi", "ibverbs"};
#else
  return {"loopback", "ofi"};
#endif
}

absl::StatusOr<std::unique_ptr<Domain>> OpenDomain(absl::string_view backend,
                                                   const DomainOptions& options) {
  if (options.queue_depth == 0) return absl::InvalidArgumentError("fabric: queue depth must be > 0");
  if (backend == "loopback") return loopback::OpenLoopbackDomain(options);
  if (backend == "ofi") return ofi::OpenOfiDomain(options);
#if defined(TENSORVERBS_HAVE_IBVERBS)
  if (backend == "ibverbs") return ibverbs::OpenIbverbsDomain(options, Config::Get().rdma);
#endif
  return absl::InvalidArgumentError(absl::StrCat("fabric: unknown backend '", backend,
                                                 "'; available: ", absl::StrJoin(BackendNames(), ", ")));
}

absl::StatusOr<std::unique_ptr<Domain>> OpenFabric(absl::string_view fabric,
                                                   const std::string& ofi_provider,
                                                   bool all_peers_local) {
  DomainOptions options;
  if (fabric == "loopback" || fabric == "ibverbs") {
    absl::StatusOr<std::unique_ptr<Domain>> d = OpenDomain(fabric, options);
    if (!d.ok()) {
      return absl::Status(d.status().code(), absl::StrCat("TENSORVERBS_FABRIC=", fabric,
                                                          " cannot be opened: ",
                                                          d.status().message()));
    }
    return d;
  }
  if (fabric != "auto" && fabric != "ofi") {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown fabric '", fabric, "'; expected auto, ofi, ibverbs or loopback"));
  }
  std::string ibverbs_reason;
#if defined(TENSORVERBS_HAVE_IBVERBS)
  if (fabric == "auto") {
    absl::StatusOr<std::unique_ptr<Domain>> d = OpenDomain("ibverbs", options);
    if (d.ok()) return d;
    ibverbs_reason = std::string(d.status().message());
  }
#endif
  options.provider =
      ofi::ChooseProvider(ofi_provider, all_peers_local, ofi::ListUsableProviders());
  absl::StatusOr<std::unique_ptr<Domain>> d = OpenDomain("ofi", options);
  if (!d.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "no usable fabric: ofi provider '", options.provider, "': ", d.status().message(),
        ibverbs_reason.empty() ? "" : absl::StrCat("; ibverbs: ", ibverbs_reason),
        ". Set TENSORVERBS_FABRIC / TENSORVERBS_OFI_PROVIDER"));
  }
  return d;
}

}  // namespace tensorverbs::fabric
