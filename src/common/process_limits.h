// The process limits a task needs raised as its cluster grows. Each peer costs a task about 18
// descriptors (measured by `tensorverbs bench scale`: gRPC connections both ways, and per
// channel the same-host fabric's sockets and rings or libfabric's endpoints), so a task with
// more than about 50 peers exceeds the soft limit of 1024 descriptors that most Linux
// distributions start processes with, while their hard limit is far higher. Called by the
// server at start, from any one thread. Also what the host's load says about a silent peer:
// with many runnable tasks a core, a live peer (or this task) may not run for seconds, and a
// verdict of silence then names the load and the setting that allows for it (any thread).
#ifndef TENSORVERBS_COMMON_PROCESS_LIMITS_H_
#define TENSORVERBS_COMMON_PROCESS_LIMITS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace tensorverbs {

// Descriptors a task with `peers` peers may hold at once, with room for the rest of the process.
uint64_t DescriptorsFor(uint64_t peers);

// Raises this process's soft RLIMIT_NOFILE to `needed` (up to the hard limit) when it is lower.
// OK when the soft limit is (now) at least `needed`; FailedPrecondition naming both limits and
// `ulimit -n` when the hard limit is lower (the soft limit is then raised to the hard one).
absl::Status RaiseDescriptorLimit(uint64_t needed);

// Empty unless the 1-minute load average in `loadavg` (the text of /proc/loadavg) exceeds 4
// runnable tasks per core of `cores`; then a clause for an error about a peer's silence that
// gives both and names TENSORVERBS_PEER_TIMEOUT_MS.
std::string OverloadHint(absl::string_view loadavg, long cores);
// The same for this host, now (/proc/loadavg and the cores this process may run on).
std::string OverloadHint();

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_PROCESS_LIMITS_H_
