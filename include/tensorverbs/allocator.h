// Allocator: where a tensor's memory comes from, and CpuAllocator(), the process-wide heap.
//
// Every allocation is kAlignment-aligned. A Tensor frees its buffer into the allocator it came
// from, on whichever thread drops the last reference, so an implementation must be thread-safe
// and must outlive its tensors. Task::Empty hands out tensors from the task's registered pool,
// which sends without a copy; CpuAllocator() memory is staged once when sent over RDMA.
#ifndef TENSORVERBS_PUBLIC_ALLOCATOR_H_
#define TENSORVERBS_PUBLIC_ALLOCATOR_H_

#include <cstddef>
#include <string>

namespace tensorverbs {

class Allocator {
 public:
  static constexpr size_t kAlignment = 64;

  virtual ~Allocator() = default;
  virtual std::string Name() const = 0;
  // Returns kAlignment-aligned memory of at least `bytes` (> 0), or nullptr when exhausted.
  virtual void* AllocateRaw(size_t bytes) = 0;
  virtual void DeallocateRaw(void* ptr, size_t bytes) = 0;
};

// The process-wide heap allocator (aligned operator new). Never null.
Allocator* CpuAllocator();

}  // namespace tensorverbs

#endif  // TENSORVERBS_PUBLIC_ALLOCATOR_H_
