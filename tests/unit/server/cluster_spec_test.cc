#include "tensorverbs/cluster_spec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace tensorverbs {
namespace {

using ::testing::HasSubstr;

TEST(ClusterSpec, ParsesTheTextForm) {
  absl::StatusOr<ClusterSpec> c =
      ClusterSpec::Parse(" ps=localhost:2222 ; worker=localhost:2223,10.0.0.2:2224 ");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->NumTasks("ps"), 1);
  EXPECT_EQ(c->NumTasks("worker"), 2);
  EXPECT_EQ(c->NumTasks("chief"), 0);
  EXPECT_EQ(*c->TaskAddress("worker", 1), "10.0.0.2:2224");
  EXPECT_EQ(c->ToString(), "ps=localhost:2222;worker=localhost:2223,10.0.0.2:2224");
  auto map = c->TaskAddresses();
  EXPECT_EQ(map.size(), 3u);
  EXPECT_EQ(map["/job:worker/replica:0/task:0"], "localhost:2223");
}

TEST(ClusterSpec, ParsesJsonAndTfConfig) {
  absl::StatusOr<ClusterSpec> c =
      ClusterSpec::Parse(R"({"ps": ["h:1"], "worker": ["h:2", "[::1]:3"]})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c->TaskAddress("worker", 1), "[::1]:3");
  absl::StatusOr<ClusterSpec> tf = ClusterSpec::Parse(
      R"({"cluster": {"chief": ["h:9"]}, "task": {"type": "chief", "index": 0}})");
  ASSERT_TRUE(tf.ok()) << tf.status();
  EXPECT_EQ(*tf->TaskAddress("chief", 0), "h:9");
}

TEST(ClusterSpec, MalformedSpecsNameTheProblem) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "empty"},
      {"   ", "empty"},
      {"ps", "has no '='"},
      {"ps=h:1;", "stray ';'"},
      {"ps=h:1;ps=h:2", "appears twice"},
      {"=h:1", "job name ''"},
      {"p s=h:1", "job name"},
      {"ps=", "empty address"},
      {"ps=h:1,,h:2", "empty address"},
      {"ps=h", "not HOST:PORT"},
      {"ps=h:0", "not 1..65535"},
      {"ps=h:65536", "not 1..65535"},
      {"ps=h:port", "not 1..65535"},
      {"ps=:80", "not HOST:PORT"},
      {"ps=::1:80", "IPv6"},
      {"{", "invalid JSON"},
      {"{\"ps\": \"h:1\"}", "not a list"},
      {"{\"ps\": [1]}", "non-string"},
      {"{\"ps\": []}", "no tasks"},
      {"{}", "no jobs"},
  };
  for (const auto& [spec, why] : cases) {
    absl::StatusOr<ClusterSpec> c = ClusterSpec::Parse(spec);
    ASSERT_FALSE(c.ok()) << spec;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << spec;
    EXPECT_THAT(c.status().message(), HasSubstr(why)) << spec;
    EXPECT_THAT(c.status().message(), HasSubstr("expected JOB=HOST:PORT"));
  }
}

TEST(ClusterSpec, UnknownJobOrTaskIsNotFound) {
  ClusterSpec c = *ClusterSpec::Parse("ps=h:1;worker=h:2,h:3");
  absl::StatusOr<std::string> a = c.TaskAddress("chief", 0);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(a.status().message(), HasSubstr("jobs: ps, worker"));
  absl::StatusOr<std::string> b = c.TaskAddress("worker", 2);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(b.status().message(), HasSubstr("tasks 0..1"));
  EXPECT_FALSE(c.TaskAddress("worker", -1).ok());
}

}  // namespace
}  // namespace tensorverbs
