#include "src/fabric/ibverbs/device_selection.h"

#include <arpa/inet.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

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
      lines.push_back(absl::StrCat(PortName(d.name, p), ": ", p.state, ", ",
                                   LinkLayerName(p.link_layer), ", active MTU ", p.active_mtu,
                                   ", GIDs ", DescribeGids(p)));
    }
  }
  return absl::StrJoin(lines, "; ");
}

absl::StatusOr<Selection> SelectDevice(const Inventory& inventory, const RdmaConfig& config) {
  if (inventory.devices.empty()) {
    return absl::UnavailableError("ibverbs: no RDMA device found on this host");
  }
  std::vector<const DeviceInfo*> devices;
  for (const DeviceInfo& d : inventory.devices) {
    if (config.device.empty() || d.name == config.device) devices.push_back(&d);
  }
  if (devices.empty()) {
    std::vector<std::string> names;
    for (const DeviceInfo& d : inventory.devices) names.push_back(d.name);
    return absl::InvalidArgumentError(absl::StrCat("ibverbs: RDMA_DEVICE=", config.device,
                                                   " is not on this host; devices: ",
                                                   absl::StrJoin(names, ", ")));
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
    return absl::InvalidArgumentError(absl::StrCat(
        "ibverbs: RDMA_DEVICE_PORT=", config.port, " matches no port; seen: ",
        DescribeInventory(inventory)));
  }
  if (active.empty()) {
    return absl::UnavailableError(absl::StrCat(
        "ibverbs: no active RDMA port; seen: ", DescribeInventory(inventory),
        "; bring a link up or choose one with RDMA_DEVICE and RDMA_DEVICE_PORT"));
  }
  if (active.size() > 1) {
    std::vector<std::string> names;
    for (const Candidate& c : active) names.push_back(PortName(c.device->name, *c.port));
    const bool device_set = !config.device.empty();
    return absl::FailedPreconditionError(absl::StrCat(
        "ibverbs: several active RDMA ports (", absl::StrJoin(names, ", "), "); choose one with ",
        device_set ? "RDMA_DEVICE_PORT" : "RDMA_DEVICE (and RDMA_DEVICE_PORT)", "; seen: ",
        DescribeInventory(inventory)));
  }
  const DeviceInfo& device = *active[0].device;
  const PortInfo& port = *active[0].port;
  Selection s;
  s.device = device.name;
  s.port = port.port;
  s.link_layer = port.link_layer;
  s.lid = port.lid;

  const GidEntry* gid = nullptr;
  if (config.gid_index >= 0) {
    for (const GidEntry& g : port.gids) {
      if (g.index == config.gid_index) gid = &g;
    }
    if (gid == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ibverbs: RDMA_GID_INDEX=", config.gid_index, " is not a valid GID of ",
          PortName(device.name, port), "; valid: ", DescribeGids(port)));
    }
    s.reason = "RDMA_GID_INDEX";
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
    s.reason = absl::StrCat("preferred ", GidTypeName(gid->type),
                            gid->type == GidType::kRoCEv2 && IsIpv4Mapped(gid->gid) ? " IPv4" : "",
                            " GID");
  }
  s.gid_index = gid->index;
  s.gid_type = gid->type;
  s.gid = gid->gid;

  if (config.mtu != 0) {
    if (config.mtu > port.active_mtu) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ibverbs: RDMA_QP_MTU=", config.mtu, " exceeds the active MTU ", port.active_mtu, " of ",
          PortName(device.name, port), "; use at most ", port.active_mtu));
    }
    s.mtu = config.mtu;
  } else {
    s.mtu = port.active_mtu;
  }
  s.reason = absl::StrCat("the only active port (", PortName(device.name, port), "), ", s.reason,
                          " ", s.gid_index, ", MTU ", s.mtu, config.mtu ? " (RDMA_QP_MTU)" : " (active)");
  return s;
}

}  // namespace tensorverbs::fabric::ibverbs
