// NetnsHost: a second "host" on this machine for benchmarks and tests that must cross a network:
// a network namespace joined to the caller's by a veth pair, with an address on each end and a
// default route back, so that gRPC and libfabric's tcp provider reach each other across it.
//
// Needs root (CAP_NET_ADMIN) and iproute2; Create() says so (Unavailable) where either is
// missing, so callers can skip. The destructor deletes the namespace, which removes the veth pair.
// Used from one thread.
#ifndef TENSORVERBS_TOOLS_NETNS_H_
#define TENSORVERBS_TOOLS_NETNS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tensorverbs::tools {

class NetnsHost {
 public:
  // `index` (0..63) tells apart several hosts of one process.
  static absl::StatusOr<std::unique_ptr<NetnsHost>> Create(int index = 0);
  NetnsHost(const NetnsHost&) = delete;
  NetnsHost& operator=(const NetnsHost&) = delete;
  ~NetnsHost();

  const std::string& name() const { return name_; }
  // This namespace's end of the veth pair, and the far end inside the new namespace.
  const std::string& local_address() const { return local_address_; }
  const std::string& remote_address() const { return remote_address_; }
  // Prepended to a command line to run it inside the namespace.
  std::vector<std::string> ExecPrefix() const;
  // Takes the host's end of the link down (a partition: established connections see silence,
  // not resets, and new ones fail "no route to host" rather than leave the machine) or back up
  // (healed).
  absl::Status SetLinkUp(bool up);

 private:
  NetnsHost() = default;
  std::string name_;
  std::string local_if_;  // the host's end of the veth pair, deleted first on destruction
  std::string local_address_;
  std::string remote_address_;
  std::string fallback_route_;  // the unreachable route to the subnet, under the link's own
  bool created_ = false;
};

// NetnsCluster: `hosts` network namespaces on one bridge in the caller's namespace, one
// address each in a common /24, for clusters whose every task is a separate host. The
// destructor deletes the namespaces and the bridge. Same requirements as NetnsHost.
class NetnsCluster {
 public:
  static absl::StatusOr<std::unique_ptr<NetnsCluster>> Create(int hosts);
  NetnsCluster(const NetnsCluster&) = delete;
  NetnsCluster& operator=(const NetnsCluster&) = delete;
  ~NetnsCluster();

  int size() const { return static_cast<int>(namespaces_.size()); }
  const std::string& address(int host) const { return addresses_[host]; }
  std::vector<std::string> ExecPrefix(int host) const;

 private:
  NetnsCluster() = default;
  std::string bridge_;
  std::vector<std::string> namespaces_;
  std::vector<std::string> local_ifs_;  // the host's ends of the veth pairs
  std::vector<std::string> addresses_;
};

// Deletes the namespaces, veth pairs and bridges that process `pid` made (NetnsHost and
// NetnsCluster name them after their maker's pid) and left behind: a process killed outright runs
// no destructor. For whoever killed it (a test past its deadline); best effort, silent where
// there is nothing to remove or no right to.
void RemoveNetnsOf(int pid);

}  // namespace tensorverbs::tools

#endif  // TENSORVERBS_TOOLS_NETNS_H_
