// TENSORVERBS_TRACE as a user sees it: the demo's tasks each write a trace file in which every
// remote recv appears with its phases on its channel's track, and a trace file that cannot be
// written is a warning, not a failure.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/support/process_util.h"
#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace tensorverbs {
namespace {

using ::testing::HasSubstr;
using testing::ScopedTempDir;

nlohmann::json ReadTrace(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
}

// Runs the demo (1 ps, 2 workers, `steps` steps) with TENSORVERBS_TRACE=`trace`; stdout and
// stderr into `*out`.
void RunTracedDemo(const std::string& trace, const std::string& protocol, int steps,
                   std::string* out) {
  auto demo = support::Subprocess::Start(
      "/bin/sh", {"-c", absl::StrCat("TENSORVERBS_TRACE='", trace, "' exec '", testing::ToolPath(),
                                     "' demo --workers 2 --steps ", steps, " --protocol ", protocol,
                                     " 2>&1")});
  ASSERT_TRUE(demo.ok()) << demo.status();
  *out = (*demo)->ReadAll(absl::Seconds(120));
  absl::StatusOr<int> rc = (*demo)->Wait(absl::Seconds(30));
  ASSERT_TRUE(rc.ok()) << rc.status();
  ASSERT_EQ(*rc, 0) << *out;
}

// Checks one process's trace file: valid JSON, named tracks, and every recv one async slice
// (b/e, with the key, step, peer and protocol at its start and OK with its bytes at its end)
// covered without gaps by its phases, the last of which is the callback. Returns the recvs.
int ExpectWellFormedTrace(const std::string& path, const std::string& protocol) {
  nlohmann::json events = ReadTrace(path);
  EXPECT_TRUE(events.is_array()) << path << " is not a JSON array";
  if (!events.is_array()) return 0;
  std::map<int64_t, std::string> tracks;
  bool process_named = false;
  struct Slice {
    const nlohmann::json* begin = nullptr;
    const nlohmann::json* end = nullptr;
    std::vector<std::pair<const nlohmann::json*, const nlohmann::json*>> phases;
  };
  std::map<std::string, Slice> recvs;  // by id
  for (const nlohmann::json& e : events) {
    const std::string ph = e.value("ph", "");
    if (ph == "M") {
      if (e["name"] == "process_name") process_named = true;
      if (e["name"] == "thread_name") tracks[e["tid"].get<int64_t>()] = e["args"]["name"];
      continue;
    }
    EXPECT_TRUE(ph == "b" || ph == "e") << e;
    EXPECT_EQ(e.value("cat", ""), "recv") << e;
    EXPECT_TRUE(e.contains("ts") && e["ts"].is_number()) << e;
    EXPECT_TRUE(tracks.contains(e.value("tid", int64_t{-1}))) << "a track named first: " << e;
    Slice& slice = recvs[e.value("id", "")];
    const bool outer = e.contains("args");
    if (outer) {
      (ph == "b" ? slice.begin : slice.end) = &e;
    } else if (ph == "b") {
      slice.phases.push_back({&e, nullptr});
    } else {
      EXPECT_FALSE(slice.phases.empty()) << e;
      if (!slice.phases.empty()) slice.phases.back().second = &e;
    }
  }
  EXPECT_TRUE(process_named) << path;
  for (const auto& [tid, name] : tracks) {
    EXPECT_THAT(name, ::testing::MatchesRegex(
                          "/job:.* <- /job:.* \\(" +
                          std::string(protocol == "grpc" ? "grpc" : "grpc\\+verbs") + ".*\\)"));
  }
  const std::set<std::string> phase_names = {
      "queued",           "awaiting meta-data", "awaiting a large-destination grant",
      "awaiting content", "awaiting response",  "landed",
      "callback"};
  for (const auto& [id, r] : recvs) {
    if (r.begin == nullptr || r.end == nullptr) {
      ADD_FAILURE() << "recv " << id << " has no begin or no end in " << path;
      continue;
    }
    const nlohmann::json& args = (*r.begin)["args"];
    EXPECT_THAT(args.value("key", ""),
                HasSubstr(";" + (*r.begin)["name"].get<std::string>() + ";"));
    EXPECT_GE(args.value("step", int64_t{-1}), 0);
    EXPECT_THAT(args.value("peer", ""), ::testing::StartsWith("/job:"));
    EXPECT_EQ(args.value("protocol", ""), protocol);
    EXPECT_EQ((*r.end)["args"].value("status", ""), "OK") << *r.end;
    EXPECT_GT((*r.end)["args"].value("bytes", int64_t{0}), 0) << *r.end;
    EXPECT_EQ((*r.begin)["name"], (*r.end)["name"]);
    EXPECT_EQ((*r.begin)["tid"], (*r.end)["tid"]);
    if (r.phases.empty()) {
      ADD_FAILURE() << "recv " << id << " has no phases";
      continue;
    }
    double at = (*r.begin)["ts"].get<double>();
    for (const auto& [b, e] : r.phases) {
      if (e == nullptr) {
        ADD_FAILURE() << "unended phase " << *b;
        break;
      }
      EXPECT_TRUE(phase_names.contains((*b)["name"].get<std::string>())) << *b;
      EXPECT_EQ((*b)["name"], (*e)["name"]);
      EXPECT_NEAR((*b)["ts"].get<double>(), at, 0.002) << "phases follow each other: " << *b;
      EXPECT_LE((*b)["ts"].get<double>(), (*e)["ts"].get<double>());
      at = (*e)["ts"].get<double>();
    }
    EXPECT_NEAR(at, (*r.end)["ts"].get<double>(), 0.002);
    EXPECT_EQ((*r.phases.back().first)["name"], "callback");
  }
  return static_cast<int>(recvs.size());
}

// TENSORVERBS_TRACE: each task of the demo writes a trace file of its own ("%p"), in which every
// remote recv the demo counted appears with its phases.
TEST(ToolTest, TraceFileShowsEveryRecvsPhasesOnItsChannelsTrack) {
  for (const std::string protocol : {"grpc+verbs", "grpc"}) {
    SCOPED_TRACE(protocol);
    const ScopedTempDir dir;
    std::string out;
    ASSERT_NO_FATAL_FAILURE(RunTracedDemo(dir.File("trace-%p.json"), protocol, 4, &out));
    int counted = 0;
    for (absl::string_view line : absl::StrSplit(out, '\n')) {
      if (sscanf(std::string(line).c_str(), " transfers: %d tensors", &counted) == 1) break;
    }
    ASSERT_GT(counted, 0) << out;
    std::vector<std::string> files;
    for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
      files.push_back(entry.path().string());
    }
    ASSERT_EQ(files.size(), 3u) << "one file per task: " << out;
    int traced = 0;
    for (const std::string& f : files) {
      SCOPED_TRACE(f);
      traced += ExpectWellFormedTrace(f, protocol);
    }
    // The demo's count is the training steps' recvs; the trace also holds its start-up's.
    EXPECT_GE(traced, counted);
  }
}

// A trace file that cannot be written is a warning naming the variable; the task runs on.
TEST(ToolTest, AnUnwritableTraceFileIsAWarningAndTheTaskRunsOn) {
  const ScopedTempDir dir;
  std::string out;
  ASSERT_NO_FATAL_FAILURE(
      RunTracedDemo(dir.File("no-such-folder/trace.json"), "grpc+verbs", 2, &out));
  EXPECT_THAT(out, HasSubstr("TENSORVERBS_TRACE: cannot write"));
  EXPECT_THAT(out, HasSubstr("no-such-folder/trace.json"));
}

}  // namespace
}  // namespace tensorverbs
