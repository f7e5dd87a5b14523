#include "tools/placement_flags.h"

#include "absl/strings/str_cat.h"
#include "tensorverbs/cluster_spec.h"

namespace tensorverbs::tools {

absl::StatusOr<TaskPlacement> PlacementFromFlags(const std::string& cluster_from,
                                                 const std::string& cluster, const std::string& job,
                                                 int task) {
  if (!cluster_from.empty()) {
    if (!cluster.empty() || !job.empty() || task >= 0) {
      return absl::InvalidArgumentError(
          "--cluster-from gives the cluster, job and task; leave out --cluster, --job and --task");
    }
    absl::StatusOr<TaskPlacement> placement = PlacementFromEnvironment(cluster_from);
    if (!placement.ok()) {
      return absl::Status(
          placement.status().code(),
          absl::StrCat("--cluster-from ", cluster_from, ": ", placement.status().message()));
    }
    return placement;
  }
  if (cluster.empty() || job.empty() || task < 0) {
    return absl::InvalidArgumentError("give --cluster, --job and --task, or --cluster-from");
  }
  absl::StatusOr<ClusterSpec> spec = ClusterSpec::Parse(cluster);
  if (!spec.ok()) return spec.status();
  return TaskPlacement{*std::move(spec), job, task};
}

}  // namespace tensorverbs::tools
