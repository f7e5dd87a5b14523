#include "src/common/counters.h"

#include <set>
#include <string>

#include "gtest/gtest.h"

namespace tensorverbs {
namespace {

TEST(CounterCatalog, NamesEachCounterOnceWithAMeaning) {
  std::set<std::string> names;
  for (const CounterInfo& info : CounterCatalog()) {
    EXPECT_TRUE(names.insert(std::string(info.name)).second) << info.name << " twice";
    EXPECT_FALSE(info.help.empty()) << info.name;
    EXPECT_EQ(info.name.find_first_not_of("abcdefghijklmnopqrstuvwxyz_"), std::string::npos)
        << info.name << ": Prometheus metric names take lower-case letters and underscores";
  }
}

TEST(CounterCatalog, FindsByNameAndNothingElse) {
  const CounterInfo* pool = FindCounter("pool_bytes");
  ASSERT_NE(pool, nullptr);
  EXPECT_TRUE(pool->gauge);
  const CounterInfo* sent = FindCounter("tensors_sent");
  ASSERT_NE(sent, nullptr);
  EXPECT_FALSE(sent->gauge);
  EXPECT_EQ(FindCounter("recv_errors_unavailable"), nullptr) << "by-code counters are one family";
  EXPECT_NE(FindCounter("recv_errors_by_code"), nullptr);
  EXPECT_EQ(FindCounter(""), nullptr);
  EXPECT_EQ(FindCounter("tensors_sent_total"), nullptr);
}

}  // namespace
}  // namespace tensorverbs
