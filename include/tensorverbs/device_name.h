// DeviceName: a parsed TensorFlow device name, /job:J/replica:R/task:T/device:TYPE:ID.
//
// The short legacy form /job:J/replica:R/task:T/cpu:0 is accepted too. Every component is
// required: a rendezvous key must name exactly one task. Value type, any thread.
#ifndef TENSORVERBS_PUBLIC_DEVICE_NAME_H_
#define TENSORVERBS_PUBLIC_DEVICE_NAME_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tensorverbs {

struct DeviceName {
  std::string job;
  int replica = 0;
  int task = 0;
  std::string type;  // "CPU", "GPU", ...
  int id = 0;

  static absl::StatusOr<DeviceName> Parse(absl::string_view name);
  // Canonical form: /job:J/replica:R/task:T/device:TYPE:ID
  std::string FullName() const;
  // /job:J/replica:R/task:T
  std::string TaskName() const;
  // TaskName() == task_name, without building the string (every send and recv asks).
  bool IsOnTask(absl::string_view task_name) const;
};

// "/job:J/replica:0/task:T"
std::string TaskName(absl::string_view job, int task);
// "/job:J/replica:0/task:T/device:CPU:0"
std::string CpuDeviceName(absl::string_view job, int task);

// True for a job name TensorFlow would accept: [A-Za-z][A-Za-z0-9_]*
bool IsValidJobName(absl::string_view job);

}  // namespace tensorverbs

#endif  // TENSORVERBS_PUBLIC_DEVICE_NAME_H_
