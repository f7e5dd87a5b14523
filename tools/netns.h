// NetnsHost: a second "host" on this machine for benchmarks and tests that must cross a network:
// a network namespace joined to the caller's by a veth pair, with an address on each end and a
// default route back, so that gRPC and libfabric's tcp provider reach each other across it.
//
// A host may have several rails (Options::rails), as a server has several NICs: one veth pair
// each, on a /30 of its own in a different 10.x range, each limited to Options::rate by a token
// bucket (`tc qdisc ... tbf`) at both ends where a rate is given. Rail 0 carries the default
// route; a rail's far address is reached over that rail alone.
//
// Needs root (CAP_NET_ADMIN) and iproute2; Create() says so (Unavailable) where either is
// missing, so callers can skip. The destructor deletes the namespace, which removes the veth pairs.
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
  struct Options {
    int rails = 1;     // veth pairs, 1..kMaxRails
    // Per rail and direction, in tc's terms ("2gbit"); empty: unlimited. A comma-separated
    // list gives rail i the i-th rate, the last one for the rails after it ("2gbit,1gbit": a
    // host whose NICs differ).
    std::string rate;
  };
  static constexpr int kMaxRails = 4;
  // `index` (0..63) tells apart several hosts of one process.
  static absl::StatusOr<std::unique_ptr<NetnsHost>> Create(int index = 0) {
    return Create(index, Options());
  }
  static absl::StatusOr<std::unique_ptr<NetnsHost>> Create(int index, const Options& options);
  NetnsHost(const NetnsHost&) = delete;
  NetnsHost& operator=(const NetnsHost&) = delete;
  ~NetnsHost();

  const std::string& name() const { return name_; }
  // This namespace's end of rail 0's veth pair, and the far end inside the new namespace.
  const std::string& local_address() const { return rails_[0].local_address; }
  const std::string& remote_address() const { return rails_[0].remote_address; }
  int rails() const { return static_cast<int>(rails_.size()); }
  const std::string& local_address(int rail) const { return rails_[rail].local_address; }
  const std::string& remote_address(int rail) const { return rails_[rail].remote_address; }
  // Prepended to a command line to run it inside the namespace.
  std::vector<std::string> ExecPrefix() const;
  // Takes the host's end of the link down (a partition: established connections see silence,
  // not resets, and new ones fail "no route to host" rather than leave the machine) or back up
  // (healed).
  // Every rail at once.
  absl::Status SetLinkUp(bool up);
  // One rail: a NIC, cable or switch port that fails while the others carry on.
  absl::Status SetRailUp(int rail, bool up);

 private:
  struct Rail {
    std::string local_if;  // the host's end of the veth pair, deleted first on destruction
    std::string local_address;
    std::string remote_address;
    std::string fallback_route;  // the unreachable route to the subnet, under the link's own
  };
  NetnsHost() = default;
  std::string name_;
  std::vector<Rail> rails_;
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
