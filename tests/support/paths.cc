#include "tests/support/subprocess.h"

namespace tensorverbs::testing {

std::string TestPeerPath() { return TV_TEST_PEER_PATH; }
std::string ToolPath() { return TV_TOOL_PATH; }

}  // namespace tensorverbs::testing
