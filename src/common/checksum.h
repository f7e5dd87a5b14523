// CRC-32C (Castagnoli) over a byte range: the data-validation checksum.
//
// Uses the SSE4.2 crc32 instruction when the CPU has it (about 8 bytes a cycle) and a
// slicing-by-8 table otherwise; both give identical results. Thread-safe, no state.
#ifndef TENSORVERBS_COMMON_CHECKSUM_H_
#define TENSORVERBS_COMMON_CHECKSUM_H_

#include <cstddef>
#include <cstdint>

namespace tensorverbs {

// Extends `crc` (0 to start) with `len` bytes at `data`.
uint32_t Crc32c(const void* data, size_t len, uint32_t crc = 0);

namespace checksum_internal {
uint32_t Crc32cPortable(const void* data, size_t len, uint32_t crc);
bool HaveHardwareCrc32c();
}  // namespace checksum_internal

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_CHECKSUM_H_
