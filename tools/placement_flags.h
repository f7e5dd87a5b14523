// PlacementFromFlags: where a tool's task runs (cluster spec, job, task), from its flags: either
// --cluster-from (Slurm's or TF_CONFIG's variables, through PlacementFromEnvironment) or all of
// --cluster, --job and --task. Shared by `server`, `demo-task` and `bench-ps-task`; any thread.
#ifndef TENSORVERBS_TOOLS_PLACEMENT_FLAGS_H_
#define TENSORVERBS_TOOLS_PLACEMENT_FLAGS_H_

#include <string>

#include "absl/status/statusor.h"
#include "tensorverbs/placement.h"

namespace tensorverbs::tools {

// InvalidArgument naming the flags when both ways are given or neither is whole; the
// environment's error, prefixed with "--cluster-from SOURCE: ", when its variables are missing
// or inconsistent; the cluster spec's error when --cluster does not parse.
absl::StatusOr<TaskPlacement> PlacementFromFlags(const std::string& cluster_from,
                                                 const std::string& cluster, const std::string& job,
                                                 int task);

}  // namespace tensorverbs::tools

#endif  // TENSORVERBS_TOOLS_PLACEMENT_FLAGS_H_
