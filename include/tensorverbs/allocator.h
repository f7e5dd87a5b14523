// Allocator: where a tensor's memory comes from, and CpuAllocator(), the process-wide heap.
//
// Every allocation is kAlignment-aligned. A Tensor frees its buffer into the allocator it came
// from, on whichever thread drops the last reference, so an implementation must be thread-safe
// and must outlive its tensors. Task::Empty hands out tensors from the task's registered pool,
// which sends without a copy; CpuAllocator() memory is staged once when sent over RDMA.
#ifndef TENSORVERBS_PUBLIC_ALLOCATOR_H_
#define TENSORVERBS_PUBLIC_ALLOCATOR_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace tensorverbs {

// Where memory lives: host memory, pageable or page-locked (which a GPU reaches by DMA), or the
// memory of CUDA device `device`. Host code may read and write the first two only.
struct MemoryPlacement {
  enum class Kind : uint8_t { kHost, kPinnedHost, kCudaDevice };
  Kind kind = Kind::kHost;
  int device = -1;  // kCudaDevice: the device ordinal

  static MemoryPlacement Host() { return {}; }
  static MemoryPlacement PinnedHost() { return {Kind::kPinnedHost, -1}; }
  static MemoryPlacement CudaDevice(int ordinal) { return {Kind::kCudaDevice, ordinal}; }
  bool host_accessible() const { return kind != Kind::kCudaDevice; }
  std::string ToString() const;  // "host", "pinned host", "cuda:1"
  friend bool operator==(const MemoryPlacement& a, const MemoryPlacement& b) {
    return a.kind == b.kind && a.device == b.device;
  }
};

class Allocator {
 public:
  static constexpr size_t kAlignment = 64;

  virtual ~Allocator() = default;
  virtual std::string Name() const = 0;
  // Returns kAlignment-aligned memory of at least `bytes` (> 0), or nullptr when exhausted.
  virtual void* AllocateRaw(size_t bytes) = 0;
  virtual void DeallocateRaw(void* ptr, size_t bytes) = 0;
  // Where the memory it hands out lives (host, unless the allocator says otherwise).
  virtual MemoryPlacement Placement() const { return MemoryPlacement::Host(); }
};

// The process-wide heap allocator (aligned operator new). Never null.
Allocator* CpuAllocator();

}  // namespace tensorverbs

#endif  // TENSORVERBS_PUBLIC_ALLOCATOR_H_
