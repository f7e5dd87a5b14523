// Test access to support::Subprocess, the paths of the binaries under test (set by CMake), and a
// way to run the tool as a user does.
#ifndef TENSORVERBS_TESTS_SUPPORT_SUBPROCESS_H_
#define TENSORVERBS_TESTS_SUPPORT_SUBPROCESS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "src/support/subprocess.h"

namespace tensorverbs::testing {

using support::Subprocess;

std::string TestPeerPath();
std::string ToolPath();

struct ToolRun {
  int exit_code = -1;
  std::string out;  // stdout
};
// Runs `tensorverbs args...` to completion and collects its stdout. Past `timeout` it kills the
// tool, removes the network namespaces it made, and fails DeadlineExceeded with its pid and
// everything it printed.
absl::StatusOr<ToolRun> RunTool(const std::vector<std::string>& args, absl::Duration timeout);

}  // namespace tensorverbs::testing

#endif  // TENSORVERBS_TESTS_SUPPORT_SUBPROCESS_H_
