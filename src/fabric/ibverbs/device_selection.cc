#include "src/fabric/ibverbs/device_selection.h"

#include <arpa/inet.h>
#include <sched.h>

#include <algorithm>
#include <climits>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "src/common/status_macros.h"
#include "src/fabric/pci_topology.h"

namespace tensorverbs::fabric::ibverbs {
namespace {

bool IsIpv4Mapped(const std::array<uint8_t, 16>& g) {
  for (int i = 0; i < 10; ++i) {
    if (g[i] != 0) return false;
  }
  return g[10] == 0xff && g[11] == 0xff;
}

std::string PortName(const std::string& device, const PortInfo& p) {
  return absl::StrCat(device, " port ", p.port);
}

std::string DescribeGids(const PortInfo& p) {
  std::vector<std::string> gids;
  for (const GidEntry& g : p.gids) {
    gids.push_back(absl::StrCat(g.index, " (", GidTypeName(g.type), " ", GidToString(g.gid), ")"));
  }
  return gids.empty() ? "none" : absl::StrJoin(gids, ", ");
}

const char* LinkLayerName(LinkLayer l) {
  switch (l) {
    case LinkLayer::kInfiniBand:
      return "InfiniBand";
    case LinkLayer::kEthernet:
      return "Ethernet";
    default:
      return "unknown link layer";
  }
}

struct Candidate {
  const DeviceInfo* device;
  const PortInfo* port;
};

}  // namespace

const char* GidTypeName(GidType type) {
  switch (type) {
    case GidType::kIB:
      return "IB";
    case GidType::kRoCEv1:
      return "RoCEv1";
    case GidType::kRoCEv2:
      return "RoCEv2";
  }
  return "?";
}

std::string GidToString(const std::array<uint8_t, 16>& gid) {
  char text[INET6_ADDRSTRLEN];
  if (inet_ntop(AF_INET6, gid.data(), text, sizeof(text)) == nullptr) return "?";
  return text;
}

std::string DescribeInventory(const Inventory& inventory) {
  std::vector<std::string> lines;
  for (const DeviceInfo& d : inventory.devices) {
    if (d.ports.empty()) lines.push_back(absl::StrCat(d.name, ": no ports"));
    for (const PortInfo& p : d.ports) {
      lines.push_back(absl::StrCat(
          PortName(d.name, p), ": ", p.state, ", ", LinkLayerName(p.link_layer), ", active MTU ",
          p.active_mtu, ", GIDs ", DescribeGids(p),
          d.numa_node >= 0 ? absl::StrCat(", NUMA node ", d.numa_node) : std::string()));
    }
  }
  return absl::StrJoin(lines, "; ");
}

namespace {

// The GID and MTU of `port` by the settings, into `s` (with the GID's part of the reason).
absl::Status ChooseGidAndMtu(const DeviceInfo& device, const PortInfo& port,
                             const RdmaConfig& config, Selection* s) {
  const GidEntry* gid = nullptr;
  std::string why;
  if (config.gid_index >= 0) {
    for (const GidEntry& g : port.gids) {
      if (g.index == config.gid_index) gid = &g;
    }
    if (gid == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ibverbs: RDMA_GID_INDEX=", config.gid_index, " is not a valid GID of ",
          PortName(device.name, port), "; valid: ", DescribeGids(port)));
    }
    why = "RDMA_GID_INDEX";
  } else {
    // RoCEv2 with an IPv4 address first (routable, what most fabrics run), then any RoCEv2,
    // then RoCEv1, then IB; the lowest index within a class.
    auto rank = [](const GidEntry& g) {
      if (g.type == GidType::kRoCEv2) return IsIpv4Mapped(g.gid) ? 0 : 1;
      return g.type == GidType::kRoCEv1 ? 2 : 3;
    };
    for (const GidEntry& g : port.gids) {
      if (gid == nullptr || rank(g) < rank(*gid) || (rank(g) == rank(*gid) && g.index < gid->index)) {
        gid = &g;
      }
    }
    if (gid == nullptr) {
      return absl::UnavailableError(absl::StrCat("ibverbs: ", PortName(device.name, port),
                                                 " has no valid GID; set RDMA_GID_INDEX"));
    }
    why = absl::StrCat("preferred ", GidTypeName(gid->type),
                       gid->type == GidType::kRoCEv2 && IsIpv4Mapped(gid->gid) ? " IPv4" : "",
                       " GID");
  }
  if (config.mtu != 0 && config.mtu > port.active_mtu) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ibverbs: RDMA_QP_MTU=", config.mtu, " exceeds the active MTU ", port.active_mtu, " of ",
        PortName(device.name, port), "; use at most ", port.active_mtu));
  }
  s->device = device.name;
  s->port = port.port;
  s->link_layer = port.link_layer;
  s->lid = port.lid;
  s->gid_index = gid->index;
  s->gid_type = gid->type;
  s->gid = gid->gid;
  s->mtu = config.mtu != 0 ? config.mtu : port.active_mtu;
  s->reason = absl::StrCat(why, " ", s->gid_index, ", MTU ", s->mtu,
                           config.mtu ? " (RDMA_QP_MTU)" : " (active)");
  return absl::OkStatus();
}

}  // namespace

int CurrentNumaNode() {
  unsigned cpu = 0, node = 0;
  if (getcpu(&cpu, &node) != 0) return -1;
  return static_cast<int>(node);
}

absl::StatusOr<std::vector<Selection>> RankPorts(const Inventory& inventory,
                                                 const RdmaConfig& config, int numa_node,
                                                 absl::string_view gpu_pci_path) {
  if (inventory.devices.empty()) {
    return absl::UnavailableError("ibverbs: no RDMA device found on this host");
  }
  std::vector<std::string> names;
  for (const DeviceInfo& d : inventory.devices) names.push_back(d.name);
  // RDMA_DEVICE: one name, or several in the order the user prefers them.
  std::vector<const DeviceInfo*> devices;
  std::vector<std::string> named;
  for (absl::string_view n : absl::StrSplit(config.device, ',', absl::SkipWhitespace())) {
    const std::string name(absl::StripAsciiWhitespace(n));
    if (std::find(named.begin(), named.end(), name) != named.end()) continue;
    named.push_back(name);
    auto it = std::find_if(inventory.devices.begin(), inventory.devices.end(),
                           [&](const DeviceInfo& d) { return d.name == name; });
    if (it == inventory.devices.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("ibverbs: RDMA_DEVICE=", config.device, " names ", name,
                       ", which is not on this host; devices: ", absl::StrJoin(names, ", ")));
    }
    devices.push_back(&*it);
  }
  if (named.empty()) {
    for (const DeviceInfo& d : inventory.devices) devices.push_back(&d);
  }
  std::vector<Candidate> all, active;
  for (const DeviceInfo* d : devices) {
    for (const PortInfo& p : d->ports) {
      if (config.port != 0 && p.port != config.port) continue;
      all.push_back({d, &p});
      if (p.active) active.push_back({d, &p});
    }
  }
  if (all.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ibverbs: RDMA_DEVICE_PORT=", config.port,
                     " matches no port; seen: ", DescribeInventory(inventory)));
  }
  if (active.empty()) {
    return absl::UnavailableError(
        absl::StrCat("ibverbs: no active RDMA port; seen: ", DescribeInventory(inventory),
                     "; bring a link up or choose one with RDMA_DEVICE and RDMA_DEVICE_PORT"));
  }
  // 0: on the task's node; 1: a node the kernel does not say (or the task's is unknown); 2: a
  // node across the socket link.
  auto distance = [numa_node](const Candidate& c) {
    if (numa_node < 0 || c.device->numa_node < 0) return 1;
    return c.device->numa_node == numa_node ? 0 : 2;
  };
  // PCIe links to the task's GPU; INT_MAX: no GPU, or the NIC is under another root complex
  // or its place unknown.
  auto hops = [gpu_pci_path](const Candidate& c) {
    const int h = gpu_pci_path.empty() ? -1 : PciHops(c.device->pci_path, gpu_pci_path);
    return h < 0 ? INT_MAX : h;
  };
  if (named.size() <= 1) {
    std::stable_sort(active.begin(), active.end(), [&](const Candidate& a, const Candidate& b) {
      return std::make_tuple(hops(a), distance(a), a.device->name, a.port->port) <
             std::make_tuple(hops(b), distance(b), b.device->name, b.port->port);
    });
  }
  std::vector<std::string> ports;
  for (const Candidate& c : active) ports.push_back(PortName(c.device->name, *c.port));
  std::vector<Selection> ranked;
  absl::Status first_error;
  for (const Candidate& c : active) {
    Selection s;
    if (absl::Status chosen = ChooseGidAndMtu(*c.device, *c.port, config, &s); !chosen.ok()) {
      if (first_error.ok()) first_error = chosen;
      continue;
    }
    std::string why;
    if (active.size() == 1) {
      why = absl::StrCat("the only active port (", PortName(c.device->name, *c.port), ")");
    } else if (named.size() > 1) {
      why = absl::StrCat("RDMA_DEVICE's choice ", ranked.size() + 1, " of ", active.size(),
                         " active ports (", absl::StrJoin(ports, ", "), ")");
    } else {
      const char* where = distance(c) == 0   ? "on the task's NUMA node"
                          : distance(c) == 1 ? "NUMA node unknown"
                                             : "across the socket link";
      const std::string gpu = gpu_pci_path.empty() ? std::string()
                              : hops(c) == INT_MAX
                                  ? std::string("not under the GPU's PCIe root, ")
                                  : absl::StrCat(hops(c), " PCIe links from the GPU, ");
      why = absl::StrCat(
          "rank ", ranked.size() + 1, " of ", active.size(), " active ports (",
          absl::StrJoin(ports, ", "), "), ", gpu, where,
          numa_node >= 0 ? absl::StrCat(" (the task runs on node ", numa_node, ")") : std::string(),
          "; RDMA_DEVICE and RDMA_DEVICE_PORT pick another");
    }
    s.reason = absl::StrCat(why, ", ", s.reason);
    ranked.push_back(std::move(s));
  }
  if (ranked.empty()) return first_error;
  return ranked;
}

absl::StatusOr<Selection> SelectDevice(const Inventory& inventory, const RdmaConfig& config,
                                       int numa_node, absl::string_view gpu_pci_path) {
  ASSIGN_OR_RETURN(std::vector<Selection> ranked,
                   RankPorts(inventory, config, numa_node, gpu_pci_path));
  return std::move(ranked.front());
}

}  // namespace tensorverbs::fabric::ibverbs
