// The two ways the shmem fabric can move a write's bytes into a peer's mapping: memcpy, and
// StreamingCopy here, which shmem.cc uses from kStreamingCopyBytes up (measured against each
// other per size by bench/copy_bench.cc).
//
// StreamingCopy writes the destination with non-temporal stores: the bytes go to memory without
// first pulling each destination line into this core's cache, which is the reader's memory
// anyway. It ends with a store fence, so a release store after it (publishing the immediate)
// orders the bytes before it as plain stores would be. Any thread; no state.
#ifndef TENSORVERBS_FABRIC_SHMEM_COPY_H_
#define TENSORVERBS_FABRIC_SHMEM_COPY_H_

#include <cstddef>

namespace tensorverbs::fabric::shmem {

void StreamingCopy(void* dst, const void* src, size_t n);

}  // namespace tensorverbs::fabric::shmem

#endif  // TENSORVERBS_FABRIC_SHMEM_COPY_H_
