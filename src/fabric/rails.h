// Rails for lanes (TENSORVERBS_RAILS): the further networks a task's channels may spread large
// tensors over, each a lane on a libfabric domain bound to one of this host's addresses.
//
// The variable lists the rails (addresses or interface names), or gives a count. For a count the
// host's interfaces are ranked for the task (ChooseRails): an interface is a candidate when it
// is up, not loopback, not a bridge, has an IPv4 address, and is on none of the networks
// already used (the task's own address's first, then each rail taken, containment either way),
// so each rail is a network of its own, one address per interface. Interfaces with a device
// behind them come first: for a task whose tensors live on a GPU, those fewest PCIe links from
// it (under its own switch before across the host bridge; those under another root complex
// after), then those on the task's NUMA node before those whose node the kernel does not say
// and those across the socket link (which reach the task's memory through it); then virtual
// ones (veth); each group by name. The rails taken are then numbered by interface
// name, not by rank: lanes pair in order at set-up, and hosts built alike name their NICs
// alike whichever NUMA node a task runs on. A task whose own address is unknown takes none
// (its own interface could pass for a rail). Fewer candidates than asked for is not an error:
// the task runs with the rails there are, and says so.
//
// ReadInterfaces and Ipv4Of read the host (getifaddrs, sysfs, DNS); everything else is a pure
// function, so every rule is testable without the interfaces. Any thread.
#ifndef TENSORVERBS_FABRIC_RAILS_H_
#define TENSORVERBS_FABRIC_RAILS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tensorverbs::fabric {

// The most rails beside the task's own address (a channel's lanes: protocol::kMaxLanes).
inline constexpr int kMaxRails = 3;

// One IPv4 address of one interface.
struct NetInterface {
  std::string name;
  std::string address;  // dotted quad
  int prefix_length = 32;
  bool up = false;  // IFF_UP and IFF_RUNNING
  bool loopback = false;
  int numa_node = -1;  // the NIC's, from sysfs; -1 where the kernel does not say
  bool virtual_interface = false;  // no device behind it in sysfs (veth, tun, dummy, ...)
  bool bridge = false;             // a bridge (docker0, virbr0, cni0, ...)
  std::string pci_path{};  // its device's sysfs path (pci_topology.h); empty for a virtual one
};

// The host's IPv4 interfaces, one entry per address, in the kernel's order.
std::vector<NetInterface> ReadInterfaces();
// `host` when it is an IPv4 address, else the first IPv4 address its name resolves to; empty
// when none. May block on DNS: at start only.
std::string Ipv4Of(absl::string_view host);

// TENSORVERBS_RAILS: a count (0 to `max_rails`; 0 is none), or a comma-separated list.
struct RailsSpec {
  int count = 0;                    // > 0: choose this many (ChooseRails)
  std::vector<std::string> listed;  // otherwise: these, in order
};
// InvalidArgument naming the variable for a count out of range or a list longer than
// `max_rails`.
absl::StatusOr<RailsSpec> ParseRails(absl::string_view value, int max_rails);

struct RailPlan {
  // The chosen rails' addresses, best first.
  std::vector<std::string> rails;
  // Every interface address seen, with whether it was taken and why (for the log and
  // `tensorverbs info`), in rank order for the candidates, then the others.
  std::vector<std::string> considered;
};

// Takes up to `count` rails from `interfaces` for a task whose own address is `primary` (IPv4;
// empty when unknown: then only loopback is left out by address) and that runs on NUMA node
// `numa_node` (-1: unknown). With `gpu_pci_path` (the sysfs path of the GPU the task's tensors
// live on: pci_topology.h), interfaces rank by their PCIe links to it first, those under
// another root complex or whose place is unknown after, then by node.
RailPlan ChooseRails(const std::vector<NetInterface>& interfaces, absl::string_view primary,
                     int count, int numa_node, absl::string_view gpu_pci_path = "");

}  // namespace tensorverbs::fabric

#endif  // TENSORVERBS_FABRIC_RAILS_H_
