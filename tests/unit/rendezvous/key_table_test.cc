#include "src/rendezvous/key_table.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tensorverbs {
namespace {

ParsedKey EdgeKey(const std::string& edge) {
  return *ParsedKey::Parse(ParsedKey::Create("/job:ps/replica:0/task:0/device:CPU:0", 7,
                                             "/job:worker/replica:0/task:2/device:CPU:0", edge));
}

TEST(KeyTable, EveryRecvOfAKeySharesOneParsedCopyWithItsSourceTask) {
  KeyTable table;
  KeyRef a = table.Intern(EdgeKey("w"));
  KeyRef b = table.Intern(EdgeKey("w"));
  KeyRef c = table.Intern(EdgeKey("v"));
  EXPECT_EQ(a.get(), b.get());
  EXPECT_NE(a.get(), c.get());
  EXPECT_EQ(a->key.full_key, EdgeKey("w").full_key);
  EXPECT_EQ(a->key.edge_name, "w");
  EXPECT_EQ(a->src_task, "/job:ps/replica:0/task:0");
  EXPECT_EQ(table.size(), 2u);
}

// Names made for one message each (torch.distributed numbers its messages) stay out of a
// table that admits repeated keys only, so they cannot push out the names a loop repeats.
TEST(KeyTable, KeysSeenOnceStayOutOfATableOfRepeatedKeys) {
  KeyTable table(/*max_keys=*/64, /*admit_repeated_only=*/true);
  KeyRef first = table.Intern(EdgeKey("weights"));
  KeyRef weights = table.Intern(EdgeKey("weights"));
  EXPECT_NE(first.get(), weights.get()) << "the first sighting gets a copy of its own";
  EXPECT_EQ(first->key.full_key, weights->key.full_key);
  EXPECT_EQ(table.Intern(EdgeKey("weights")).get(), weights.get());
  for (int i = 0; i < 10000; ++i) {
    KeyRef once = table.Intern(EdgeKey(absl::StrCat("message/", i)));
    EXPECT_EQ(once->key.edge_name, absl::StrCat("message/", i));
    EXPECT_EQ(once->src_task, "/job:ps/replica:0/task:0");
  }
  EXPECT_EQ(table.size(), 1u);
  EXPECT_EQ(table.Intern(EdgeKey("weights")).get(), weights.get());
}

TEST(KeyTable, StartsOverPastItsBoundAndKeysHandedOutStayValid) {
  KeyTable table(/*max_keys=*/4);
  std::vector<KeyRef> held;
  for (int i = 0; i < 10; ++i) held.push_back(table.Intern(EdgeKey(absl::StrCat("k", i))));
  EXPECT_LE(table.size(), 4u);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(held[i]->key.edge_name, absl::StrCat("k", i));
  // A key interned again after the table started over is an equal, new copy.
  KeyRef again = table.Intern(EdgeKey("k0"));
  EXPECT_EQ(again->key.full_key, held[0]->key.full_key);
}

TEST(KeyTable, ThreadsInterningTheSameKeysGetTheSameCopies) {
  KeyTable table;
  std::vector<std::vector<KeyRef>> got(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&table, &got, t] {
      for (int i = 0; i < 200; ++i) {
        got[t].push_back(table.Intern(EdgeKey(absl::StrCat("k", i % 50))));
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 1; t < 4; ++t) {
    for (int i = 0; i < 200; ++i) EXPECT_EQ(got[t][i].get(), got[0][i].get()) << t << " " << i;
  }
  EXPECT_EQ(table.size(), 50u);
}

}  // namespace
}  // namespace tensorverbs
