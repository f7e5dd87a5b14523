// Rails chosen by count (fabric::ChooseRails) over made-up hosts, and TENSORVERBS_RAILS's two
// forms (ParseRails), with the values that must be refused.
#include "src/fabric/rails.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "src/fabric/pci_topology.h"

namespace tensorverbs::fabric {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

NetInterface Up(const std::string& name, const std::string& address, int prefix, int node) {
  NetInterface i;
  i.name = name;
  i.address = address;
  i.prefix_length = prefix;
  i.up = true;
  i.numa_node = node;
  return i;
}

// A GPU server: the task's address on eth0, four rails on two NUMA nodes, each on its own /24,
// loopback, a docker bridge without carrier, and a second address on eth0's network.
std::vector<NetInterface> FourRailHost() {
  NetInterface lo = Up("lo", "127.0.0.1", 8, -1);
  lo.loopback = true;
  NetInterface docker = Up("docker0", "172.17.0.1", 16, -1);
  docker.up = false;
  return {lo,
          Up("eth0", "10.0.0.5", 24, 0),
          Up("eth0", "10.0.0.6", 24, 0),
          Up("rail3", "10.3.0.5", 24, 1),
          Up("rail1", "10.1.0.5", 24, 0),
          Up("rail2", "10.2.0.5", 24, 1),
          Up("rail0", "10.4.0.5", 24, 0),
          docker};
}

TEST(ChooseRailsTest, TheTasksNodeComesFirstThenNamesAndNeverItsOwnNetwork) {
  RailPlan on_node0 = ChooseRails(FourRailHost(), "10.0.0.5", 3, /*numa_node=*/0);
  EXPECT_THAT(on_node0.rails, ElementsAre("10.4.0.5", "10.1.0.5", "10.2.0.5"));
  RailPlan on_node1 = ChooseRails(FourRailHost(), "10.0.0.5", 2, /*numa_node=*/1);
  EXPECT_THAT(on_node1.rails, ElementsAre("10.2.0.5", "10.3.0.5"));
  // Unknown node: by name alone.
  RailPlan unknown = ChooseRails(FourRailHost(), "10.0.0.5", 3, -1);
  EXPECT_THAT(unknown.rails, ElementsAre("10.4.0.5", "10.1.0.5", "10.2.0.5"));

  // Every interface address is explained, the taken ones by rail number.
  const std::string all = ::testing::PrintToString(on_node0.considered);
  EXPECT_EQ(on_node0.considered.size(), FourRailHost().size());
  EXPECT_THAT(all, HasSubstr("rail0 (10.4.0.5/24, NUMA node 0): rail 1, on the task's NUMA node"));
  EXPECT_THAT(all, HasSubstr("rail3 (10.3.0.5/24, NUMA node 1): passed over, 3 rails taken"));
  EXPECT_THAT(all, HasSubstr("lo (127.0.0.1/8, NUMA node unknown): passed over, loopback"));
  EXPECT_THAT(all, HasSubstr("docker0 (172.17.0.1/16, NUMA node unknown): passed over, down"));
  EXPECT_THAT(all, HasSubstr("eth0 (10.0.0.6/24, NUMA node 0): passed over, the task's own"));
}

// A GPU server whose GPU sits under the PCIe switch of rail3, across the host bridge from rail1
// and rail0 (root complex pci0000:00, the GPU's), and under another root complex from rail2.
TEST(ChooseRailsTest, ForTensorsOnAGpuTheRailsFewestPcieLinksFromItComeFirst) {
  std::vector<NetInterface> host = FourRailHost();
  for (NetInterface& i : host) {
    if (i.name == "rail3")
      i.pci_path = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0";
    if (i.name == "rail1") i.pci_path = "/sys/devices/pci0000:00/0000:00:03.0/0000:06:00.0";
    if (i.name == "rail0") i.pci_path = "/sys/devices/pci0000:00/0000:00:03.0/0000:06:00.1";
    if (i.name == "rail2") i.pci_path = "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0";
  }
  const std::string gpu =
      "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0";
  // Two rails for a task on node 0: rail3 (4 links, under the GPU's switch, though on node 1),
  // then one of rail0 and rail1 (6 links each; rail0 by name), numbered by name.
  RailPlan near = ChooseRails(host, "10.0.0.5", 2, /*numa_node=*/0, gpu);
  EXPECT_THAT(near.rails, ElementsAre("10.4.0.5", "10.3.0.5"));
  const std::string all = ::testing::PrintToString(near.considered);
  EXPECT_THAT(all, HasSubstr("rail3 (10.3.0.5/24, NUMA node 1): rail 2, on another NUMA node, "
                             "4 PCIe links from the GPU"));
  EXPECT_THAT(all, HasSubstr("rail2 (10.2.0.5/24, NUMA node 1): passed over, 2 rails taken "
                             "before it, on another NUMA node, not under the GPU's PCIe root"));
  // Without a GPU: by node, as before.
  EXPECT_THAT(ChooseRails(host, "10.0.0.5", 2, 0).rails, ElementsAre("10.4.0.5", "10.1.0.5"));
}

TEST(PciHopsTest, LinksUpToTheClosestCommonBridge) {
  const std::string a = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0";
  EXPECT_EQ(PciHops(a, a), 0);
  EXPECT_EQ(PciHops(a, "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0"), 2);
  EXPECT_EQ(PciHops(a, "/sys/devices/pci0000:00/0000:00:02.0"), 4);
  EXPECT_EQ(PciHops(a, "/sys/devices/pci0000:00/0000:00:01.0"), 2) << "its own upstream bridge";
  // Another root complex, an unknown place, or a path outside the PCI tree.
  EXPECT_EQ(PciHops(a, "/sys/devices/pci0000:80/0000:80:01.0"), -1);
  EXPECT_EQ(PciHops(a, ""), -1);
  EXPECT_EQ(PciHops("/sys/devices/virtual/net/veth0", a), -1);
  EXPECT_EQ(PciPathOfBusId("0000:FF:1F.7"), "") << "a bus id this host lacks";
  EXPECT_EQ(PciPathOfBusId("../../etc"), "");
  EXPECT_EQ(PciPathOfBusId(""), "");
}

TEST(ChooseRailsTest, EachRailIsANetworkOfItsOwnAndFewerThanAskedIsNoError) {
  // Two addresses on one further network make one rail; and an interface on the task's network
  // under another name is no rail either.
  std::vector<NetInterface> host = {Up("eth0", "10.0.0.5", 24, -1), Up("eth1", "10.1.0.5", 24, -1),
                                    Up("eth1b", "10.1.0.6", 24, -1),
                                    Up("eth9", "10.0.0.9", 24, -1)};
  RailPlan plan = ChooseRails(host, "10.0.0.5", 3, -1);
  EXPECT_THAT(plan.rails, ElementsAre("10.1.0.5"));
  const std::string all = ::testing::PrintToString(plan.considered);
  EXPECT_THAT(all, HasSubstr("eth1b (10.1.0.6/24, NUMA node unknown): passed over, on the "
                             "network of a rail taken before it"));
  EXPECT_THAT(all, HasSubstr("eth9 (10.0.0.9/24, NUMA node unknown): passed over, on the network "
                             "of the task's own address"));
  // A host with one network has no rail to give.
  EXPECT_TRUE(ChooseRails({Up("eth0", "10.0.0.5", 24, 0)}, "10.0.0.5", 1, 0).rails.empty());
}

TEST(ChooseRailsTest, AnUnknownOwnAddressTakesNoRails) {
  for (const char* own : {"", "fe80::1", "10.9.9.9x"}) {
    RailPlan plan = ChooseRails(FourRailHost(), own, 3, -1);
    EXPECT_TRUE(plan.rails.empty()) << own;
    ASSERT_EQ(plan.considered.size(), 1u);
    EXPECT_THAT(plan.considered[0], HasSubstr("no rails chosen"));
  }
}

// Lanes pair in order at set-up: two tasks on different NUMA nodes of hosts built alike take
// the same rails in the same order, whatever their rank.
TEST(ChooseRailsTest, RailsAreNumberedByNameWhateverTheTasksNode) {
  const std::vector<NetInterface> host = {Up("eth0", "10.0.0.5", 24, 0),
                                          Up("nic-b", "10.2.0.5", 24, 1),
                                          Up("nic-a", "10.1.0.5", 24, 0)};
  const RailPlan on_node1 = ChooseRails(host, "10.0.0.5", 2, 1);
  const RailPlan on_node0 = ChooseRails(host, "10.0.0.5", 2, 0);
  EXPECT_THAT(on_node1.rails, ElementsAre("10.1.0.5", "10.2.0.5"));
  EXPECT_EQ(on_node0.rails, on_node1.rails);
  // With one rail, the node decides which.
  EXPECT_THAT(ChooseRails(host, "10.0.0.5", 1, 1).rails, ElementsAre("10.2.0.5"));
  EXPECT_THAT(ChooseRails(host, "10.0.0.5", 1, 0).rails, ElementsAre("10.1.0.5"));
}

TEST(ChooseRailsTest, BridgesNeverVirtualLastOneAddressPerInterface) {
  NetInterface bridge = Up("docker0", "172.17.0.1", 16, -1);
  bridge.bridge = true;
  NetInterface veth = Up("aveth", "10.5.0.5", 24, -1);
  veth.virtual_interface = true;
  const std::vector<NetInterface> host = {Up("eth0", "10.0.0.5", 24, 0), bridge, veth,
                                          Up("ib0", "10.6.0.5", 24, 1),
                                          Up("ib0", "10.7.0.5", 24, 1)};
  const RailPlan plan = ChooseRails(host, "10.0.0.5", 3, 0);
  EXPECT_THAT(plan.rails, ElementsAre("10.5.0.5", "10.6.0.5"));
  const std::string all = ::testing::PrintToString(plan.considered);
  EXPECT_THAT(all, HasSubstr("docker0 (172.17.0.1/16, NUMA node unknown): passed over, a bridge"));
  EXPECT_THAT(all, HasSubstr("ib0 (10.7.0.5/24, NUMA node 1): passed over, another address of "
                             "an interface taken before it"));
  EXPECT_THAT(all, HasSubstr("aveth (10.5.0.5/24, NUMA node unknown): rail 1, virtual"));
  // A wider network holding the task's own is the task's network too.
  const RailPlan wide =
      ChooseRails({Up("eth0", "10.0.0.5", 24, 0), Up("eth1", "10.0.9.5", 16, 0)}, "10.0.0.5", 1, 0);
  EXPECT_TRUE(wide.rails.empty());
}

TEST(ParseRailsTest, ACountOrAList) {
  absl::StatusOr<RailsSpec> count = ParseRails(" 2 ", kMaxRails);
  ASSERT_TRUE(count.ok()) << count.status();
  EXPECT_EQ(count->count, 2);
  EXPECT_TRUE(count->listed.empty());
  absl::StatusOr<RailsSpec> none = ParseRails("0", kMaxRails);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->count, 0);
  EXPECT_TRUE(none->listed.empty());
  absl::StatusOr<RailsSpec> list = ParseRails("10.1.0.5, eth2", kMaxRails);
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->count, 0);
  EXPECT_THAT(list->listed, ElementsAre("10.1.0.5", "eth2"));
}

TEST(ParseRailsTest, CountsAndListsBeyondTheLimitNameTheVariable) {
  for (const char* bad : {"4", "-1", "99"}) {
    absl::StatusOr<RailsSpec> spec = ParseRails(bad, kMaxRails);
    ASSERT_FALSE(spec.ok()) << bad;
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(spec.status().message()), HasSubstr("TENSORVERBS_RAILS"));
    EXPECT_THAT(std::string(spec.status().message()), HasSubstr("0 to 3"));
  }
  absl::StatusOr<RailsSpec> many = ParseRails("a,b,c,d", kMaxRails);
  ASSERT_FALSE(many.ok());
  EXPECT_THAT(std::string(many.status().message()), HasSubstr("at most 3 beside its first"));
}

TEST(ReadInterfacesTest, FindsLoopbackAsLoopback) {
  bool found = false;
  for (const NetInterface& i : ReadInterfaces()) {
    if (i.address == "127.0.0.1") {
      found = true;
      EXPECT_TRUE(i.loopback);
      EXPECT_EQ(i.prefix_length, 8);
    }
  }
  EXPECT_TRUE(found) << "every host has 127.0.0.1";
}

TEST(Ipv4OfTest, ALiteralIsItselfAndLocalhostResolves) {
  EXPECT_EQ(Ipv4Of("10.1.2.3"), "10.1.2.3");
  EXPECT_EQ(Ipv4Of("localhost"), "127.0.0.1");
  EXPECT_EQ(Ipv4Of(""), "");
}

}  // namespace
}  // namespace tensorverbs::fabric
