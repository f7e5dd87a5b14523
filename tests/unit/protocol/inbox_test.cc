#include "src/protocol/inbox.h"

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace tensorverbs::protocol {
namespace {

TEST(InboxTest, OnlyTheFirstPushOfABatchAsksForADrainAndTheDrainKeepsTheOrder) {
  Inbox<int> inbox;
  EXPECT_TRUE(inbox.Push(1)) << "the first item asks for a drain";
  EXPECT_FALSE(inbox.Push(2)) << "a drain is asked for already";
  EXPECT_FALSE(inbox.Push(3));
  std::vector<int> seen;
  inbox.Drain([&](int& i) { seen.push_back(i); });
  EXPECT_EQ(seen, (std::vector<int>{1, 2, 3}));
  seen.clear();
  inbox.Drain([&](int& i) { seen.push_back(i); });
  EXPECT_TRUE(seen.empty()) << "each item is drained once";
  EXPECT_TRUE(inbox.Push(4)) << "after a drain, the next item asks again";
}

TEST(InboxTest, ItemsThatOwnResourcesMoveThroughAndPushesDuringADrainWaitForTheNext) {
  Inbox<std::unique_ptr<int>> inbox;
  inbox.Push(std::make_unique<int>(7));
  std::vector<int> seen;
  bool asked_again = false;
  inbox.Drain([&](std::unique_ptr<int>& p) {
    seen.push_back(*p);
    asked_again = inbox.Push(std::make_unique<int>(8));  // a drain that produces more
  });
  EXPECT_EQ(seen, (std::vector<int>{7}));
  EXPECT_TRUE(asked_again) << "the new item is a new batch, with its own drain";
  inbox.Drain([&](std::unique_ptr<int>& p) { seen.push_back(*p); }, /*on_loop=*/false);
  EXPECT_EQ(seen, (std::vector<int>{7, 8}));
}

// Many producers, one drainer that drains whenever a push asks: every item arrives once.
TEST(InboxTest, EveryItemFromManyThreadsIsDrainedExactlyOnce) {
  constexpr int kThreads = 4;
  constexpr int kPerThread = 5000;
  Inbox<int> inbox;
  std::atomic<int> drains_asked{0};
  std::vector<std::thread> producers;
  for (int t = 0; t < kThreads; ++t) {
    producers.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        if (inbox.Push(t * kPerThread + i)) drains_asked.fetch_add(1);
      }
    });
  }
  std::vector<int> count(kThreads * kPerThread, 0);
  int drained = 0;
  while (drained < kThreads * kPerThread) {
    inbox.Drain([&](int& i) {
      ++count[i];
      ++drained;
    });
  }
  for (std::thread& p : producers) p.join();
  for (int c : count) ASSERT_EQ(c, 1);
  EXPECT_GE(drains_asked.load(), 1);
  EXPECT_LE(drains_asked.load(), kThreads * kPerThread);
}

}  // namespace
}  // namespace tensorverbs::protocol
