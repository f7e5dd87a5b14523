// Process-wide glibc malloc settings that keep large transfers off fresh pages.
//
// gRPC allocates its receive buffers from the heap and frees them after each message; glibc then
// returns the top of the heap to the OS (trims it), and the next message faults every page in
// again — at ~11 µs per 4 KiB page on the VMs this runs on, that halves gRPC throughput for
// tensors of 1 MiB and more. ApplyMallocTuning raises the trim threshold (TENSORVERBS_MALLOC_TRIM_MB)
// and pins the mmap threshold at glibc's maximum (setting one disables glibc's dynamic
// adjustment of both). Called by Server unless ServerOptions::malloc_tuning is off
// (TENSORVERBS_MALLOC_TUNING=0). Thread-safe; the first call's settings stay.
#ifndef TENSORVERBS_COMMON_MALLOC_TUNING_H_
#define TENSORVERBS_COMMON_MALLOC_TUNING_H_

#include <cstdint>

namespace tensorverbs {

// Keeps `trim_bytes` of freed heap before glibc returns it to the OS. Returns true if the
// settings were applied (now or by an earlier call).
bool ApplyMallocTuning(int64_t trim_bytes);

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_MALLOC_TUNING_H_
