// CudaAllocator: tensors in the memory of one CUDA device (cudaMalloc/cudaFree through
// CudaRuntime), with Placement() cuda:N so every layer can tell them from host memory.
//
// Who calls it: code that makes device tensors (tests, tools; the transports' device paths to
// come). Thread-safe, as the CUDA runtime is; it must outlive its tensors. AllocateRaw returns
// nullptr when the device is out of memory (Tensor::Allocate turns that into
// ResourceExhausted); the runtime's message for the last failure is kept for diagnostics.
#ifndef TENSORVERBS_DEVICE_CUDA_ALLOCATOR_H_
#define TENSORVERBS_DEVICE_CUDA_ALLOCATOR_H_

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "src/common/mutex.h"
#include "src/device/cuda_runtime.h"
#include "src/tensor/allocator.h"
#include "tensorverbs/allocator.h"

namespace tensorverbs::device {

class CudaAllocator final : public Allocator {
 public:
  // An allocator on `device` of `runtime`; InvalidArgument for an ordinal it does not have.
  static absl::StatusOr<std::unique_ptr<CudaAllocator>> Create(const CudaRuntime* runtime,
                                                               int device);

  std::string Name() const override;
  void* AllocateRaw(size_t bytes) override;
  void DeallocateRaw(void* ptr, size_t bytes) override;
  MemoryPlacement Placement() const override { return MemoryPlacement::CudaDevice(device_); }

  int device() const { return device_; }
  size_t bytes_in_use() const { return in_use_.load(std::memory_order_relaxed); }
  // Why the last AllocateRaw that returned nullptr failed (OK if none did).
  absl::Status last_error() const;

 private:
  CudaAllocator(const CudaRuntime* runtime, int device) : runtime_(runtime), device_(device) {}

  const CudaRuntime* const runtime_;
  const int device_;
  std::atomic<size_t> in_use_{0};
  mutable Mutex mu_;
  absl::Status last_error_ ABSL_GUARDED_BY(mu_);
};

// A pool of `device`'s memory: regions of options.region_bytes (or one tensor's size, if
// larger) from cudaMalloc, carved into tensors and reused as the host pool does, so a transfer
// pays no cudaMalloc (slow) or cudaFree (which waits for the whole device) per tensor, and
// region visitors see each region once (where fabrics register GPU memory). Placement cuda:N.
// InvalidArgument for an ordinal the runtime does not have. `runtime` outlives the pool; the
// pool outlives its tensors.
absl::StatusOr<std::unique_ptr<PoolAllocator>> NewCudaPool(const CudaRuntime* runtime, int device,
                                                           PoolAllocator::Options options);

}  // namespace tensorverbs::device

#endif  // TENSORVERBS_DEVICE_CUDA_ALLOCATOR_H_
