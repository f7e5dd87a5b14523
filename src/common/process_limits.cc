#include "src/common/process_limits.h"

#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

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

std::string OverloadHint(absl::string_view loadavg, long cores) {
  double load = 0;  // the first field
  if (cores <= 0 || !absl::SimpleAtod(loadavg.substr(0, loadavg.find(' ')), &load) || load <= 4.0 * cores) return std::string();
  return absl::StrFormat(
      "; this host's load average is %.0f on %d cores, and a peer (or this task) starved that "
      "long looks silent: where that is expected, as while hundreds of tasks start on few cores, "
      "raise TENSORVERBS_PEER_TIMEOUT_MS",
      load, cores);
}

std::string OverloadHint() {
  std::ifstream in("/proc/loadavg");
  std::stringstream text;
  text << in.rdbuf();
  // The cores this process may run on (a cpuset or affinity), not the host's.
  cpu_set_t set;
  CPU_ZERO(&set);
  const long cores = sched_getaffinity(0, sizeof(set), &set) == 0
                         ? static_cast<long>(CPU_COUNT(&set))
                         : sysconf(_SC_NPROCESSORS_ONLN);
  return OverloadHint(text.str(), cores);
}

}  // namespace tensorverbs
