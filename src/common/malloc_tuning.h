// Process-wide glibc malloc settings that keep large transfers off fresh pages.
//
// gRPC allocates its receive buffers from the heap and frees them after each message; glibc then
// returns the top of the heap to the OS (trims it), and the next message faults every page in
// again — at ~11 µs per 4 KiB page on the VMs this runs on, that halves gRPC throughput for
// tensors of 1 MiB and more. ApplyMallocTuning raises the trim threshold (TENSORVERBS_MALLOC_TRIM_MB)
// and pins the mmap threshold at glibc's maximum (setting one disables glibc's dynamic
// adjustment of both). Called once by Server; TENSORVERBS_MALLOC_TUNING=0 turns it off.
// Thread-safe and idempotent.
#ifndef TENSORVERBS_COMMON_MALLOC_TUNING_H_
#define TENSORVERBS_COMMON_MALLOC_TUNING_H_

namespace tensorverbs {

// Returns true if the settings were applied (now or earlier).
bool ApplyMallocTuning();

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_MALLOC_TUNING_H_
