#include "src/common/event_loop.h"

#include <gtest/gtest.h>

#include <atomic>
#include <vector>

#include "src/common/mutex.h"

namespace tensorverbs {
namespace {

TEST(EventLoop, RunsTasksInOrderOnItsThread) {
  EventLoop loop("test-loop");
  EXPECT_FALSE(loop.InLoop());
  std::vector<int> order;
  Notification done;
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(loop.DeferToLoop([&, i] {
      EXPECT_TRUE(loop.InLoop());
      order.push_back(i);
      if (i == 99) done.Notify();
    }));
  }
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
}

TEST(EventLoop, TasksMayDeferMoreTasks) {
  EventLoop loop("test-loop");
  Notification done;
  loop.DeferToLoop([&] { loop.DeferToLoop([&] { done.Notify(); }); });
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
}

TEST(EventLoop, TimersRunAfterTheirDelayInDeadlineOrder) {
  EventLoop loop("test-loop");
  std::vector<int> order;
  Notification done;
  absl::Time start = absl::Now();
  absl::Time fired;
  loop.RunAfter(absl::Milliseconds(60), [&] {
    order.push_back(2);
    fired = absl::Now();
    done.Notify();
  });
  loop.RunAfter(absl::Milliseconds(20), [&] { order.push_back(1); });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
  EXPECT_GE(fired - start, absl::Milliseconds(60));
}

TEST(EventLoop, CancelledTimerNeverRuns) {
  EventLoop loop("test-loop");
  std::atomic<bool> ran{false};
  uint64_t id = loop.RunAfter(absl::Milliseconds(50), [&] { ran = true; });
  EXPECT_TRUE(loop.Cancel(id));
  EXPECT_FALSE(loop.Cancel(id));
  Notification done;
  loop.RunAfter(absl::Milliseconds(100), [&] { done.Notify(); });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_FALSE(ran);
}

TEST(EventLoop, CloseRunsQueuedWorkAndRejectsNewWork) {
  std::atomic<int> ran{0};
  {
    EventLoop loop("test-loop");
    for (int i = 0; i < 10; ++i) loop.DeferToLoop([&] { ran++; });
    loop.Close();
    EXPECT_FALSE(loop.DeferToLoop([&] { ran += 100; }));
    EXPECT_EQ(loop.RunAfter(absl::Milliseconds(1), [&] { ran += 100; }), 0u);
  }
  EXPECT_EQ(ran, 10);
}

}  // namespace
}  // namespace tensorverbs
