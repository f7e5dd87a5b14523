// libfabric's shm provider keeps its regions in /dev/shm under names that start with
// "<pid>:" and unlinks them when the process closes its endpoints. A SIGKILLed process never
// does, so tests that kill a peer remove its regions for it; tests that check shm cleans up
// count only their own process's regions, since other tests may run beside them.
#ifndef TENSORVERBS_TESTS_SUPPORT_SHM_REGIONS_H_
#define TENSORVERBS_TESTS_SUPPORT_SHM_REGIONS_H_

#include <dirent.h>
#include <sys/mman.h>
#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace tensorverbs::testing {

// The names of `pid`'s shm regions.
inline std::vector<std::string> ShmRegionsOf(pid_t pid) {
  std::vector<std::string> names;
  const std::string prefix = absl::StrCat(pid, ":");
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      if (absl::StartsWith(e->d_name, prefix)) names.push_back(e->d_name);
    }
    closedir(d);
  }
  return names;
}

// Removes the shm regions a killed process `pid` left behind.
inline void UnlinkShmRegionsOf(pid_t pid) {
  for (const std::string& name : ShmRegionsOf(pid)) shm_unlink(name.c_str());
}

}  // namespace tensorverbs::testing

#endif  // TENSORVERBS_TESTS_SUPPORT_SHM_REGIONS_H_
