#include "src/fabric/rails.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "src/common/net_address.h"

namespace tensorverbs::fabric {
namespace {

int ReadNumaNode(const std::string& interface) {
  std::ifstream in(absl::StrCat("/sys/class/net/", interface, "/device/numa_node"));
  int node = -1;
  if (!(in >> node)) return -1;
  return node;
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
                     int count, int numa_node) {
  RailPlan plan;
  uint32_t primary_address = 0;
  const bool primary_known = ParseIpv4(primary, &primary_address);
  // The networks in use: the task's own (the interface whose network holds its address), then
  // each rail taken.
  std::vector<Network> used;
  std::string primary_interface;
  for (const NetInterface& i : interfaces) {
    uint32_t address = 0;
    if (!primary_known || !ParseIpv4(i.address, &address)) continue;
    const Network n{address & MaskOf(i.prefix_length), MaskOf(i.prefix_length)};
    if (n.Contains(primary_address)) {
      used.push_back(n);
      if (primary_interface.empty()) primary_interface = i.name;
    }
  }
  struct Candidate {
    const NetInterface* interface;
    Network network;
    int distance;  // 0: the task's node, 1: unknown, 2: another node
  };
  std::vector<Candidate> candidates;
  std::vector<std::string> passed;
  for (const NetInterface& i : interfaces) {
    uint32_t address = 0;
    std::string why;
    if (i.loopback) {
      why = "loopback";
    } else if (!i.up) {
      why = "down";
    } else if (!ParseIpv4(i.address, &address)) {
      why = "no IPv4 address";
    } else if (!primary_interface.empty() && i.name == primary_interface) {
      why = "the task's own interface";
    } else if (std::any_of(used.begin(), used.end(),
                           [&](const Network& n) { return n.Contains(address); })) {
      why = "on the network of the task's own address";
    }
    if (!why.empty()) {
      passed.push_back(absl::StrCat(Described(i), ": passed over, ", why));
      continue;
    }
    const int distance = numa_node < 0 || i.numa_node < 0 ? 1 : i.numa_node == numa_node ? 0 : 2;
    candidates.push_back(
        {&i, {address & MaskOf(i.prefix_length), MaskOf(i.prefix_length)}, distance});
  }
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Candidate& a, const Candidate& b) {
                     if (a.distance != b.distance) return a.distance < b.distance;
                     return a.interface->name < b.interface->name;
                   });
  for (const Candidate& c : candidates) {
    const char* where = c.distance == 0   ? ", on the task's NUMA node"
                        : c.distance == 2 ? ", on another NUMA node"
                                          : "";
    std::string verdict;
    if (std::any_of(used.begin(), used.end(),
                    [&](const Network& n) { return n.Contains(c.network.base); })) {
      verdict = "passed over, on the network of a rail taken before it";
    } else if (static_cast<int>(plan.rails.size()) >= count) {
      verdict =
          absl::StrCat("passed over, ", count, count == 1 ? " rail" : " rails", " taken before it");
    } else {
      plan.rails.push_back(c.interface->address);
      used.push_back(c.network);
      verdict = absl::StrCat("rail ", plan.rails.size());
    }
    plan.considered.push_back(absl::StrCat(Described(*c.interface), ": ", verdict, where));
  }
  for (std::string& p : passed) plan.considered.push_back(std::move(p));
  return plan;
}

}  // namespace tensorverbs::fabric
