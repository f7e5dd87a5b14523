// TaskPlacement: where this process's task sits in its cluster, as the launcher that started it
// says: Slurm through its SLURM_* variables, Kubernetes (and TensorFlow's own launchers) through
// TF_CONFIG. Pure functions of the variables they are given, callable from any thread.
//
// Slurm, as TensorFlow's SlurmClusterResolver reads it:
//   - the hosts: SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST), a host list such as
//     "node[01-03,07],gpu-a"; tasks per host: SLURM_STEP_TASKS_PER_NODE (else
//     SLURM_TASKS_PER_NODE), such as "2(x3),1"; this task's rank: SLURM_PROCID;
//   - ranks fill the hosts in order (Slurm's block distribution), and a host's k-th task listens
//     on TENSORVERBS_SLURM_PORT + k (default 8888);
//   - TENSORVERBS_SLURM_JOBS names the jobs by rank ranges, "ps:1,worker:3" (ranks 0 to 0 are
//     ps, 1 to 3 worker); by default every rank is a task of job "worker".
// TF_CONFIG: {"cluster": {...}, "task": {"type": "worker", "index": 1}}.
// Every error is InvalidArgument naming the variable and what is wrong with it.
#ifndef TENSORVERBS_PUBLIC_PLACEMENT_H_
#define TENSORVERBS_PUBLIC_PLACEMENT_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tensorverbs/cluster_spec.h"

namespace tensorverbs {

struct TaskPlacement {
  ClusterSpec cluster;
  std::string job;
  int task = 0;
};

// `source` is "slurm" or "tf_config"; the variables are this process's environment.
absl::StatusOr<TaskPlacement> PlacementFromEnvironment(absl::string_view source);
// The same from the variables given (for tests and tools that hold them).
absl::StatusOr<TaskPlacement> PlacementFromVariables(
    absl::string_view source, const std::map<std::string, std::string>& variables);

// Slurm's host list syntax: "node[01-03,07],gpu-a" -> node01 node02 node03 node07 gpu-a.
absl::StatusOr<std::vector<std::string>> ExpandHostList(absl::string_view list);
// Slurm's tasks-per-node syntax: "2(x3),1" -> 2 2 2 1.
absl::StatusOr<std::vector<int>> ExpandTasksPerNode(absl::string_view counts);

// `count` distinct TCP ports of `host` (an IPv4 address of this host) for tasks this process is
// about to start: free now, and kept from the next pickers of this host until this process
// exits. Picked at random below (or above) the kernel's ephemeral range
// (/proc/sys/net/ipv4/ip_local_port_range), so no outgoing connection takes one between the pick
// and the task's bind, and each is reserved by an abstract Unix socket named
// "tensorverbs/port/<port>", which every picker in this network namespace (C++, Python, the
// torch backend) checks first. Thread-safe. InvalidArgument for a host that is not an IPv4
// address; Unavailable when no port is left.
absl::StatusOr<std::vector<int>> PickFreePorts(int count, absl::string_view host = "127.0.0.1");

}  // namespace tensorverbs

#endif  // TENSORVERBS_PUBLIC_PLACEMENT_H_
