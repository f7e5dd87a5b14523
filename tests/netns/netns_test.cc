// Protocols across hosts: each task in its own network namespace, joined by veth pairs (and a
// bridge), so that gRPC and libfabric's tcp provider cross a real network path. Needs root;
// skips (saying why) where namespaces cannot be made.
#include "tools/netns.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace tensorverbs {
namespace {

using ::testing::HasSubstr;
using testing::RunTool;
using testing::ScopedTempDir;
using testing::Subprocess;
using testing::ToolRun;

class NetnsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<tools::NetnsHost>> probe = tools::NetnsHost::Create(63);
    if (!probe.ok()) GTEST_SKIP() << "no network namespaces here: " << probe.status().message();
  }
};

// A tool killed at a test's deadline runs no destructor: RunTool removes the namespace and the
// veth pair it made, so that a hung run leaves nothing on the machine.
TEST_F(NetnsTest, AToolKilledAtItsDeadlineLeavesNoNamespaceBehind) {
  absl::StatusOr<ToolRun> run =
      RunTool({"bench", "p2p", "--netns", "--sizes", "64MiB", "--iters", "100000", "--protocols",
               "grpc+verbs", "--no-baselines"},
              absl::Seconds(8));
  ASSERT_FALSE(run.ok()) << "the bench ended within 8 s: " << run->out;
  ASSERT_EQ(run.status().code(), absl::StatusCode::kDeadlineExceeded) << run.status();
  // Its namespace existed: the protocol phase runs its peer inside it.
  EXPECT_THAT(run.status().message(), HasSubstr("two network namespaces")) << run.status();
  const std::string text(run.status().message());
  const size_t at = text.find("(pid ");
  ASSERT_NE(at, std::string::npos) << text;
  const int pid = std::atoi(text.c_str() + at + 5);
  ASSERT_GT(pid, 0) << text;
  EXPECT_NE(access(absl::StrCat("/run/netns/tv", pid, "x0n0").c_str(), F_OK), 0)
      << "namespace of pid " << pid << " left behind";
  EXPECT_NE(access(absl::StrCat("/sys/class/net/tvh", pid % 100000, "x0n0").c_str(), F_OK), 0)
      << "veth of pid " << pid << " left behind";
}

TEST_F(NetnsTest, P2PCrossesAVethPairOverTcp) {
  const ScopedTempDir dir;
  const std::string json = dir.File("netns_p2p.json");
  absl::StatusOr<ToolRun> run =
      RunTool({"bench", "p2p", "--netns", "--sizes", "4KiB,1MiB", "--iters", "20", "--window", "4",
               "--protocols", "grpc,grpc+verbs,gdr", "--json", json},
              absl::Seconds(280));
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(run->exit_code, 0) << run->out;
  EXPECT_THAT(run->out, HasSubstr("in two network namespaces (veth)"));
  std::ifstream in(json);
  nlohmann::json rows = nlohmann::json::parse(in, nullptr, false);
  ASSERT_TRUE(rows.is_array());
  int verbs_rows = 0;
  for (const nlohmann::json& r : rows) {
    EXPECT_GT(r.value("bandwidth_gbps", 0.0), 0) << r.dump();
    if (r.value("protocol", "") == "grpc+verbs") {
      ++verbs_rows;
      // Not local to each other: the policy picks tcp, not shm.
      EXPECT_EQ(r.value("fabric", ""), "ofi (tcp;ofi_rxm)") << r.dump();
    }
  }
  EXPECT_EQ(verbs_rows, 2);
}

// --mixed: the pair alone on this host, then a same-host and a cross-host pair of one cluster;
// each row names the fabric its receiving channel reports.
TEST_F(NetnsTest, P2PMixedRunsEachPairOverItsOwnFabric) {
  const ScopedTempDir dir;
  const std::string json = dir.File("mixed_p2p.json");
  absl::StatusOr<ToolRun> run =
      RunTool({"bench", "p2p", "--mixed", "--sizes", "4KiB,1MiB", "--iters", "20", "--window", "4",
               "--repeat", "1", "--protocols", "grpc+verbs", "--json", json},
              absl::Seconds(280));
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(run->exit_code, 0) << run->out;
  EXPECT_THAT(run->out, HasSubstr("same-host pair / the pair alone"));
  std::ifstream in(json);
  nlohmann::json rows = nlohmann::json::parse(in, nullptr, false);
  ASSERT_TRUE(rows.is_array());
  std::map<std::string, int> fabric_rows;  // "pair: fabric" -> rows
  for (const nlohmann::json& r : rows) {
    if (r.value("protocol", "") != "grpc+verbs") continue;
    EXPECT_GT(r.value("bandwidth_gbps", 0.0), 0) << r.dump();
    ++fabric_rows[r.value("pair", "") + ": " + r.value("fabric", "")];
  }
  EXPECT_EQ(fabric_rows, (std::map<std::string, int>{{"same host, alone: shmem (shmem)", 2},
                                                     {"other host, alone: ofi (tcp;ofi_rxm)", 2},
                                                     {"same host, mixed: shmem (shmem)", 2},
                                                     {"other host, mixed: ofi (tcp;ofi_rxm)", 2}}));
}

TEST_F(NetnsTest, ParameterServerStepsAcrossThreeHostsOnABridge) {
  absl::StatusOr<ToolRun> run =
      RunTool({"bench", "ps", "--netns", "--model", "resnet50", "--workers", "2", "--steps", "2",
               "--warmup", "1", "--protocols", "grpc,grpc+verbs"},
              absl::Seconds(280));
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(run->exit_code, 0) << run->out;
  EXPECT_THAT(run->out, HasSubstr("(one netns each)"));
  EXPECT_THAT(run->out, HasSubstr("ofi (tcp;ofi_rxm)"));
  EXPECT_THAT(run->out, HasSubstr("zero copy (grpc+verbs) vs second place (grpc)"));
}

}  // namespace
}  // namespace tensorverbs
