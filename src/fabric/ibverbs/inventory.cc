#include "src/fabric/ibverbs/inventory.h"

#include <infiniband/verbs.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/fabric/pci_topology.h"

namespace tensorverbs::fabric::ibverbs {
namespace {

int MtuBytes(ibv_mtu mtu) {
  switch (mtu) {
    case IBV_MTU_256:
      return 256;
    case IBV_MTU_512:
      return 512;
    case IBV_MTU_1024:
      return 1024;
    case IBV_MTU_2048:
      return 2048;
    case IBV_MTU_4096:
      return 4096;
  }
  return 0;
}

// The NIC's NUMA node from sysfs (`<ibdev_path>/device/numa_node`), or -1 where the kernel does
// not say (it writes -1 itself on a machine of one node).
int ReadNumaNode(const char* ibdev_path) {
  std::ifstream in(absl::StrCat(ibdev_path, "/device/numa_node"));
  int node = -1;
  if (!(in >> node)) return -1;
  return node;
}

}  // namespace

absl::StatusOr<Inventory> ReadInventory() {
  int num = 0;
  errno = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (list == nullptr) {
    const int err = errno;
    std::string hint = err == ENOSYS
                           ? ": this kernel has no RDMA support (no InfiniBand/RoCE stack)"
                           : "; is rdma-core's provider for this NIC installed?";
    return absl::UnavailableError(absl::StrCat("ibverbs: ibv_get_device_list failed: ",
                                               std::strerror(err), hint));
  }
  Inventory inventory;
  for (int i = 0; i < num; ++i) {
    DeviceInfo device;
    device.name = ibv_get_device_name(list[i]);
    device.numa_node = ReadNumaNode(list[i]->ibdev_path);
    device.pci_path = PciPathOf(absl::StrCat(list[i]->ibdev_path, "/device"));
    ibv_context* ctx = ibv_open_device(list[i]);
    if (ctx == nullptr) {
      PortInfo unusable;
      unusable.state = absl::StrCat("cannot open: ", std::strerror(errno));
      device.ports.push_back(std::move(unusable));
      inventory.devices.push_back(std::move(device));
      continue;
    }
    ibv_device_attr attr{};
    if (ibv_query_device(ctx, &attr) == 0) {
      for (int p = 1; p <= attr.phys_port_cnt; ++p) {
        ibv_port_attr pa{};
        if (ibv_query_port(ctx, static_cast<uint8_t>(p), &pa) != 0) continue;
        PortInfo port;
        port.port = p;
        port.active = pa.state == IBV_PORT_ACTIVE;
        port.state = ibv_port_state_str(pa.state);
        port.link_layer = pa.link_layer == IBV_LINK_LAYER_ETHERNET     ? LinkLayer::kEthernet
                          : pa.link_layer == IBV_LINK_LAYER_INFINIBAND ? LinkLayer::kInfiniBand
                                                                        : LinkLayer::kUnknown;
        port.active_mtu = MtuBytes(pa.active_mtu);
        port.lid = pa.lid;
        std::vector<ibv_gid_entry> gids(std::max(pa.gid_tbl_len, 1));
        ssize_t n = ibv_query_gid_table(ctx, gids.data(), gids.size(), 0);
        for (ssize_t g = 0; g < n; ++g) {
          if (gids[g].port_num != static_cast<uint32_t>(p)) continue;
          GidEntry e;
          e.index = static_cast<int>(gids[g].gid_index);
          std::memcpy(e.gid.data(), gids[g].gid.raw, 16);
          e.type = gids[g].gid_type == IBV_GID_TYPE_ROCE_V2   ? GidType::kRoCEv2
                   : gids[g].gid_type == IBV_GID_TYPE_ROCE_V1 ? GidType::kRoCEv1
                                                               : GidType::kIB;
          port.gids.push_back(e);
        }
        device.ports.push_back(std::move(port));
      }
    }
    ibv_close_device(ctx);
    inventory.devices.push_back(std::move(device));
  }
  ibv_free_device_list(list);
  return inventory;
}

}  // namespace tensorverbs::fabric::ibverbs
