#include "src/common/process_limits.h"

#include <sys/resource.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace tensorverbs {

uint64_t DescriptorsFor(uint64_t peers) { return 24 * peers + 256; }

absl::Status RaiseDescriptorLimit(uint64_t needed) {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return absl::InternalError(absl::StrCat("getrlimit(RLIMIT_NOFILE): ", std::strerror(errno)));
  }
  if (limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur >= needed) return absl::OkStatus();
  const bool enough = limit.rlim_max == RLIM_INFINITY || limit.rlim_max >= needed;
  const rlim_t old = limit.rlim_cur;
  limit.rlim_cur = enough ? static_cast<rlim_t>(needed) : limit.rlim_max;
  if (limit.rlim_cur > old && setrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return absl::InternalError(
        absl::StrCat("setrlimit(RLIMIT_NOFILE, ", limit.rlim_cur, "): ", std::strerror(errno)));
  }
  if (enough) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "this task may need ", needed, " open descriptors but the process may have ", limit.rlim_max,
      " (hard limit); raise it (ulimit -n, LimitNOFILE=, or the "
      "launcher's setting) or channels will fail to open with 'Too many open files'"));
}

}  // namespace tensorverbs
