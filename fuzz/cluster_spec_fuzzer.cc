// Fuzzes the cluster spec a user gives a task (--cluster text and the JSON form; the first byte
// picks which). A spec that parses names only addresses that validate.
#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "fuzz/fuzz_check.h"
#include "tensorverbs/cluster_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using tensorverbs::ClusterSpec;
  if (size == 0) return 0;
  const absl::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  absl::StatusOr<ClusterSpec> spec =
      (data[0] & 1) ? ClusterSpec::FromJson(text) : ClusterSpec::Parse(text);
  if (!spec.ok()) {
    FUZZ_CHECK(spec.status().code() == absl::StatusCode::kInvalidArgument,
               "a bad spec is InvalidArgument");
    return 0;
  }
  for (const auto& [task, address] : spec->TaskAddresses()) {
    FUZZ_CHECK(tensorverbs::ValidateAddress(address).ok(), "every address validates");
  }
  return 0;
}
