#include "src/common/host_identity.h"

#include <sys/stat.h>

#include <cstdio>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace tensorverbs {

const std::string& ThisHostIdentity() {
  static const std::string* identity = [] {
    std::string boot = "unknown-boot";
    if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
      char line[64] = {};
      if (std::fgets(line, sizeof(line), f) != nullptr) {
        boot = std::string(absl::StripAsciiWhitespace(line));
      }
      std::fclose(f);
    }
    struct stat ns {};
    const uint64_t netns = stat("/proc/self/ns/net", &ns) == 0 ? ns.st_ino : 0;
    return new std::string(absl::StrCat(boot, "/net:", netns));
  }();
  return *identity;
}

}  // namespace tensorverbs
