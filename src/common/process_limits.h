// The process limits a task needs raised as its cluster grows. Each peer costs a task about 18
// descriptors (measured by `tensorverbs bench scale`: gRPC connections both ways, and per
// channel the same-host fabric's sockets and rings or libfabric's endpoints), so a task with
// more than about 50 peers exceeds the soft limit of 1024 descriptors that most Linux
// distributions start processes with, while their hard limit is far higher. Called by the
// server at start, from any one thread.
#ifndef TENSORVERBS_COMMON_PROCESS_LIMITS_H_
#define TENSORVERBS_COMMON_PROCESS_LIMITS_H_

#include <cstdint>

#include "absl/status/status.h"

namespace tensorverbs {

// Descriptors a task with `peers` peers may hold at once, with room for the rest of the process.
uint64_t DescriptorsFor(uint64_t peers);

// Raises this process's soft RLIMIT_NOFILE to `needed` (up to the hard limit) when it is lower.
// OK when the soft limit is (now) at least `needed`; FailedPrecondition naming both limits and
// `ulimit -n` when the hard limit is lower (the soft limit is then raised to the hard one).
absl::Status RaiseDescriptorLimit(uint64_t needed);

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_PROCESS_LIMITS_H_
