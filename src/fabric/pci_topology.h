// Where devices sit on the PCIe tree, for choosing the NIC nearest a GPU: a GPU's writes to a
// NIC under the same PCIe switch stay below it, while one under another root complex crosses
// the CPU (and on a two-socket host the socket link), as NCCL's and UCX's topology rules say.
// A device is named by its sysfs path under /sys/devices
// ("/sys/devices/pci0000:00/0000:00:01.0/0000:03:00.0"): each component below the root complex
// a bridge or the device. PciHops is a pure function; the lookups read sysfs. Any thread.
#ifndef TENSORVERBS_FABRIC_PCI_TOPOLOGY_H_
#define TENSORVERBS_FABRIC_PCI_TOPOLOGY_H_

#include <string>

#include "absl/strings/string_view.h"

namespace tensorverbs::fabric {

// The links between two devices on the PCIe tree: up from each to their closest common bridge
// (0 for the same device; 2 for two devices under one bridge). -1 when either path is unknown
// (empty, or not under /sys/devices/pci...) or they hang off different root complexes (the
// path between them crosses the CPU).
int PciHops(absl::string_view a, absl::string_view b);

// The sysfs path of the device behind `sysfs_link` (such as /sys/class/net/eth0/device), or ""
// when it does not resolve.
std::string PciPathOf(const std::string& sysfs_link);

// The sysfs path of the PCI device with bus id `bus_id` ("0000:3B:00.0", as
// cudaDeviceGetPCIBusId writes it; either case), or "" when this host has none.
std::string PciPathOfBusId(absl::string_view bus_id);

}  // namespace tensorverbs::fabric

#endif  // TENSORVERBS_FABRIC_PCI_TOPOLOGY_H_
