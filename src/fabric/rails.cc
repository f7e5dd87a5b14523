#include "src/fabric/rails.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/stat.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <fstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "src/common/net_address.h"
#include "src/fabric/pci_topology.h"

namespace tensorverbs::fabric {
namespace {

int ReadNumaNode(const std::string& interface) {
  std::ifstream in(absl::StrCat("/sys/class/net/", interface, "/device/numa_node"));
  int node = -1;
  if (!(in >> node)) return -1;
  return node;
}

bool IsDirectory(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

int PrefixLength(uint32_t mask) {
  int n = 0;
  while (mask & 0x80000000u) {
    ++n;
    mask <<= 1;
  }
  return n;
}

// Host byte order; false for anything but a dotted quad.
bool ParseIpv4(absl::string_view text, uint32_t* out) {
  in_addr a{};
  if (inet_pton(AF_INET, std::string(text).c_str(), &a) != 1) return false;
  *out = ntohl(a.s_addr);
  return true;
}

uint32_t MaskOf(int prefix_length) {
  return prefix_length <= 0 ? 0 : ~uint32_t{0} << (32 - std::min(prefix_length, 32));
}

struct Network {
  uint32_t base = 0;
  uint32_t mask = 0;
  bool Contains(uint32_t address) const { return (address & mask) == base; }
};

std::string Described(const NetInterface& i) {
  return absl::StrCat(i.name, " (", i.address, "/", i.prefix_length,
                      i.numa_node >= 0 ? absl::StrCat(", NUMA node ", i.numa_node)
                                       : std::string(", NUMA node unknown"),
                      ")");
}

}  // namespace

std::vector<NetInterface> ReadInterfaces() {
  std::vector<NetInterface> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    NetInterface i;
    i.name = a->ifa_name;
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr, text,
              sizeof(text));
    i.address = text;
    if (a->ifa_netmask != nullptr) {
      i.prefix_length = PrefixLength(
          ntohl(reinterpret_cast<const sockaddr_in*>(a->ifa_netmask)->sin_addr.s_addr));
    }
    i.up = (a->ifa_flags & IFF_UP) != 0 && (a->ifa_flags & IFF_RUNNING) != 0;
    i.loopback = (a->ifa_flags & IFF_LOOPBACK) != 0;
    i.numa_node = ReadNumaNode(i.name);
    i.virtual_interface = !IsDirectory(absl::StrCat("/sys/class/net/", i.name, "/device"));
    if (!i.virtual_interface)
      i.pci_path = PciPathOf(absl::StrCat("/sys/class/net/", i.name, "/device"));
    i.bridge = IsDirectory(absl::StrCat("/sys/class/net/", i.name, "/bridge"));
    out.push_back(std::move(i));
  }
  freeifaddrs(list);
  return out;
}

std::string Ipv4Of(absl::string_view host) {
  std::string out;
  if (host.empty()) return out;
  AnyResolvedAddress(host, [&out](const sockaddr* a) {
    if (a->sa_family != AF_INET) return false;
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a)->sin_addr, text, sizeof(text));
    out = text;
    return true;
  });
  return out;
}

absl::StatusOr<RailsSpec> ParseRails(absl::string_view value, int max_rails) {
  RailsSpec spec;
  const absl::string_view trimmed = absl::StripAsciiWhitespace(value);
  int count = 0;
  if (!trimmed.empty() && absl::SimpleAtoi(trimmed, &count)) {
    if (count < 0 || count > max_rails) {
      return absl::InvalidArgumentError(
          absl::StrCat("TENSORVERBS_RAILS=", trimmed, ": a count of rails is 0 to ", max_rails,
                       " (beside the task's own address); or list the rails' addresses or "
                       "interface names"));
    }
    spec.count = count;
    return spec;
  }
  for (absl::string_view rail : absl::StrSplit(value, ',', absl::SkipWhitespace())) {
    spec.listed.emplace_back(absl::StripAsciiWhitespace(rail));
  }
  if (spec.listed.size() > static_cast<size_t>(max_rails)) {
    return absl::InvalidArgumentError(absl::StrCat("TENSORVERBS_RAILS lists ", spec.listed.size(),
                                                   " rails; a channel has at most ", max_rails,
                                                   " beside its first"));
  }
  return spec;
}

RailPlan ChooseRails(const std::vector<NetInterface>& interfaces, absl::string_view primary,
                     int count, int numa_node, absl::string_view gpu_pci_path) {
  RailPlan plan;
  uint32_t primary_address = 0;
  if (!ParseIpv4(primary, &primary_address)) {
    plan.considered.push_back(absl::StrCat(
        "the task's own address (", primary.empty() ? "none" : std::string(primary),
        ") is no IPv4 address of this host's: no rails chosen, since its own interface could "
        "pass for one; list the rails instead"));
    return plan;
  }
  // The networks in use: the task's own (every network that holds its address); and the
  // interface that has it.
  std::vector<Network> used;
  std::vector<std::string> own_interfaces;
  for (const NetInterface& i : interfaces) {
    uint32_t address = 0;
    if (!ParseIpv4(i.address, &address)) continue;
    const Network n{address & MaskOf(i.prefix_length), MaskOf(i.prefix_length)};
    if (n.Contains(primary_address)) used.push_back(n);
    if (address == primary_address) own_interfaces.push_back(i.name);
  }
  auto overlaps = [&used](const Network& n) {
    return std::any_of(used.begin(), used.end(),
                       [&](const Network& u) { return u.Contains(n.base) || n.Contains(u.base); });
  };
  struct Candidate {
    const NetInterface* interface;
    Network network;
    int tier;  // 0: on the task's node, 1: node unknown, 2: another node, 3: virtual
    int hops;  // PCIe links to the task's GPU (PciHops); INT_MAX: no GPU, unknown, or far
  };
  std::vector<Candidate> candidates;
  std::vector<std::string> passed;
  for (const NetInterface& i : interfaces) {
    uint32_t address = 0;
    std::string why;
    if (i.loopback) {
      why = "loopback";
    } else if (i.bridge) {
      why = "a bridge (its address may be every host's)";
    } else if (!i.up) {
      why = "down";
    } else if (!ParseIpv4(i.address, &address)) {
      why = "no IPv4 address";
    } else if (std::find(own_interfaces.begin(), own_interfaces.end(), i.name) !=
               own_interfaces.end()) {
      why = "the task's own interface";
    }
    const Network network{address & MaskOf(i.prefix_length), MaskOf(i.prefix_length)};
    if (why.empty() && overlaps(network)) why = "on the network of the task's own address";
    if (!why.empty()) {
      passed.push_back(absl::StrCat(Described(i), ": passed over, ", why));
      continue;
    }
    const int tier = i.virtual_interface                ? 3
                     : numa_node < 0 || i.numa_node < 0 ? 1
                     : i.numa_node == numa_node         ? 0
                                                        : 2;
    const int hops = gpu_pci_path.empty() ? -1 : PciHops(i.pci_path, gpu_pci_path);
    candidates.push_back({&i, network, tier, hops < 0 ? INT_MAX : hops});
  }
  // Nearest the GPU first, whose memory the tensors leave from and land in; then by node.
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Candidate& a, const Candidate& b) {
                     if ((a.tier == 3) != (b.tier == 3)) return b.tier == 3;
                     if (a.hops != b.hops) return a.hops < b.hops;
                     if (a.tier != b.tier) return a.tier < b.tier;
                     return a.interface->name < b.interface->name;
                   });
  // Which to take, by rank; then their numbers, by name.
  std::vector<const NetInterface*> taken_interfaces;
  std::vector<std::string> verdicts(candidates.size());
  for (size_t k = 0; k < candidates.size(); ++k) {
    const Candidate& c = candidates[k];
    if (std::any_of(taken_interfaces.begin(), taken_interfaces.end(),
                    [&](const NetInterface* t) { return t->name == c.interface->name; })) {
      verdicts[k] = "passed over, another address of an interface taken before it";
    } else if (overlaps(c.network)) {
      verdicts[k] = "passed over, on the network of a rail taken before it";
    } else if (static_cast<int>(taken_interfaces.size()) >= count) {
      verdicts[k] =
          absl::StrCat("passed over, ", count, count == 1 ? " rail" : " rails", " taken before it");
    } else {
      taken_interfaces.push_back(c.interface);
      used.push_back(c.network);
    }
  }
  std::vector<const NetInterface*> numbered = taken_interfaces;
  std::stable_sort(numbered.begin(), numbered.end(),
                   [](const NetInterface* a, const NetInterface* b) { return a->name < b->name; });
  for (const NetInterface* t : numbered) plan.rails.push_back(t->address);
  for (size_t k = 0; k < candidates.size(); ++k) {
    const Candidate& c = candidates[k];
    if (verdicts[k].empty()) {
      const size_t number =
          std::find(numbered.begin(), numbered.end(), c.interface) - numbered.begin() + 1;
      verdicts[k] = absl::StrCat("rail ", number);
    }
    const char* where = c.tier == 0   ? ", on the task's NUMA node"
                        : c.tier == 2 ? ", on another NUMA node"
                        : c.tier == 3 ? ", virtual"
                                      : "";
    const std::string gpu = gpu_pci_path.empty() ? std::string()
                            : c.hops == INT_MAX
                                ? std::string(", not under the GPU's PCIe root")
                                : absl::StrCat(", ", c.hops, " PCIe links from the GPU");
    plan.considered.push_back(absl::StrCat(Described(*c.interface), ": ", verdicts[k], where, gpu));
  }
  for (std::string& p : passed) plan.considered.push_back(std::move(p));
  return plan;
}

}  // namespace tensorverbs::fabric
