// Protocols across hosts: each task in its own network namespace, joined by veth pairs (and a
// bridge), so that gRPC and libfabric's tcp provider cross a real network path. Needs root;
// skips (saying why) where namespaces cannot be made.
#include "tools/netns.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
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
  // Nor the route that stands in for its link while the link is down.
  absl::StatusOr<std::unique_ptr<Subprocess>> ip =
      Subprocess::Start("/usr/sbin/ip", {"route", "show", "type", "unreachable"});
  ASSERT_TRUE(ip.ok()) << ip.status();
  const std::string routes = (*ip)->ReadAll(absl::Seconds(10));
  ASSERT_TRUE((*ip)->Wait(absl::Seconds(10)).ok());
  EXPECT_THAT(routes, ::testing::Not(HasSubstr(absl::StrCat(
                          "10.", 200 + pid % 50, ".", (pid / 50) % 250, ".0/30 metric 4096"))))
      << "route of pid " << pid << " left behind";
}

// A partition drops a host off the network; it must not send its traffic anywhere else. With the
// link down the kernel deletes its route to the host, and the machine's default route would
// otherwise carry connections out to whatever answers there (here, a gateway that replies HTTP
// 404 to gRPC, which once turned a partition into UNIMPLEMENTED).
// Nothing listens at this port inside a test's namespace: a connection that reaches the host is
// refused, one that cannot is unreachable, and one that connects went somewhere else.
int ConnectErrno(const std::string& address) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(61711);
  inet_pton(AF_INET, address.c_str(), &to.sin_addr);
  timeval limit{.tv_sec = 5, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof(limit));
  const int rc = connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof(to));
  const int error = rc == 0 ? 0 : errno;
  close(fd);
  return error;
}

TEST_F(NetnsTest, APartitionedHostIsUnreachableNotReachedOverTheDefaultRoute) {
  absl::StatusOr<std::unique_ptr<tools::NetnsHost>> host = tools::NetnsHost::Create(62);
  ASSERT_TRUE(host.ok()) << host.status();
  auto connect_errno = [&]() { return ConnectErrno((*host)->remote_address()); };
  EXPECT_EQ(connect_errno(), ECONNREFUSED) << "the host is not reached while its link is up";
  ASSERT_TRUE((*host)->SetLinkUp(false).ok());
  EXPECT_EQ(connect_errno(), EHOSTUNREACH) << "a partitioned host was connected to elsewhere";
  ASSERT_TRUE((*host)->SetLinkUp(true).ok());
  // The kernel's route comes back with the link, ahead of the stand-in.
  EXPECT_EQ(connect_errno(), ECONNREFUSED) << "the healed host is not reached again";
}

// A host with two rails, as a server with two NICs: a veth pair each on its own subnet, each
// limited by a token bucket at both ends, and each failing alone while the other still reaches
// the host.
TEST_F(NetnsTest, ARailedHostHasARateLimitedLinkPerRailAndEachFailsAlone) {
  tools::NetnsHost::Options options;
  options.rails = 2;
  options.rate = "500mbit";
  absl::StatusOr<std::unique_ptr<tools::NetnsHost>> host = tools::NetnsHost::Create(61, options);
  ASSERT_TRUE(host.ok()) << host.status();
  ASSERT_EQ((*host)->rails(), 2);
  EXPECT_EQ((*host)->remote_address(), (*host)->remote_address(0));
  EXPECT_NE((*host)->remote_address(0), (*host)->remote_address(1));
  EXPECT_EQ(ConnectErrno((*host)->remote_address(0)), ECONNREFUSED);
  EXPECT_EQ(ConnectErrno((*host)->remote_address(1)), ECONNREFUSED);
  std::vector<std::string> show = (*host)->ExecPrefix();
  show.insert(show.end(), {"/usr/sbin/tc", "qdisc", "show"});
  absl::StatusOr<std::unique_ptr<Subprocess>> tc =
      Subprocess::Start(show[0], {show.begin() + 1, show.end()});
  ASSERT_TRUE(tc.ok()) << tc.status();
  const std::string qdiscs = (*tc)->ReadAll(absl::Seconds(10));
  ASSERT_TRUE((*tc)->Wait(absl::Seconds(10)).ok());
  EXPECT_THAT(qdiscs, HasSubstr("tbf")) << qdiscs;
  EXPECT_THAT(qdiscs, HasSubstr("rate 500Mbit")) << qdiscs;
  // Rail 1 fails: its address is unreachable, rail 0 still reaches the host.
  ASSERT_TRUE((*host)->SetRailUp(1, false).ok());
  EXPECT_EQ(ConnectErrno((*host)->remote_address(1)), EHOSTUNREACH);
  EXPECT_EQ(ConnectErrno((*host)->remote_address(0)), ECONNREFUSED);
  ASSERT_TRUE((*host)->SetRailUp(1, true).ok());
  EXPECT_EQ(ConnectErrno((*host)->remote_address(1)), ECONNREFUSED);
  EXPECT_EQ((*host)->SetRailUp(2, false).code(), absl::StatusCode::kInvalidArgument);
  tools::NetnsHost::Options too_many;
  too_many.rails = tools::NetnsHost::kMaxRails + 1;
  EXPECT_EQ(tools::NetnsHost::Create(60, too_many).status().code(),
            absl::StatusCode::kInvalidArgument);
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
