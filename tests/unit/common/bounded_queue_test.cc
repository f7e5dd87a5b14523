#include "src/common/bounded_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace tensorverbs {
namespace {

TEST(BoundedQueue, FifoUntilFullThenRefusesUntilPopped) {
  BoundedQueue<uint64_t> q(3);
  EXPECT_EQ(q.capacity(), 4u);
  uint64_t v = 0;
  EXPECT_FALSE(q.TryPop(&v));
  for (uint64_t i = 1; i <= 4; ++i) EXPECT_TRUE(q.TryPush(i));
  EXPECT_FALSE(q.TryPush(5)) << "full";
  ASSERT_TRUE(q.TryPop(&v));
  EXPECT_EQ(v, 1u);
  EXPECT_TRUE(q.TryPush(5));
  for (uint64_t want = 2; want <= 5; ++want) {
    ASSERT_TRUE(q.TryPop(&v));
    EXPECT_EQ(v, want);
  }
  EXPECT_FALSE(q.TryPop(&v));
  // Many laps around the ring.
  for (uint64_t i = 0; i < 1000; ++i) {
    ASSERT_TRUE(q.TryPush(i));
    ASSERT_TRUE(q.TryPop(&v));
    ASSERT_EQ(v, i);
  }
}

// Producers on several threads, one consumer: every value arrives exactly once, and each
// producer's values in the order it pushed them.
TEST(BoundedQueue, ConcurrentProducersLoseAndDuplicateNothing) {
  constexpr int kProducers = 4;
  constexpr uint64_t kPerProducer = 50000;
  BoundedQueue<uint64_t> q(64);
  std::atomic<bool> go{false};
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      while (!go.load()) {
      }
      for (uint64_t i = 0; i < kPerProducer; ++i) {
        const uint64_t value = (static_cast<uint64_t>(p) << 32) | i;
        while (!q.TryPush(value)) std::this_thread::yield();
      }
    });
  }
  go.store(true);
  std::vector<uint64_t> next(kProducers, 0);
  uint64_t received = 0;
  while (received < kProducers * kPerProducer) {
    uint64_t v;
    if (!q.TryPop(&v)) {
      std::this_thread::yield();
      continue;
    }
    const auto p = static_cast<size_t>(v >> 32);
    ASSERT_LT(p, next.size());
    ASSERT_EQ(v & 0xFFFFFFFFu, next[p]) << "producer " << p;
    ++next[p];
    ++received;
  }
  for (std::thread& t : producers) t.join();
  uint64_t v;
  EXPECT_FALSE(q.TryPop(&v));
}

// Producers and consumers on several threads each: every value is popped exactly once, and
// each consumer sees any one producer's values in the order they were pushed.
TEST(BoundedQueue, ConcurrentProducersAndConsumersLoseAndDuplicateNothing) {
  constexpr int kProducers = 3;
  constexpr int kConsumers = 3;
  constexpr uint64_t kPerProducer = 40000;
  BoundedQueue<uint64_t> q(16);
  std::atomic<bool> go{false};
  std::atomic<uint64_t> popped{0};
  std::vector<std::vector<uint64_t>> seen(kConsumers);
  std::vector<std::thread> threads;
  for (int p = 0; p < kProducers; ++p) {
    threads.emplace_back([&, p] {
      while (!go.load()) {
      }
      for (uint64_t i = 0; i < kPerProducer; ++i) {
        while (!q.TryPush((static_cast<uint64_t>(p) << 32) | i)) std::this_thread::yield();
      }
    });
  }
  for (int c = 0; c < kConsumers; ++c) {
    threads.emplace_back([&, c] {
      while (!go.load()) {
      }
      while (popped.load() < kProducers * kPerProducer) {
        uint64_t v;
        if (!q.TryPop(&v)) {
          std::this_thread::yield();
          continue;
        }
        seen[c].push_back(v);
        popped.fetch_add(1);
      }
    });
  }
  go.store(true);
  for (std::thread& t : threads) t.join();
  std::vector<uint64_t> count(kProducers * kPerProducer, 0);
  for (const std::vector<uint64_t>& values : seen) {
    std::vector<int64_t> last(kProducers, -1);
    for (uint64_t v : values) {
      const auto p = static_cast<size_t>(v >> 32);
      const auto i = static_cast<int64_t>(v & 0xFFFFFFFFu);
      ASSERT_LT(p, static_cast<size_t>(kProducers));
      ASSERT_GT(i, last[p]) << "producer " << p << "'s values out of order";
      last[p] = i;
      ++count[p * kPerProducer + static_cast<uint64_t>(i)];
    }
  }
  for (size_t k = 0; k < count.size(); ++k) ASSERT_EQ(count[k], 1u) << "value " << k;
  uint64_t v;
  EXPECT_FALSE(q.TryPop(&v));
}

}  // namespace
}  // namespace tensorverbs
