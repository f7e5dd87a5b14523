// Where `tensorverbs bench p2p --device` puts the tensors it sends and receives, and the
// device-side helpers it needs: a GPU allocator per device (for the process's life), a device
// tensor with the benchmark's pattern, a host copy of a device tensor to check, and the
// cudaMemcpy bandwidths between pinned host memory and a GPU, the ceilings of the proxy path's
// two copy stages, measured in the same run.
//
// Everything here runs on a tool's main thread or a recv callback; the allocators are the
// server's (thread-safe, as long as the server).
#ifndef TENSORVERBS_TOOLS_BENCH_DEVICE_H_
#define TENSORVERBS_TOOLS_BENCH_DEVICE_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "src/server/server.h"
#include "tensorverbs/allocator.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::tools {

// "cpu", "cuda" (cuda:0) or "cuda:N" -> a placement; InvalidArgument naming `flag` otherwise.
absl::StatusOr<MemoryPlacement> ParseDevice(const std::string& text, const char* flag);

// The source and destination placements of `--device SRC[,DST]` (one value: both ends).
struct DevicePair {
  MemoryPlacement src, dst;
};
absl::StatusOr<DevicePair> ParseDevicePair(const std::string& text);

// OK if tensors can live in `placement` here: host memory, or a GPU the CUDA runtime finds
// (FailedPrecondition or InvalidArgument saying why not).
absl::Status CheckDevice(const MemoryPlacement& placement);

// The allocator for `server`'s tensors in `placement`: its registered pool for host memory,
// else its pool of that GPU's memory.
absl::StatusOr<Allocator*> AllocatorFor(const MemoryPlacement& placement, Server& server);

// A uint8 tensor of `bytes` in `placement` (from AllocatorFor) holding FillBenchPattern(seed).
absl::StatusOr<Tensor> PatternTensor(const MemoryPlacement& placement, Server& server, size_t bytes,
                                     uint32_t seed);

// CRC-32C of a tensor's bytes wherever they are (a GPU's are copied to the host first).
absl::StatusOr<uint32_t> TensorCrc(const Tensor& t);

// cudaMemcpy bandwidth in GB/s between page-locked host memory and `device`, best of a few.
struct CopyBandwidth {
  double host_to_device_gbps = 0;
  double device_to_host_gbps = 0;
  double device_to_device_gbps = 0;  // between two buffers of the device, timed by an event
};
absl::StatusOr<CopyBandwidth> MeasureDeviceCopies(int device, size_t bytes);

}  // namespace tensorverbs::tools

#endif  // TENSORVERBS_TOOLS_BENCH_DEVICE_H_
