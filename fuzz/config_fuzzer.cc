// Fuzzes the variables a process reads (TENSORVERBS_* and the RDMA_* of the seeds). Each input
// line is "<byte><value>": the byte picks a known variable (so the fuzzer reaches every parser),
// the rest is its value. A bad value is InvalidArgument naming a variable the input set, never a
// crash.
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "fuzz/fuzz_check.h"
#include "src/common/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using tensorverbs::Config;
  const std::vector<std::string>& known = Config::KnownVariables();
  std::map<std::string, std::string> env;
  const absl::string_view input(reinterpret_cast<const char*>(data), size);
  for (absl::string_view line : absl::StrSplit(input, '\n')) {
    if (line.empty()) continue;
    const auto pick = static_cast<unsigned char>(line[0]);
    // One name in 16 is made up, for the unknown-variable check.
    const std::string name = pick % 16 == 15 ? "TENSORVERBS_MADE_UP" : known[pick % known.size()];
    env[name] = std::string(line.substr(1));
  }
  absl::StatusOr<Config> config = Config::FromEnvironment(env);
  if (!config.ok()) {
    FUZZ_CHECK(config.status().code() == absl::StatusCode::kInvalidArgument,
               "a bad value is InvalidArgument");
    bool names_one = false;
    for (const auto& [name, value] : env) {
      names_one |= config.status().message().find(name) != absl::string_view::npos;
    }
    FUZZ_CHECK(names_one, "the error names a variable the input set");
  }
  return 0;
}
