#include "tools/netns.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "src/common/status_macros.h"
#include "src/support/process_util.h"
#include "src/support/subprocess.h"

namespace tensorverbs::tools {
namespace {

constexpr char kIp[] = "/usr/sbin/ip";

constexpr char kTc[] = "/usr/sbin/tc";

// Runs `program args...` to its end and returns what it printed, or why it failed.
absl::StatusOr<std::string> RunOutput(const char* program, const std::vector<std::string>& args) {
  ASSIGN_OR_RETURN(std::unique_ptr<support::Subprocess> child,
                   support::Subprocess::Start(program, args));
  std::string out = child->ReadAll(absl::Seconds(20));
  ASSIGN_OR_RETURN(int rc, child->Wait(absl::Seconds(10)));
  if (rc != 0) {
    const absl::string_view path(program);
    return absl::UnavailableError(absl::StrCat("`", path.substr(path.rfind('/') + 1), " ",
                                               absl::StrJoin(args, " "), "` failed (exit ", rc,
                                               ")"));
  }
  return out;
}

absl::StatusOr<std::string> IpOutput(const std::vector<std::string>& args) {
  return RunOutput(kIp, args);
}

absl::Status Ip(const std::vector<std::string>& args) { return IpOutput(args).status(); }

// The metric of the route that keeps a host's subnet from leaking while its link is down. It
// must lose to the kernel's connected route (metric 0) while the link is up.
constexpr char kFallbackMetric[] = "4096";

// The first three octets of the addresses process `pid` hands out on `rail`: "10.<b>.<c>.",
// b in 200..249 for rail 0, 150..199 for rail 1, and so on down.
std::string AddressPrefix(int pid, int rail = 0) {
  return absl::StrCat("10.", 200 - 50 * rail + pid % 50, ".", (pid / 50) % 250, ".");
}

// A token bucket of `rate` on `dev`'s egress (inside namespace `ns`, when given): a burst of a
// millisecond's worth at least, so that the bucket, not the timer tick, sets the rate.
absl::Status LimitRate(const std::string& ns, const std::string& dev, const std::string& rate) {
  std::vector<std::string> args = {"qdisc", "add", "dev",   dev,     "root",    "tbf",
                                   "rate",  rate,  "burst", "1mbit", "latency", "100ms"};
  if (ns.empty()) return RunOutput(kTc, args).status();
  args.insert(args.begin(), {"netns", "exec", ns, kTc});
  return RunOutput(kIp, args).status();
}

// A process-wide count of the hosts and clusters made, part of every interface name. A
// namespace's devices go away asynchronously after `ip netns del` (the kernel frees the
// namespace once nothing refers to it any more), so the names of a cluster made right after
// another one in the same process must differ; and the host's ends are deleted explicitly.
int NextGeneration() {
  static std::atomic<int> generation{0};
  return generation.fetch_add(1) % 100;
}

// Every name starts with its maker's pid, closed by "x" (so that pid 12's names do not match
// pid 123's): RemoveNetnsOf finds a killed maker's leftovers by these prefixes.
std::string NamespacePrefix(int pid) { return absl::StrCat("tv", pid, "x"); }
// Interface names have at most 15 bytes, so they carry the pid's last five digits.
std::string InterfacePrefix(absl::string_view kind_prefix, int pid) {
  return absl::StrCat(kind_prefix, pid % 100000, "x");
}

// An interface name: prefix, pid, generation, kind and index.
std::string InterfaceName(absl::string_view prefix, int pid, int generation, char kind, int index) {
  return absl::StrCat(InterfacePrefix(prefix, pid), generation, std::string(1, kind), index);
}

}  // namespace

absl::StatusOr<std::unique_ptr<NetnsHost>> NetnsHost::Create(int index, const Options& options) {
  if (geteuid() != 0) {
    return absl::UnavailableError("network namespaces need root (CAP_NET_ADMIN)");
  }
  if (access(kIp, X_OK) != 0) {
    return absl::UnavailableError("iproute2 (/usr/sbin/ip) is not installed");
  }
  if (index < 0 || index > 63) return absl::InvalidArgumentError("netns host index out of range");
  if (options.rails < 1 || options.rails > kMaxRails) {
    return absl::InvalidArgumentError(
        absl::StrCat("a netns host has 1 to ", kMaxRails, " rails, not ", options.rails));
  }
  if (!options.rate.empty() && access(kTc, X_OK) != 0) {
    return absl::UnavailableError("a rate limit needs tc (/usr/sbin/tc, iproute2)");
  }
  std::vector<std::string> rates;
  if (!options.rate.empty()) rates = absl::StrSplit(options.rate, ',');
  for (const std::string& rate : rates) {
    if (rate.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("an empty rate in '", options.rate, "'; give each rail's, as 2gbit,1gbit"));
    }
  }
  auto host = std::unique_ptr<NetnsHost>(new NetnsHost);
  const int pid = static_cast<int>(getpid());
  const int generation = NextGeneration();
  host->name_ = absl::StrCat(NamespacePrefix(pid), generation, "n", index);
  const std::string ns = host->name_;
  RETURN_IF_ERROR(Ip({"netns", "add", ns}));
  host->created_ = true;
  RETURN_IF_ERROR(Ip({"netns", "exec", ns, kIp, "link", "set", "lo", "up"}));
  for (int r = 0; r < options.rails; ++r) {
    // Rail 0's interfaces keep the names they had before rails ('n'); the others are 'p', 'q'...
    const char kind = r == 0 ? 'n' : static_cast<char>('o' + r);
    const std::string local_if = InterfaceName("tvh", pid, generation, kind, index);
    const std::string remote_if = InterfaceName("tvp", pid, generation, kind, index);
    // A /30 per host and rail, derived from the pid so that concurrent runs differ.
    const int d = index * 4;
    Rail rail;
    rail.local_address = absl::StrCat(AddressPrefix(pid, r), d + 1);
    rail.remote_address = absl::StrCat(AddressPrefix(pid, r), d + 2);
    RETURN_IF_ERROR(Ip({"link", "add", local_if, "type", "veth", "peer", "name", remote_if}));
    rail.local_if = local_if;
    host->rails_.push_back(rail);
    RETURN_IF_ERROR(Ip({"link", "set", remote_if, "netns", ns}));
    RETURN_IF_ERROR(Ip({"addr", "add", rail.local_address + "/30", "dev", local_if}));
    RETURN_IF_ERROR(Ip({"link", "set", local_if, "up"}));
    // Taking the link down deletes the kernel's route to the subnet; without this one, packets
    // to the far end would then follow this namespace's default route out of the machine, where
    // whatever answers (a gateway, a proxy replying HTTP 404 to gRPC) is not a partition.
    const std::string subnet = absl::StrCat(AddressPrefix(pid, r), d, "/30");
    RETURN_IF_ERROR(Ip({"route", "add", "unreachable", subnet, "metric", kFallbackMetric}));
    host->rails_.back().fallback_route = subnet;
    RETURN_IF_ERROR(Ip(
        {"netns", "exec", ns, kIp, "addr", "add", rail.remote_address + "/30", "dev", remote_if}));
    RETURN_IF_ERROR(Ip({"netns", "exec", ns, kIp, "link", "set", remote_if, "up"}));
    if (!rates.empty()) {
      const std::string& rate = rates[std::min<size_t>(r, rates.size() - 1)];
      RETURN_IF_ERROR(LimitRate("", local_if, rate));
      RETURN_IF_ERROR(LimitRate(ns, remote_if, rate));
    }
  }
  RETURN_IF_ERROR(Ip(
      {"netns", "exec", ns, kIp, "route", "add", "default", "via", host->rails_[0].local_address}));
  return host;
}

NetnsHost::~NetnsHost() {
  // Deleting one end of a veth pair deletes both at once; the namespace's own deletion would
  // take them only when the kernel gets to freeing it.
  for (const Rail& rail : rails_) {
    (void)Ip({"link", "del", rail.local_if});
    if (!rail.fallback_route.empty()) {
      (void)Ip({"route", "del", "unreachable", rail.fallback_route, "metric", kFallbackMetric});
    }
  }
  if (created_) (void)Ip({"netns", "del", name_});
}

std::vector<std::string> NetnsHost::ExecPrefix() const { return {kIp, "netns", "exec", name_}; }

absl::Status NetnsHost::SetLinkUp(bool up) {
  for (int r = 0; r < rails(); ++r) RETURN_IF_ERROR(SetRailUp(r, up));
  return absl::OkStatus();
}

absl::Status NetnsHost::SetRailUp(int rail, bool up) {
  if (rail < 0 || rail >= rails()) {
    return absl::InvalidArgumentError(absl::StrCat("no rail ", rail, " of ", rails()));
  }
  return Ip({"link", "set", rails_[rail].local_if, up ? "up" : "down"});
}

absl::StatusOr<std::unique_ptr<NetnsCluster>> NetnsCluster::Create(int hosts) {
  if (geteuid() != 0) {
    return absl::UnavailableError("network namespaces need root (CAP_NET_ADMIN)");
  }
  if (access(kIp, X_OK) != 0) {
    return absl::UnavailableError("iproute2 (/usr/sbin/ip) is not installed");
  }
  if (hosts < 1 || hosts > 200) return absl::InvalidArgumentError("1..200 netns hosts");
  auto cluster = std::unique_ptr<NetnsCluster>(new NetnsCluster);
  const int pid = static_cast<int>(getpid());
  const int generation = NextGeneration();
  cluster->bridge_ = InterfaceName("tvb", pid, generation, 'b', 0);
  RETURN_IF_ERROR(Ip({"link", "add", "name", cluster->bridge_, "type", "bridge"}));
  RETURN_IF_ERROR(Ip({"link", "set", cluster->bridge_, "up"}));
  for (int i = 0; i < hosts; ++i) {
    const std::string ns = absl::StrCat(NamespacePrefix(pid), generation, "c", i);
    const std::string local_if = InterfaceName("tvh", pid, generation, 'c', i);
    const std::string remote_if = InterfaceName("tvp", pid, generation, 'c', i);
    const std::string address = absl::StrCat(AddressPrefix(pid), i + 1);
    RETURN_IF_ERROR(Ip({"netns", "add", ns}));
    cluster->namespaces_.push_back(ns);
    cluster->addresses_.push_back(address);
    RETURN_IF_ERROR(Ip({"link", "add", local_if, "type", "veth", "peer", "name", remote_if}));
    cluster->local_ifs_.push_back(local_if);
    RETURN_IF_ERROR(Ip({"link", "set", local_if, "master", cluster->bridge_}));
    RETURN_IF_ERROR(Ip({"link", "set", local_if, "up"}));
    RETURN_IF_ERROR(Ip({"link", "set", remote_if, "netns", ns}));
    RETURN_IF_ERROR(
        Ip({"netns", "exec", ns, kIp, "addr", "add", address + "/24", "dev", remote_if}));
    RETURN_IF_ERROR(Ip({"netns", "exec", ns, kIp, "link", "set", remote_if, "up"}));
    RETURN_IF_ERROR(Ip({"netns", "exec", ns, kIp, "link", "set", "lo", "up"}));
  }
  return cluster;
}

NetnsCluster::~NetnsCluster() {
  for (const std::string& link : local_ifs_) (void)Ip({"link", "del", link});
  for (const std::string& ns : namespaces_) (void)Ip({"netns", "del", ns});
  if (!bridge_.empty()) (void)Ip({"link", "del", bridge_});
}

std::vector<std::string> NetnsCluster::ExecPrefix(int host) const {
  return {kIp, "netns", "exec", namespaces_[host]};
}

void RemoveNetnsOf(int pid) {
  if (geteuid() != 0 || access(kIp, X_OK) != 0) return;
  // The host's ends first: deleting one end deletes the pair at once, while a deleted
  // namespace's devices go only when the kernel frees it.
  for (const char* kind : {"tvh", "tvb"}) {
    for (const std::string& link :
         support::EntriesStartingWith("/sys/class/net", InterfacePrefix(kind, pid))) {
      (void)Ip({"link", "del", link});
    }
  }
  for (const std::string& ns : support::EntriesStartingWith("/run/netns", NamespacePrefix(pid))) {
    (void)Ip({"netns", "del", ns});
  }
  absl::StatusOr<std::string> routes = IpOutput({"route", "show", "type", "unreachable"});
  if (!routes.ok()) return;
  for (absl::string_view line : absl::StrSplit(*routes, '\n', absl::SkipWhitespace())) {
    // "unreachable 10.b.c.d/30 metric 4096"
    std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (words.size() < 4 || words[0] != "unreachable" || words[2] != "metric" ||
        words[3] != kFallbackMetric) {
      continue;
    }
    for (int r = 0; r < NetnsHost::kMaxRails; ++r) {
      if (absl::StartsWith(words[1], AddressPrefix(pid, r))) {
        (void)Ip({"route", "del", "unreachable", words[1], "metric", kFallbackMetric});
        break;
      }
    }
  }
}

}  // namespace tensorverbs::tools
