// PinPoolRegions: page-locks a host pool's regions with the CUDA runtime (cudaHostRegister), the
// ones it has and every one it makes later, so device copies to and from its tensors (staging
// buffers, proxies) go by DMA, and marks the pool "pinned host". A region goes back to pageable
// memory (cudaHostUnregister) when the pool releases it.
//
// Who calls it: Server, at start, when TENSORVERBS_PIN_POOL asks for it and a GPU is there. The
// visitor it adds runs under the pool's lock on whichever thread makes or releases a region,
// and lives as long as the pool. A region the runtime refuses stays pageable: the pool is then
// marked host again and one warning says why (pinning is an optimization; nothing fails).
#ifndef TENSORVERBS_DEVICE_PINNED_POOL_H_
#define TENSORVERBS_DEVICE_PINNED_POOL_H_

#include "src/device/cuda_runtime.h"
#include "src/tensor/allocator.h"

namespace tensorverbs::device {

void PinPoolRegions(PoolAllocator* pool, const CudaRuntime* runtime);

}  // namespace tensorverbs::device

#endif  // TENSORVERBS_DEVICE_PINNED_POOL_H_
