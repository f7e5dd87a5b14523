#include "tests/support/subprocess.h"

namespace tensorverbs::testing {

std::string TestPeerPath() { return TV_TEST_PEER_PATH; }
std::string ToolPath() { return TV_TOOL_PATH; }

absl::StatusOr<ToolRun> RunTool(const std::vector<std::string>& args, absl::Duration timeout) {
  absl::StatusOr<std::unique_ptr<support::Subprocess>> p = support::Subprocess::Start(ToolPath(), args);
  if (!p.ok()) return p.status();
  ToolRun run;
  run.out = (*p)->ReadAll(timeout);
  absl::StatusOr<int> rc = (*p)->Wait(absl::Seconds(10));
  if (!rc.ok()) return rc.status();
  run.exit_code = *rc;
  return run;
}

}  // namespace tensorverbs::testing
