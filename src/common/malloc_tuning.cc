#include "src/common/malloc_tuning.h"

#include <malloc.h>

#include <mutex>

#include "src/common/config.h"
#include "src/common/logging.h"

namespace tensorverbs {

bool ApplyMallocTuning() {
  static const bool applied = [] {
    const Config& config = Config::Get();
    if (!config.malloc_tuning) return false;
#if defined(__GLIBC__)
    // 32 MiB is glibc's largest mmap threshold on 64-bit hosts.
    const bool ok = mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 &&
                    mallopt(M_TRIM_THRESHOLD, static_cast<int>(config.malloc_trim_bytes)) == 1;
    if (!ok) LOG(WARNING) << "mallopt refused the malloc tuning; large transfers may be slower";
    return ok;
#else
    return false;
#endif
  }();
  return applied;
}

}  // namespace tensorverbs
