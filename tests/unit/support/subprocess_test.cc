// Subprocess: lines read under a timeout, exit codes, and waits after the child is reaped.
#include "src/support/subprocess.h"

#include <signal.h>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace tensorverbs::support {
namespace {

TEST(SubprocessTest, LinesAndTheExitCodeOfAChildThatExits) {
  auto child = Subprocess::Start("/bin/sh", {"-c", "echo one; echo two; exit 3"});
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(*(*child)->WaitForLine("two", absl::Seconds(10)), "two");
  absl::StatusOr<int> code = (*child)->Wait(absl::Seconds(10));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 3);
}

// Tests kill a peer, wait for it, and wait again in their teardown: the second wait answers at
// once with the same code rather than spinning out its timeout on a child that is gone.
TEST(SubprocessTest, AWaitAfterTheChildWasReapedAnswersAtOnce) {
  auto child = Subprocess::Start("/bin/sleep", {"60"});
  ASSERT_TRUE(child.ok()) << child.status();
  (*child)->Signal(SIGKILL);
  absl::StatusOr<int> first = (*child)->Wait(absl::Seconds(10));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(*first, 128 + SIGKILL);
  const absl::Time start = absl::Now();
  absl::StatusOr<int> again = (*child)->Wait(absl::Seconds(10));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, 128 + SIGKILL);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

TEST(SubprocessTest, AChildStillRunningIsADeadlineAndTheDestructorEndsIt) {
  auto child = Subprocess::Start("/bin/sleep", {"60"});
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ((*child)->Wait(absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  const pid_t pid = (*child)->pid();
  child->reset();
  EXPECT_EQ(kill(pid, 0), -1) << "the destructor left the child running";
}

}  // namespace
}  // namespace tensorverbs::support
