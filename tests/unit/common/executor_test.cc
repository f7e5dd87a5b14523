#include "src/common/executor.h"

#include <gtest/gtest.h>

#include <atomic>

#include "src/common/mutex.h"

namespace tensorverbs {
namespace {

TEST(Executor, RunsEveryTaskOnce) {
  std::atomic<int> sum{0};
  {
    Executor executor("test-exec", 3);
    std::atomic<int> left{1000};
    Notification all_ran;
    for (int i = 1; i <= 1000; ++i) {
      executor.Schedule([&, i] {
        sum += i;
        if (--left == 0) all_ran.Notify();
      });
    }
    ASSERT_TRUE(all_ran.WaitForNotificationWithTimeout(absl::Seconds(30)));
  }
  EXPECT_EQ(sum, 1000 * 1001 / 2);
}

TEST(Executor, DestructorDrainsScheduledTasks) {
  std::atomic<int> ran{0};
  {
    Executor executor("test-exec", 1);
    for (int i = 0; i < 50; ++i) executor.Schedule([&] { ran++; });
  }
  EXPECT_EQ(ran, 50);
}

}  // namespace
}  // namespace tensorverbs
