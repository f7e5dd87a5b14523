// The formats of `tensorverbs stats` and metrics files (tools/stats.h), from a hand-made answer.
#include "tools/stats.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/str_split.h"
#include "tests/support/temp_dir.h"

namespace tensorverbs::tools {
namespace {

using ::testing::HasSubstr;

proto::GetStatsResponse Sample() {
  proto::GetStatsResponse s;
  s.set_task_name("/job:worker/replica:0/task:0");
  s.set_protocol("grpc+verbs");
  s.set_fabric("shmem (shmem)");
  s.set_incarnation(0xabcdef);
  s.set_uptime_ms(1500);
  (*s.mutable_counters())["tensors_received"] = 7;
  (*s.mutable_counters())["pending_recvs"] = 2;
  (*s.mutable_counters())["a_counter_not_known_yet"] = 1;
  proto::ChannelStats* c = s.add_channels();
  c->set_peer_task("/job:ps/replica:0/task:0");
  c->set_receives(true);
  c->set_state("ready");
  c->set_fabric("shmem (shmem)");
  (*c->mutable_counters())["tensors_received"] = 7;
  (*c->mutable_counters())["bytes_received"] = 700;
  (*c->mutable_counters())["recv_errors_unavailable"] = 2;
  (*c->mutable_counters())["recv_errors_cancelled"] = 1;
  proto::ChannelStats* d = s.add_channels();
  d->set_peer_task("/job:ps/replica:0/task:0");
  d->set_receives(false);
  d->set_state("ready");
  (*d->mutable_counters())["tensors_sent"] = 3;
  return s;
}

// Every line of the text format is a comment (HELP or TYPE, once per family, before its
// samples) or a sample `name{labels} value` of a family whose TYPE was given.
TEST(StatsFormatTest, PrometheusTextIsWellFormedWithOneHelpAndTypePerFamily) {
  const std::string text = FormatPrometheus(Sample());
  const std::regex sample(
      R"re(([a-zA-Z_:][a-zA-Z0-9_:]*)\{([a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*)\} -?[0-9]+(\.[0-9]+)?)re");
  const std::regex comment(R"re(# (HELP|TYPE) ([a-zA-Z_:][a-zA-Z0-9_:]*) .+)re");
  std::map<std::string, std::string> types;
  std::set<std::string> helps;
  int samples = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::smatch m;
    const std::string l(line);
    if (std::regex_match(l, m, comment)) {
      if (m[1] == "HELP") {
        EXPECT_TRUE(helps.insert(m[2]).second) << "two HELP lines for " << m[2];
      } else {
        EXPECT_TRUE(types.emplace(m[2], l.substr(l.rfind(' ') + 1)).second) << l;
      }
      continue;
    }
    ASSERT_TRUE(std::regex_match(l, m, sample)) << "not a sample: " << l;
    EXPECT_TRUE(types.contains(m[1])) << "a sample before its TYPE: " << l;
    EXPECT_TRUE(helps.contains(m[1])) << "a sample before its HELP: " << l;
    ++samples;
  }
  EXPECT_EQ(samples, 9);
  EXPECT_EQ(types.at("tensorverbs_tensors_received_total"), "counter");
  EXPECT_EQ(types.at("tensorverbs_pending_recvs"), "gauge");
  EXPECT_THAT(text, HasSubstr("tensorverbs_channel_tensors_received_total{task=\"/job:worker/"
                              "replica:0/task:0\",peer=\"/job:ps/replica:0/task:0\",direction="
                              "\"recv\"} 7\n"));
  // Failed recvs by code: one family, the code a label.
  EXPECT_THAT(text, HasSubstr(",direction=\"recv\",code=\"unavailable\"} 2\n"));
  EXPECT_THAT(text, HasSubstr(",direction=\"recv\",code=\"cancelled\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("direction=\"send\"} 3\n"));
  EXPECT_THAT(text,
              HasSubstr("tensorverbs_up_seconds{task=\"/job:worker/replica:0/task:0\"} 1.500"));
}

TEST(StatsFormatTest, LabelValuesAreEscaped) {
  proto::GetStatsResponse s = Sample();
  s.set_task_name("a\"b\\c\nd");
  EXPECT_THAT(FormatPrometheus(s), HasSubstr("task=\"a\\\"b\\\\c\\nd\""));
}

TEST(StatsFormatTest, JsonHasTheTaskItsCountersAndEveryChannel) {
  const nlohmann::json j = nlohmann::json::parse(FormatStatsJson(Sample()));
  EXPECT_EQ(j["task"], "/job:worker/replica:0/task:0");
  EXPECT_EQ(j["fabric"], "shmem (shmem)");
  EXPECT_EQ(j["counters"]["tensors_received"], 7);
  ASSERT_EQ(j["channels"].size(), 2u);
  EXPECT_EQ(j["channels"][0]["direction"], "recv");
  EXPECT_EQ(j["channels"][0]["counters"]["bytes_received"], 700);
  EXPECT_EQ(j["channels"][1]["direction"], "send");
}

TEST(StatsFormatTest, TheTableNamesTheTaskEveryCounterAndEveryChannel) {
  const std::string table = FormatStatsTable(Sample());
  EXPECT_THAT(table, HasSubstr("task /job:worker/replica:0/task:0  protocol grpc+verbs over "
                               "shmem (shmem)"));
  EXPECT_THAT(table, HasSubstr("channel from /job:ps/replica:0/task:0 (ready"));
  EXPECT_THAT(table, HasSubstr("channel to /job:ps/replica:0/task:0 (ready"));
  EXPECT_THAT(table, HasSubstr("a_counter_not_known_yet"));
}

TEST(StatsFormatTest, MetricsFilesAreReplacedWholeAndBadFoldersAreNamed) {
  testing::ScopedTempDir dir;
  const std::string path = dir.File("tensorverbs.prom");
  int collected = 0;
  {
    MetricsFileWriter writer(path, absl::Milliseconds(20), [&collected] {
      ++collected;
      return Sample();
    });
    ASSERT_TRUE(writer.WriteNow().ok());
    std::stringstream contents;
    contents << std::ifstream(path).rdbuf();
    EXPECT_EQ(contents.str(), FormatPrometheus(Sample()));
  }
  EXPECT_GE(collected, 2);  // the thread's first write, WriteNow, the last one
  absl::Status bad = WriteFileAtomically(dir.File("no/such/folder/x.prom"), "x");
  EXPECT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.message()), HasSubstr("no/such/folder"));
}

}  // namespace
}  // namespace tensorverbs::tools
