// Test access to tools::Subprocess and the paths of the binaries under test (set by CMake).
#ifndef TENSORVERBS_TESTS_SUPPORT_SUBPROCESS_H_
#define TENSORVERBS_TESTS_SUPPORT_SUBPROCESS_H_

#include <string>

#include "tools/subprocess.h"

namespace tensorverbs::testing {

using tools::Subprocess;

std::string TestPeerPath();
std::string ToolPath();

}  // namespace tensorverbs::testing

#endif  // TENSORVERBS_TESTS_SUPPORT_SUBPROCESS_H_
