#include "src/common/executor.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

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

TEST(Executor, ScheduleAllRunsABatchOnceInOrderOnOneThread) {
  for (int threads : {0, 1, 3}) {
    SCOPED_TRACE(threads);
    std::vector<int> order;  // written by one thread at a time: a batch runs on one thread
    std::vector<std::thread::id> ran_on;
    Notification done;
    {
      Executor executor("test-exec", threads);
      std::vector<Executor::Task> batch;
      for (int i = 0; i < 100; ++i) {
        batch.push_back([&order, &ran_on, i] {
          order.push_back(i);
          ran_on.push_back(std::this_thread::get_id());
        });
      }
      batch.push_back([&done] { done.Notify(); });
      executor.ScheduleAll(&batch);
      EXPECT_TRUE(batch.empty()) << "the tasks were taken";
      std::vector<Executor::Task> none;
      executor.ScheduleAll(&none);  // nothing to do
      ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
    }
    ASSERT_EQ(order.size(), 100u);
    for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
    for (const std::thread::id& id : ran_on) EXPECT_EQ(id, ran_on.front());
    if (threads == 0) {
      EXPECT_EQ(ran_on.front(), std::this_thread::get_id()) << "inline";
    }
  }
}

}  // namespace
}  // namespace tensorverbs
