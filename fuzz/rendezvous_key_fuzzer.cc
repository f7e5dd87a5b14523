// Fuzzes ParsedKey::Parse, which every protocol applies to the keys peers send. A key that
// parses must be the canonical key of its parts.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "fuzz/fuzz_check.h"
#include "tensorverbs/parsed_key.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using tensorverbs::ParsedKey;
  const absl::string_view key(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<ParsedKey> parsed = ParsedKey::Parse(key);
  if (!parsed.ok()) return 0;
  FUZZ_CHECK(parsed->full_key == key, "the parsed key keeps its text");
  FUZZ_CHECK(key.size() <= ParsedKey::kMaxKeyLength, "no key beyond the limit parses");
  absl::StatusOr<ParsedKey> again = ParsedKey::Parse(parsed->full_key);
  FUZZ_CHECK(again.ok() && again->edge_name == parsed->edge_name &&
                 again->src_incarnation == parsed->src_incarnation,
             "parsing is stable");
  return 0;
}
