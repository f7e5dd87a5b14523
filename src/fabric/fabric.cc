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

}  // namespace tensorverbs::fabric
