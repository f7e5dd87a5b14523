// Helpers for the tools that run clusters of local processes: spawning this binary as a child,
// and waiting for termination signals (their ports come from PickFreePorts in
// tensorverbs/placement.h).
//
// Called from a tool's main thread only.
#ifndef TENSORVERBS_SUPPORT_PROCESS_UTIL_H_
#define TENSORVERBS_SUPPORT_PROCESS_UTIL_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace tensorverbs::support {

// The path of this executable (what /proc/self/exe points to).
absl::StatusOr<std::string> SelfExecutable();

// Starts this executable with `args` (argv[1..]). The child gets SIGTERM if the parent dies.
absl::StatusOr<pid_t> SpawnSelf(const std::vector<std::string>& args);
// Where `program` is on PATH, as the shell would find it: NotFound, naming it and PATH, when it
// is not there.
absl::StatusOr<std::string> FindOnPath(const std::string& program);
// The same as SpawnSelf for `program`, found on PATH (srun).
absl::StatusOr<pid_t> SpawnProgram(const std::string& program,
                                   const std::vector<std::string>& args);

struct ChildExit {
  pid_t pid = 0;
  int exit_code = 0;  // valid when !signaled
  bool signaled = false;
  int signal = 0;
};

// Waits for any of `pids` to exit, up to `timeout`; DeadlineExceeded if none did.
absl::StatusOr<ChildExit> WaitAnyChild(const std::vector<pid_t>& pids, absl::Duration timeout);

// The names in directory `dir` that start with `prefix` (none where it cannot be read).
std::vector<std::string> EntriesStartingWith(const char* dir, absl::string_view prefix);

// libfabric's shm provider keeps its regions in /dev/shm under names that start with "<pid>:"
// and unlinks them when the process closes its endpoints; a killed process never does. The
// names of `pid`'s regions, and their removal once `pid` is dead and reaped.
std::vector<std::string> ShmRegionsOf(pid_t pid);
void UnlinkShmRegionsOf(pid_t pid);

// This process's resident bytes, its proportional set size (shared pages divided among the
// processes that map them; -1 where the kernel does not say), and its open descriptors and
// threads: what the soak test and `bench scale` watch.
int64_t ResidentBytes();
int64_t ProportionalBytes();
int OpenDescriptors();
int ThreadCount();

// Blocks SIGINT and SIGTERM in the calling thread (call before starting other threads, which
// inherit the mask), so that WaitForTerminationSignal can take them synchronously.
void BlockTerminationSignals();
// Returns the signal number once SIGINT or SIGTERM arrives, or 0 after `timeout`.
int WaitForTerminationSignal(absl::Duration timeout = absl::InfiniteDuration());

}  // namespace tensorverbs::support

#endif  // TENSORVERBS_SUPPORT_PROCESS_UTIL_H_
