#include "src/common/malloc_tuning.h"

#include <malloc.h>

#include <mutex>

#include "src/common/logging.h"

namespace tensorverbs {

bool ApplyMallocTuning(int64_t trim_bytes) {
  static const bool applied = [trim_bytes] {
#if defined(__GLIBC__)
    // 32 MiB is glibc's largest mmap threshold on 64-bit hosts.
    const bool ok = mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 &&
                    mallopt(M_TRIM_THRESHOLD, static_cast<int>(trim_bytes)) == 1;
    if (!ok) LOG(WARNING) << "mallopt refused the malloc tuning; large transfers may be slower";
    return ok;
#else
    return false;
#endif
  }();
  return applied;
}

}  // namespace tensorverbs
