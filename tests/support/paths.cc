#include "tests/support/subprocess.h"

#include <signal.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/support/process_util.h"
#include "tools/netns.h"

namespace tensorverbs::testing {

std::string TestPeerPath() { return TV_TEST_PEER_PATH; }
std::string ToolPath() { return TV_TOOL_PATH; }

absl::StatusOr<ToolRun> RunTool(const std::vector<std::string>& args, absl::Duration timeout) {
  absl::StatusOr<std::unique_ptr<support::Subprocess>> p = support::Subprocess::Start(ToolPath(), args);
  if (!p.ok()) return p.status();
  ToolRun run;
  run.out = (*p)->ReadAll(timeout);
  absl::StatusOr<int> rc = (*p)->Wait(absl::Seconds(10));
  if (!rc.ok()) {
    // Killed here, it cleans up nothing itself: its shared memory and network namespaces are
    // removed for it, and what it printed says where it stopped.
    const int pid = (*p)->pid();
    (*p)->Signal(SIGKILL);
    (void)(*p)->Wait(absl::Seconds(10));
    support::UnlinkShmRegionsOf(pid);
    tools::RemoveNetnsOf(pid);
    return absl::DeadlineExceededError(
        absl::StrCat("`tensorverbs ", absl::StrJoin(args, " "), "` (pid ", pid, ") still ran after ",
                     absl::FormatDuration(timeout), " (", rc.status().message(),
                     "); its output so far:\n", run.out));
  }
  run.exit_code = *rc;
  return run;
}

}  // namespace tensorverbs::testing
