// TaskPlacement from a launcher's variables (include/tensorverbs/placement.h): Slurm's host
// lists and task counts as srun sets them, TF_CONFIG, and every malformed variable named; and
// the ports PickFreePorts hands to the tasks a process starts.
#include "tensorverbs/placement.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>

namespace tensorverbs {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(PlacementTest, HostListsExpandAsSlurmWritesThem) {
  EXPECT_THAT(*ExpandHostList("node[01-03,07],gpu-a"),
              ElementsAre("node01", "node02", "node03", "node07", "gpu-a"));
  EXPECT_THAT(*ExpandHostList("r[1-2]n[8-9]"), ElementsAre("r1n8", "r1n9", "r2n8", "r2n9"));
  EXPECT_THAT(*ExpandHostList("single"), ElementsAre("single"));
  EXPECT_THAT(*ExpandHostList("n[9-11]"), ElementsAre("n9", "n10", "n11"));
  for (const char* bad : {"n[1-", "n]1[", "n[3-1]", "n[a]", "a,,b", "n[0-99999999]"}) {
    absl::StatusOr<std::vector<std::string>> got = ExpandHostList(bad);
    ASSERT_FALSE(got.ok()) << bad;
    EXPECT_THAT(std::string(got.status().message()), HasSubstr("SLURM_JOB_NODELIST")) << bad;
  }
}

TEST(PlacementTest, TaskCountsExpandAsSlurmWritesThem) {
  EXPECT_THAT(*ExpandTasksPerNode("2(x3),1"), ElementsAre(2, 2, 2, 1));
  EXPECT_THAT(*ExpandTasksPerNode("4"), ElementsAre(4));
  for (const char* bad : {"0", "2(x0)", "2(3)", "x", "2(x3", ""}) {
    EXPECT_FALSE(ExpandTasksPerNode(bad).ok()) << bad;
  }
}

std::map<std::string, std::string> Slurm(const std::string& procid) {
  return {{"SLURM_JOB_NODELIST", "node[1-2]"},
          {"SLURM_TASKS_PER_NODE", "2(x2)"},
          {"SLURM_NTASKS", "4"},
          {"SLURM_PROCID", procid},
          {"TENSORVERBS_SLURM_JOBS", "ps:1,worker:3"},
          {"TENSORVERBS_SLURM_PORT", "9000"}};
}

TEST(PlacementTest, SlurmRanksFillTheHostsInOrderAndTheJobsByRankRanges) {
  absl::StatusOr<TaskPlacement> p = PlacementFromVariables("slurm", Slurm("2"));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->job, "worker");
  EXPECT_EQ(p->task, 1);
  EXPECT_EQ(p->cluster.ToString(), "ps=node1:9000;worker=node1:9001,node2:9000,node2:9001");
  p = PlacementFromVariables("slurm", Slurm("0"));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->job, "ps");
  EXPECT_EQ(p->task, 0);
  // Without jobs or a port: every rank a worker, from port 8888; the step's lists win.
  std::map<std::string, std::string> vars = {{"SLURM_JOB_NODELIST", "a,b,c"},
                                             {"SLURM_STEP_NODELIST", "a,b"},
                                             {"SLURM_STEP_TASKS_PER_NODE", "1,2"},
                                             {"SLURM_PROCID", "1"}};
  p = PlacementFromVariables("slurm", vars);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->cluster.ToString(), "worker=a:8888,b:8888,b:8889");
  EXPECT_EQ(p->task, 1);
}

TEST(PlacementTest, ABadSlurmEnvironmentNamesTheVariable) {
  struct Case {
    std::string variable, value, says;
  };
  for (const Case& c : std::vector<Case>{
           {"SLURM_PROCID", "4", "SLURM_PROCID"},
           {"SLURM_PROCID", "-1", "SLURM_PROCID"},
           {"SLURM_NTASKS", "5", "SLURM_NTASKS"},
           {"SLURM_TASKS_PER_NODE", "2(x3)", "names 2 hosts"},
           {"TENSORVERBS_SLURM_JOBS", "ps:1,worker:2", "counts 3 tasks"},
           {"TENSORVERBS_SLURM_JOBS", "ps:1,ps:3", "twice"},
           {"TENSORVERBS_SLURM_JOBS", "ps", "JOB:COUNT"},
           {"TENSORVERBS_SLURM_PORT", "65535", "fewer ports"},
           {"TENSORVERBS_SLURM_PORT", "http", "TENSORVERBS_SLURM_PORT"},
           // The settings table's range, as for every variable.
           {"TENSORVERBS_SLURM_PORT", "0", "[1, 65535]"},
           {"TENSORVERBS_SLURM_PORT", "70000", "[1, 65535]"},
           {"SLURM_JOB_NODELIST", "node[1-", "SLURM_JOB_NODELIST"},
       }) {
    std::map<std::string, std::string> vars = Slurm("1");
    vars[c.variable] = c.value;
    absl::StatusOr<TaskPlacement> p = PlacementFromVariables("slurm", vars);
    ASSERT_FALSE(p.ok()) << c.variable << "=" << c.value;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(p.status().message()), HasSubstr(c.says)) << p.status();
  }
  absl::StatusOr<TaskPlacement> none = PlacementFromVariables("slurm", {});
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("srun"));
  std::map<std::string, std::string> no_rank = Slurm("0");
  no_rank.erase("SLURM_PROCID");
  EXPECT_THAT(std::string(PlacementFromVariables("slurm", no_rank).status().message()),
              HasSubstr("SLURM_PROCID"));
}

TEST(PlacementTest, TfConfigGivesTheClusterAndTheTask) {
  absl::StatusOr<TaskPlacement> p = PlacementFromVariables(
      "tf_config", {{"TF_CONFIG",
                     R"({"cluster": {"ps": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]},
                         "task": {"type": "worker", "index": 1}})"}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->job, "worker");
  EXPECT_EQ(p->task, 1);
  EXPECT_EQ(p->cluster.NumTasks("worker"), 2);
  for (const char* bad : {"", "[1]", R"({"cluster": {"ps": ["h0:2222"]}})",
                          R"({"cluster": {"ps": ["h0:2222"]}, "task": {"type": "ps", "index": 3}})",
                          R"({"cluster": {"ps": ["h0:2222"]}, "task": {"type": "ps"}})"}) {
    absl::StatusOr<TaskPlacement> q = PlacementFromVariables("tf_config", {{"TF_CONFIG", bad}});
    ASSERT_FALSE(q.ok()) << bad;
    EXPECT_THAT(std::string(q.status().message()), HasSubstr("TF_CONFIG")) << bad;
  }
  EXPECT_THAT(std::string(PlacementFromVariables("k8s", {}).status().message()),
              HasSubstr("slurm or tf_config"));
}

// True when `port` of 127.0.0.1 can be bound (and is released again).
bool Bindable(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

TEST(PickFreePortsTest, PortsAreDistinctFreeAndOutsideTheEphemeralRange) {
  int lo = 32768, hi = 60999;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    ASSERT_EQ(std::fscanf(f, "%d %d", &lo, &hi), 2);
    std::fclose(f);
  }
  absl::StatusOr<std::vector<int>> ports = PickFreePorts(50);
  ASSERT_TRUE(ports.ok()) << ports.status();
  ASSERT_EQ(ports->size(), 50u);
  EXPECT_EQ(std::set<int>(ports->begin(), ports->end()).size(), 50u);
  for (int p : *ports) {
    EXPECT_TRUE(p < lo || p > hi) << p << " is in the ephemeral range " << lo << "-" << hi;
    EXPECT_GE(p, 10000);
    EXPECT_TRUE(Bindable(p)) << p;
  }
}

TEST(PickFreePortsTest, APickedPortIsKeptFromEveryOtherPickerWhileThisProcessLives) {
  absl::StatusOr<std::vector<int>> mine = PickFreePorts(20);
  ASSERT_TRUE(mine.ok()) << mine.status();
  // The reservation other pickers (the Python package's, the torch backend's) look for.
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string name = "tensorverbs/port/" + std::to_string((*mine)[0]);
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  EXPECT_NE(bind(fd, reinterpret_cast<sockaddr*>(&addr), len), 0);
  EXPECT_EQ(errno, EADDRINUSE);
  close(fd);
  // Another process picking many never gets one of them.
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    absl::StatusOr<std::vector<int>> theirs = PickFreePorts(500);
    int code = theirs.ok() ? 0 : 2;
    if (theirs.ok()) {
      for (int p : *theirs) {
        if (write(out[1], &p, sizeof(p)) != sizeof(p)) code = 3;
      }
    }
    _exit(code);
  }
  close(out[1]);
  std::set<int> theirs;
  int p = 0;
  while (read(out[0], &p, sizeof(p)) == sizeof(p)) theirs.insert(p);
  close(out[0]);
  int wstatus = 0;
  ASSERT_EQ(waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) << wstatus;
  EXPECT_EQ(theirs.size(), 500u);
  for (int q : *mine) EXPECT_EQ(theirs.count(q), 0u) << q << " was handed out twice";
}

TEST(PickFreePortsTest, AHostThatIsNotAnAddressIsRefused) {
  absl::StatusOr<std::vector<int>> ports = PickFreePorts(1, "not-an-address");
  EXPECT_EQ(ports.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ports.status().message(), HasSubstr("not-an-address"));
}

}  // namespace
}  // namespace tensorverbs
