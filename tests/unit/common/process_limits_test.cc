// RaiseDescriptorLimit (src/common/process_limits.h), in a child process each, so this test
// process keeps its own limits.
#include "src/common/process_limits.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <string>

namespace tensorverbs {
namespace {

// Runs `body` in a child; its exit code: 0 when every check held, else the failed check's.
int InChild(const std::function<int()>& body) {
  const pid_t pid = fork();
  if (pid == 0) _exit(body());
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

rlim_t Soft() {
  rlimit l{};
  getrlimit(RLIMIT_NOFILE, &l);
  return l.rlim_cur;
}

TEST(ProcessLimitsTest, ALowSoftLimitIsRaisedToWhatTheClusterNeeds) {
  EXPECT_EQ(InChild([] {
              rlimit l{};
              getrlimit(RLIMIT_NOFILE, &l);
              if (l.rlim_max != RLIM_INFINITY && l.rlim_max < 512) return 0;  // nothing to try
              l.rlim_cur = 64;
              if (setrlimit(RLIMIT_NOFILE, &l) != 0) return 1;
              if (!RaiseDescriptorLimit(DescriptorsFor(10)).ok()) return 2;
              if (Soft() != DescriptorsFor(10)) return 3;
              // Never lowered.
              if (!RaiseDescriptorLimit(100).ok() || Soft() != DescriptorsFor(10)) return 4;
              return 0;
            }),
            0);
}

TEST(ProcessLimitsTest, AHardLimitBelowTheNeedIsNamedAndTheSoftOneRaisedToIt) {
  EXPECT_EQ(InChild([] {
              rlimit l{};
              l.rlim_cur = 64;
              l.rlim_max = 128;
              if (setrlimit(RLIMIT_NOFILE, &l) != 0) return 1;
              absl::Status s = RaiseDescriptorLimit(DescriptorsFor(1000));
              if (s.code() != absl::StatusCode::kFailedPrecondition) return 2;
              if (s.message().find("ulimit -n") == absl::string_view::npos) return 3;
              if (Soft() != 128) return 4;
              return 0;
            }),
            0);
}

// A silent peer on a host with many runnable tasks a core is named with the load and the setting
// that allows for it; on a host within 4 a core, or where /proc/loadavg cannot be read, nothing.
TEST(ProcessLimitsTest, TheLoadIsNamedOnlyWhereItCanStarveAPeer) {
  const std::string hint = OverloadHint("83.52 61.02 30.11 41/2010 12345\n", 2);
  EXPECT_NE(hint.find("load average is 84 on 2 cores"), std::string::npos) << hint;
  EXPECT_NE(hint.find("TENSORVERBS_PEER_TIMEOUT_MS"), std::string::npos) << hint;
  EXPECT_EQ(OverloadHint("8.00 1.00 1.00 1/100 5\n", 2), "") << "4 a core is not overload";
  EXPECT_EQ(OverloadHint("83.52 1.00 1.00 1/100 5\n", 32), "");
  EXPECT_EQ(OverloadHint("", 2), "");
  EXPECT_EQ(OverloadHint("garbage", 2), "");
  EXPECT_EQ(OverloadHint("83.52 1 1 1/1 1", 0), "") << "no core count";
}

}  // namespace
}  // namespace tensorverbs
