#include "src/fabric/endpoint_base.h"

#include "absl/strings/str_cat.h"

namespace tensorverbs::fabric {

absl::Status EndpointBase::CheckRanges(absl::string_view backend, const LocalBuffer& local,
                                       const RemoteBuffer& remote, uint64_t region_base,
                                       uint64_t region_length) {
  if (local.length > 0 &&
      (local.region == nullptr || !local.region->Contains(local.addr, local.length))) {
    return absl::InvalidArgumentError(
        absl::StrCat(backend, ": local buffer is not inside its registered region"));
  }
  if (remote.length < local.length) {
    return absl::InvalidArgumentError(absl::StrCat(
        backend, ": ", local.length, " bytes do not fit the remote buffer of ", remote.length));
  }
  if (!RangeInside(remote.addr, local.length, region_base, region_length)) {
    return absl::OutOfRangeError(absl::StrCat(backend, ": remote range [", remote.addr, ", +",
                                              local.length, ") is outside the registered region [",
                                              region_base, ", +", region_length, ")"));
  }
  return absl::OkStatus();
}

}  // namespace tensorverbs::fabric
