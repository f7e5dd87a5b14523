// Choosing the RDMA device, port, GID and MTU for the ibverbs backend from what the host has
// (an Inventory) and the seed's RDMA_* variables (RdmaConfig).
//
// A host may have several NICs, each close to one socket. The active ports are ranked for the
// task (RankPorts): in the order RDMA_DEVICE lists them, when it lists several; otherwise those
// on the task's NUMA node first (a NIC across the socket link reaches the task's memory through
// it), then those whose node the kernel does not say, then the rest, each group by name and
// port. SelectDevice takes the first, and says why in its reason; with one device nothing of
// this changes. Lanes over several devices take more of the same ranking.
//
// The choice is a pure function so every rule and every error is testable without a NIC; the
// inventory is read from libibverbs by inventory.h. Unlike TensorFlow, selection never aborts:
// no candidate, or several where one is needed, is an error that lists the devices, ports and
// GIDs seen and names the variable to set. An RDMA_QP_MTU equal to the port's active MTU is
// valid (TensorFlow rejected it). Pure functions; any thread.
#ifndef TENSORVERBS_FABRIC_IBVERBS_DEVICE_SELECTION_H_
#define TENSORVERBS_FABRIC_IBVERBS_DEVICE_SELECTION_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "src/common/config.h"

namespace tensorverbs::fabric::ibverbs {

enum class LinkLayer { kInfiniBand, kEthernet, kUnknown };
enum class GidType { kIB, kRoCEv1, kRoCEv2 };

struct GidEntry {
  int index = 0;
  std::array<uint8_t, 16> gid{};
  GidType type = GidType::kIB;
};

struct PortInfo {
  int port = 1;
  bool active = false;
  std::string state;  // "ACTIVE", "DOWN", ...
  LinkLayer link_layer = LinkLayer::kUnknown;
  int active_mtu = 0;  // bytes
  uint16_t lid = 0;
  std::vector<GidEntry> gids;  // valid entries only
};

struct DeviceInfo {
  std::string name;
  std::vector<PortInfo> ports;
  int numa_node = -1;  // the NIC's, from sysfs; -1 where the kernel does not say
  std::string pci_path{};  // its sysfs path (pci_topology.h); empty where unknown
};

struct Inventory {
  std::vector<DeviceInfo> devices;
};

struct Selection {
  std::string device;
  int port = 1;
  LinkLayer link_layer = LinkLayer::kUnknown;
  uint16_t lid = 0;
  int gid_index = 0;
  GidType gid_type = GidType::kIB;
  std::array<uint8_t, 16> gid{};
  int mtu = 0;         // bytes
  std::string reason;  // why this one, for the INFO log and `tensorverbs info`
};

// `numa_node`: the task's (where it runs and its pool is placed), or -1 when unknown;
// `gpu_pci_path`: the GPU its tensors live on, as RankPorts takes it.
absl::StatusOr<Selection> SelectDevice(const Inventory& inventory, const RdmaConfig& config,
                                       int numa_node = -1, absl::string_view gpu_pci_path = "");
// Every usable port (active, with the GID and MTU the settings ask for), best first; an error
// when none is, or when a named device or port is not on this host. RDMA_DEVICE may list
// several devices, comma-separated; each must exist. With `gpu_pci_path` (the GPU the task's
// tensors live on: pci_topology.h), unlisted devices rank by their PCIe links to it first
// (those under another root complex, or whose place is unknown, after), then by NUMA node.
absl::StatusOr<std::vector<Selection>> RankPorts(const Inventory& inventory,
                                                 const RdmaConfig& config, int numa_node = -1,
                                                 absl::string_view gpu_pci_path = "");
// The NUMA node the calling thread runs on, or -1 when the kernel does not say.
int CurrentNumaNode();

// "fe80::1", "::ffff:10.0.0.1", ...
std::string GidToString(const std::array<uint8_t, 16>& gid);
// One line per port: "mlx5_0 port 1: ACTIVE, Ethernet, MTU 1024, GIDs 0 (RoCEv1 fe80::..), ..."
std::string DescribeInventory(const Inventory& inventory);
const char* GidTypeName(GidType type);

}  // namespace tensorverbs::fabric::ibverbs

#endif  // TENSORVERBS_FABRIC_IBVERBS_DEVICE_SELECTION_H_
