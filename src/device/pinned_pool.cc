#include "src/device/pinned_pool.h"

#include <atomic>
#include <memory>

#include "src/common/logging.h"

namespace tensorverbs::device {

void PinPoolRegions(PoolAllocator* pool, const CudaRuntime* runtime) {
  // Shared by the two visitors: whether a region was refused (then the pool stays host).
  auto refused = std::make_shared<std::atomic<bool>>(false);
  pool->SetPinned(true);
  pool->AddRegionVisitor(
      [pool, runtime, refused](const MemoryRegion& r) {
        absl::Status s = runtime->HostRegister(r.base, r.size);
        if (!s.ok() && !refused->exchange(true)) {
          pool->SetPinned(false);
          LOG(WARNING) << "pool " << pool->Name() << ": a region of " << r.size
                       << " bytes stays pageable, so device copies of its tensors are staged "
                          "by the CUDA driver: "
                       << s.message() << " (TENSORVERBS_PIN_POOL=off turns pinning off)";
        }
      },
      [runtime](const MemoryRegion& r) {
        // A region that was never pinned answers with an error, which changes nothing.
        runtime->HostUnregister(r.base).IgnoreError();
      });
}

}  // namespace tensorverbs::device
