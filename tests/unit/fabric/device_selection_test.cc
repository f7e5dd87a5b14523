#include "src/fabric/ibverbs/device_selection.h"

#include <algorithm>

#include "src/fabric/fabric.h"

#include <arpa/inet.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace tensorverbs::fabric::ibverbs {
namespace {

using ::testing::HasSubstr;

GidEntry Gid(int index, GidType type, const char* text) {
  GidEntry g;
  g.index = index;
  g.type = type;
  inet_pton(AF_INET6, text, g.gid.data());
  return g;
}

PortInfo RocePort(int port, bool active, int mtu = 1024) {
  PortInfo p;
  p.port = port;
  p.active = active;
  p.state = active ? "ACTIVE" : "DOWN";
  p.link_layer = LinkLayer::kEthernet;
  p.active_mtu = mtu;
  p.gids = {Gid(0, GidType::kRoCEv1, "fe80::1"), Gid(1, GidType::kRoCEv2, "fe80::1"),
            Gid(2, GidType::kRoCEv1, "::ffff:10.0.0.5"), Gid(3, GidType::kRoCEv2, "::ffff:10.0.0.5")};
  return p;
}

Inventory OneNic() { return Inventory{{DeviceInfo{"mlx5_0", {RocePort(1, true)}}}}; }

TEST(DeviceSelection, PicksTheOnlyActivePortAndPrefersRoceV2Ipv4) {
  absl::StatusOr<Selection> s = SelectDevice(OneNic(), RdmaConfig());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->device, "mlx5_0");
  EXPECT_EQ(s->port, 1);
  EXPECT_EQ(s->gid_index, 3);
  EXPECT_EQ(s->gid_type, GidType::kRoCEv2);
  EXPECT_EQ(GidToString(s->gid), "::ffff:10.0.0.5");
  EXPECT_EQ(s->mtu, 1024) << "the port's active MTU by default";
  EXPECT_THAT(s->reason, HasSubstr("RoCEv2 IPv4"));
}

TEST(DeviceSelection, FallsBackThroughGidClasses) {
  Inventory inv = OneNic();
  auto& gids = inv.devices[0].ports[0].gids;
  gids.erase(gids.begin() + 3);  // no RoCEv2 IPv4
  EXPECT_EQ(SelectDevice(inv, RdmaConfig())->gid_index, 1) << "RoCEv2 link-local next";
  gids = {Gid(5, GidType::kRoCEv1, "fe80::2"), Gid(4, GidType::kRoCEv1, "fe80::3")};
  EXPECT_EQ(SelectDevice(inv, RdmaConfig())->gid_index, 4) << "then RoCEv1, lowest index";
  gids.clear();
  absl::StatusOr<Selection> none = SelectDevice(inv, RdmaConfig());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(none.status().message(), HasSubstr("RDMA_GID_INDEX"));
}

TEST(DeviceSelection, InfiniBandUsesItsGidAndLid) {
  PortInfo ib;
  ib.port = 1;
  ib.active = true;
  ib.state = "ACTIVE";
  ib.link_layer = LinkLayer::kInfiniBand;
  ib.active_mtu = 4096;
  ib.lid = 17;
  ib.gids = {Gid(0, GidType::kIB, "fe80::2:c903:1")};
  absl::StatusOr<Selection> s = SelectDevice(Inventory{{DeviceInfo{"mlx4_0", {ib}}}}, RdmaConfig());
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->lid, 17);
  EXPECT_EQ(s->gid_index, 0);
  EXPECT_EQ(s->mtu, 4096);
}

TEST(DeviceSelection, NoDeviceNoActivePortAndUnknownNames) {
  EXPECT_EQ(SelectDevice(Inventory(), RdmaConfig()).status().code(), absl::StatusCode::kUnavailable);
  Inventory down{{DeviceInfo{"mlx5_0", {RocePort(1, false)}}}};
  absl::StatusOr<Selection> s = SelectDevice(down, RdmaConfig());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.status().message(), HasSubstr("mlx5_0 port 1: DOWN"));
  RdmaConfig named;
  named.device = "mlx5_9";
  s = SelectDevice(OneNic(), named);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("RDMA_DEVICE=mlx5_9"));
  EXPECT_THAT(s.status().message(), HasSubstr("devices: mlx5_0"));
  RdmaConfig port;
  port.port = 2;
  s = SelectDevice(OneNic(), port);
  EXPECT_THAT(s.status().message(), HasSubstr("RDMA_DEVICE_PORT=2"));
}

// For a task whose tensors live on a GPU, the NIC fewest PCIe links from it comes first, then
// those under another root complex by node.
TEST(DeviceSelection, ForTensorsOnAGpuTheNicNearestItRanksFirst) {
  DeviceInfo a{"mlx5_0",
               {RocePort(1, true)},
               /*numa_node=*/0,
               "/sys/devices/pci0000:00/0000:00:02.0/0000:05:00.0"};
  DeviceInfo b{"mlx5_1",
               {RocePort(1, true)},
               /*numa_node=*/1,
               "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:00.0"};
  DeviceInfo c{"mlx5_2",
               {RocePort(1, true)},
               /*numa_node=*/1,
               "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:01.0"};
  const Inventory three{{a, b, c}};
  const std::string gpu = "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:02.0";
  absl::StatusOr<std::vector<Selection>> ranked = RankPorts(three, RdmaConfig(), 0, gpu);
  ASSERT_TRUE(ranked.ok()) << ranked.status();
  ASSERT_EQ(ranked->size(), 3u);
  EXPECT_EQ((*ranked)[0].device, "mlx5_1");
  EXPECT_EQ((*ranked)[1].device, "mlx5_2");
  EXPECT_EQ((*ranked)[2].device, "mlx5_0") << "on the task's node, but across the CPU";
  EXPECT_THAT((*ranked)[0].reason, HasSubstr("2 PCIe links from the GPU, across the socket"));
  EXPECT_THAT((*ranked)[2].reason, HasSubstr("not under the GPU's PCIe root, on the task's NUMA"));
  EXPECT_EQ(SelectDevice(three, RdmaConfig(), 0, gpu)->device, "mlx5_1") << "the first lane's too";
  // Without a GPU, by node.
  EXPECT_EQ((*RankPorts(three, RdmaConfig(), 0))[0].device, "mlx5_0");
}

// Several active ports: ranked for the task by NUMA node (the NIC on the task's node first,
// then one the kernel says nothing of, then the far ones), each group by name and port; the
// reason names the rank, the ports and the way to pick another.
TEST(DeviceSelection, SeveralActivePortsAreRankedByTheTasksNumaNode) {
  DeviceInfo a{"mlx5_0", {RocePort(1, true)}, /*numa_node=*/0};
  DeviceInfo b{"mlx5_1", {RocePort(1, true)}, /*numa_node=*/1};
  DeviceInfo c{"mlx5_2", {RocePort(1, true)}, /*numa_node=*/-1};
  const Inventory three{{a, b, c}};
  absl::StatusOr<std::vector<Selection>> on1 = RankPorts(three, RdmaConfig(), /*numa_node=*/1);
  ASSERT_TRUE(on1.ok()) << on1.status();
  ASSERT_EQ(on1->size(), 3u);
  EXPECT_EQ((*on1)[0].device, "mlx5_1");
  EXPECT_EQ((*on1)[1].device, "mlx5_2") << "a node the kernel does not say before a far one";
  EXPECT_EQ((*on1)[2].device, "mlx5_0");
  EXPECT_THAT((*on1)[0].reason, HasSubstr("rank 1 of 3 active ports"));
  EXPECT_THAT((*on1)[0].reason, HasSubstr("on the task's NUMA node (the task runs on node 1)"));
  EXPECT_THAT((*on1)[0].reason, HasSubstr("RDMA_DEVICE and RDMA_DEVICE_PORT pick another"));
  EXPECT_THAT((*on1)[2].reason, HasSubstr("across the socket link"));
  EXPECT_EQ(SelectDevice(three, RdmaConfig(), 0)->device, "mlx5_0");
  // The task's node unknown: by name.
  EXPECT_EQ(SelectDevice(three, RdmaConfig(), -1)->device, "mlx5_0");
  // A device named alone is the choice, wherever it is.
  RdmaConfig pick;
  pick.device = "mlx5_1";
  EXPECT_EQ(SelectDevice(three, pick, 0)->device, "mlx5_1");
  // One device of two ports: both active, port 1 first; RDMA_DEVICE_PORT picks the other.
  Inventory dual{{DeviceInfo{"mlx5_0", {RocePort(1, true), RocePort(2, true)}}}};
  EXPECT_EQ(SelectDevice(dual, RdmaConfig{.device = "mlx5_0"})->port, 1);
  EXPECT_EQ(SelectDevice(dual, RdmaConfig{.device = "mlx5_0", .port = 2})->port, 2);
  // A down port is not ranked.
  Inventory one_up{{DeviceInfo{"mlx5_0", {RocePort(1, false)}, 1},
                    DeviceInfo{"mlx5_1", {RocePort(1, true)}, 0}}};
  absl::StatusOr<std::vector<Selection>> up = RankPorts(one_up, RdmaConfig(), 1);
  ASSERT_TRUE(up.ok()) << up.status();
  ASSERT_EQ(up->size(), 1u);
  EXPECT_EQ((*up)[0].device, "mlx5_1");
  EXPECT_THAT((*up)[0].reason, HasSubstr("the only active port (mlx5_1 port 1)"));
}

// RDMA_DEVICE may list devices: they are ranked in its order, whatever their nodes; every name
// must be on this host, and a name given twice counts once.
TEST(DeviceSelection, AListInRdmaDeviceIsTakenInItsOrderAndEachNameMustExist) {
  const Inventory three{{DeviceInfo{"mlx5_0", {RocePort(1, true)}, 0},
                         DeviceInfo{"mlx5_1", {RocePort(1, true)}, 1},
                         DeviceInfo{"mlx5_2", {RocePort(1, true)}, 0}}};
  RdmaConfig list;
  list.device = "mlx5_2, mlx5_1,mlx5_2";
  absl::StatusOr<std::vector<Selection>> ranked = RankPorts(three, list, /*numa_node=*/1);
  ASSERT_TRUE(ranked.ok()) << ranked.status();
  ASSERT_EQ(ranked->size(), 2u);
  EXPECT_EQ((*ranked)[0].device, "mlx5_2");
  EXPECT_EQ((*ranked)[1].device, "mlx5_1");
  EXPECT_THAT((*ranked)[0].reason, HasSubstr("RDMA_DEVICE's choice 1 of 2"));
  list.device = "mlx5_1,mlx5_7";
  absl::StatusOr<Selection> bad = SelectDevice(three, list);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("names mlx5_7, which is not on this host"));
  EXPECT_THAT(bad.status().message(), HasSubstr("devices: mlx5_0, mlx5_1, mlx5_2"));
  // A port whose GID the settings cannot have is passed over while another can serve.
  Inventory mixed = three;
  mixed.devices[0].ports[0].gids.clear();
  EXPECT_EQ(SelectDevice(mixed, RdmaConfig(), 0)->device, "mlx5_2");
}

TEST(DeviceSelection, ExplicitGidAndMtu) {
  RdmaConfig c;
  c.gid_index = 0;
  EXPECT_EQ(SelectDevice(OneNic(), c)->gid_type, GidType::kRoCEv1);
  c.gid_index = 9;
  absl::StatusOr<Selection> s = SelectDevice(OneNic(), c);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("RDMA_GID_INDEX=9"));
  EXPECT_THAT(s.status().message(), HasSubstr("3 (RoCEv2 ::ffff:10.0.0.5)"));
  RdmaConfig mtu;
  mtu.mtu = 1024;
  EXPECT_EQ(SelectDevice(OneNic(), mtu)->mtu, 1024) << "equal to the active MTU is valid";
  mtu.mtu = 512;
  EXPECT_EQ(SelectDevice(OneNic(), mtu)->mtu, 512);
  mtu.mtu = 4096;
  s = SelectDevice(OneNic(), mtu);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("RDMA_QP_MTU=4096 exceeds the active MTU 1024"));
}

}  // namespace
}  // namespace tensorverbs::fabric::ibverbs

namespace tensorverbs::fabric {
namespace {

TEST(OfiProviderPolicy, ConfiguredThenHardwareThenShmForLocalPeersThenTcp) {
  const std::vector<std::string> here = {"tcp;ofi_rxm (127.0.0.1/32)", "shm (shm)", "sockets (x)"};
  EXPECT_EQ(ChooseOfiProvider("sockets", true, here), "sockets") << "TENSORVERBS_OFI_PROVIDER wins";
  EXPECT_EQ(ChooseOfiProvider("", true, here), "shm");
  EXPECT_EQ(ChooseOfiProvider("", false, here), "tcp;ofi_rxm");
  std::vector<std::string> nic = here;
  nic.push_back("verbs;ofi_rxm (mlx5_0)");
  nic.push_back("efa (efa_0)");
  EXPECT_EQ(ChooseOfiProvider("", true, nic), "verbs;ofi_rxm") << "hardware is preferred";
  EXPECT_EQ(ChooseOfiProvider("", false, {"efa"}), "efa");
  EXPECT_EQ(ChooseOfiProvider("", true, {"tcp;ofi_rxm"}), "tcp;ofi_rxm") << "no shm here";
}

TEST(OfiProviderPolicy, ListsWhatThisHostHas) {
  std::vector<std::string> names;
  for (const std::string& line : ListOfiProviders()) names.push_back(line.substr(0, line.find(" (")));
  EXPECT_NE(std::find(names.begin(), names.end(), "tcp;ofi_rxm"), names.end());
  EXPECT_EQ(ChooseOfiProvider("", false, ListOfiProviders()), "tcp;ofi_rxm");
}

}  // namespace
}  // namespace tensorverbs::fabric
