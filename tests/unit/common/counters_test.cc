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

// Producers add by key; the name comes from the catalog, so it is typed once.
TEST(CounterCatalog, KeysNameTheirEntries) {
  for (size_t i = 0; i < CounterCatalog().size(); ++i) {
    EXPECT_EQ(static_cast<size_t>(CounterCatalog()[i].key), i) << CounterCatalog()[i].name;
  }
  EXPECT_EQ(CounterInfoOf(Counter::kPoolBytes).name, "pool_bytes");
  EXPECT_EQ(CounterInfoOf(Counter::kTorchFailed).scope, CounterScope::kTorchGroup);
  EXPECT_EQ(FindCounter("torch_failed"), nullptr) << "a torch group's counters are not a task's";
  CounterList list;
  AddCounter(&list, Counter::kWaiterDrives, 7);
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].first, "waiter_drives");
  EXPECT_EQ(list[0].second, 7);
}

TEST(CounterSet, AddsByKeyAndListsUnderCatalogNames) {
  CounterSet<Counter::kTorchStagedCopies, Counter::kTorchFailed> set;
  set.Add<Counter::kTorchStagedCopies>();
  set.Add<Counter::kTorchStagedBytes>(4096);
  set.Add<Counter::kTorchFailed>(2);
  EXPECT_EQ(set.Get<Counter::kTorchStagedBytes>(), 4096);
  const CounterList list = set.List();
  ASSERT_EQ(list.size(), decltype(set)::kSize);
  EXPECT_EQ(list.front(), (std::pair<std::string, int64_t>("torch_staged_copies", 1)));
  EXPECT_EQ(list.back(), (std::pair<std::string, int64_t>("torch_failed", 2)));
  for (const auto& [name, value] : list) {
    if (name != "torch_staged_copies" && name != "torch_staged_bytes" && name != "torch_failed") {
      EXPECT_EQ(value, 0) << name;
    }
  }
}

}  // namespace
}  // namespace tensorverbs
