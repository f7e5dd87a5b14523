// ClusterSpec: the jobs of a cluster and the host:port of each of their tasks.
//
// Parsed from TensorFlow-style text, "ps=localhost:2222;worker=localhost:2223,localhost:2224",
// or from JSON, {"ps": ["localhost:2222"], "worker": [...]} (a TF_CONFIG object with a
// "cluster" member is accepted too). Every malformed form is an InvalidArgument that says what
// is wrong and shows the expected form. Value type, any thread.
#ifndef TENSORVERBS_PUBLIC_CLUSTER_SPEC_H_
#define TENSORVERBS_PUBLIC_CLUSTER_SPEC_H_

#include <map>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tensorverbs {

class ClusterSpec {
 public:
  // Text or JSON (input starting with '{').
  static absl::StatusOr<ClusterSpec> Parse(absl::string_view spec);
  static absl::StatusOr<ClusterSpec> FromJson(absl::string_view json);
  static absl::StatusOr<ClusterSpec> FromJobs(std::map<std::string, std::vector<std::string>> jobs);

  const std::map<std::string, std::vector<std::string>>& jobs() const { return jobs_; }
  int NumTasks(absl::string_view job) const;
  // NotFound naming the job or task and what the cluster has.
  absl::StatusOr<std::string> TaskAddress(absl::string_view job, int task) const;
  // Every task name (/job:J/replica:0/task:T) -> address.
  absl::flat_hash_map<std::string, std::string> TaskAddresses() const;
  // The text form.
  std::string ToString() const;

 private:
  std::map<std::string, std::vector<std::string>> jobs_;
};

// Checks "host:port" / "[v6]:port" with a port in 1..65535.
absl::Status ValidateAddress(absl::string_view address);

// True if a valid HOST:PORT names this host: localhost, a 127.x or ::1 address, this host's
// name, or an address of one of this network namespace's interfaces (or a name that resolves
// to one). Peers there can use shared memory. Resolves names: may block on DNS.
bool AddressIsLocal(absl::string_view address);

}  // namespace tensorverbs

#endif  // TENSORVERBS_PUBLIC_CLUSTER_SPEC_H_
