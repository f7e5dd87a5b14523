#include "src/fabric/pci_topology.h"

#include <limits.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace tensorverbs::fabric {
namespace {

constexpr absl::string_view kDevices = "/sys/devices/";

// The components from the root complex ("pci0000:00") down, or none for a path elsewhere.
std::vector<absl::string_view> Components(absl::string_view path) {
  if (!absl::ConsumePrefix(&path, kDevices) || !absl::StartsWith(path, "pci")) return {};
  std::vector<absl::string_view> out = absl::StrSplit(path, '/', absl::SkipEmpty());
  return out;
}

}  // namespace

int PciHops(absl::string_view a, absl::string_view b) {
  const std::vector<absl::string_view> x = Components(a);
  const std::vector<absl::string_view> y = Components(b);
  if (x.empty() || y.empty() || x[0] != y[0]) return -1;
  size_t common = 0;
  while (common < x.size() && common < y.size() && x[common] == y[common]) ++common;
  return static_cast<int>((x.size() - common) + (y.size() - common));
}

std::string PciPathOf(const std::string& sysfs_link) {
  char resolved[PATH_MAX];
  if (realpath(sysfs_link.c_str(), resolved) == nullptr) return "";
  return resolved;
}

std::string PciPathOfBusId(absl::string_view bus_id) {
  if (bus_id.empty() || absl::StrContains(bus_id, '/')) return "";
  return PciPathOf(absl::StrCat("/sys/bus/pci/devices/", absl::AsciiStrToLower(bus_id)));
}

}  // namespace tensorverbs::fabric
