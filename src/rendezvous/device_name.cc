#include "tensorverbs/device_name.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "src/common/split_exact.h"

namespace tensorverbs {
namespace {

bool ParseNonNegative(absl::string_view s, int* out) {
  if (s.empty() || s.size() > 9) return false;
  for (char c : s) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  return absl::SimpleAtoi(s, out);
}

absl::Status Bad(absl::string_view name, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("malformed device name '", name, "': ", why,
                   " (expected /job:NAME/replica:R/task:T/device:TYPE:ID)"));
}

}  // namespace

bool IsValidJobName(absl::string_view job) {
  if (job.empty() || !absl::ascii_isalpha(static_cast<unsigned char>(job[0]))) return false;
  for (char c : job) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_') return false;
  }
  return true;
}

absl::StatusOr<DeviceName> DeviceName::Parse(absl::string_view name) {
  if (!absl::StartsWith(name, "/")) return Bad(name, "it does not start with '/'");
  absl::string_view parts[4];
  if (!SplitExact(name.substr(1), '/', parts, 4)) {
    return Bad(name, "it needs exactly four components");
  }
  DeviceName d;
  if (!absl::ConsumePrefix(&parts[0], "job:") || !IsValidJobName(parts[0])) {
    return Bad(name, "bad job component");
  }
  d.job = std::string(parts[0]);
  if (!absl::ConsumePrefix(&parts[1], "replica:") || !ParseNonNegative(parts[1], &d.replica)) {
    return Bad(name, "bad replica component");
  }
  if (!absl::ConsumePrefix(&parts[2], "task:") || !ParseNonNegative(parts[2], &d.task)) {
    return Bad(name, "bad task component");
  }
  absl::string_view dev = parts[3];
  // "device:TYPE:ID", or the legacy "cpu:0" / "gpu:1".
  const bool legacy = !absl::ConsumePrefix(&dev, "device:");
  absl::string_view type_id[2];
  if (!SplitExact(dev, ':', type_id, 2) || type_id[0].empty() ||
      !ParseNonNegative(type_id[1], &d.id)) {
    return Bad(name, "bad device component");
  }
  d.type = legacy ? absl::AsciiStrToUpper(type_id[0]) : std::string(type_id[0]);
  for (char c : d.type) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_') {
      return Bad(name, "bad device type");
    }
  }
  return d;
}

std::string DeviceName::FullName() const {
  return absl::StrCat("/job:", job, "/replica:", replica, "/task:", task, "/device:", type, ":",
                      id);
}

std::string DeviceName::TaskName() const {
  return absl::StrCat("/job:", job, "/replica:", replica, "/task:", task);
}

bool DeviceName::IsOnTask(absl::string_view task_name) const {
  char digits[absl::numbers_internal::kFastToBufferSize];
  auto number = [&digits](int n) {
    return absl::string_view(digits, absl::numbers_internal::FastIntToBuffer(n, digits) - digits);
  };
  absl::string_view rest = task_name;
  return absl::ConsumePrefix(&rest, "/job:") && absl::ConsumePrefix(&rest, job) &&
         absl::ConsumePrefix(&rest, "/replica:") && absl::ConsumePrefix(&rest, number(replica)) &&
         absl::ConsumePrefix(&rest, "/task:") && rest == number(task);
}

std::string TaskName(absl::string_view job, int task) {
  return absl::StrCat("/job:", job, "/replica:0/task:", task);
}

std::string CpuDeviceName(absl::string_view job, int task) {
  return absl::StrCat(TaskName(job, task), "/device:CPU:0");
}

}  // namespace tensorverbs
