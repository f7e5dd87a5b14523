// RecordingAllocator: an Allocator for tests that records the largest allocation asked of it
// and allocates from the process heap (CpuAllocator). Tests use it to prove that a decoder
// refused a peer's announced size before allocating anything. Not synchronized: one thread.
#ifndef TENSORVERBS_TESTS_SUPPORT_RECORDING_ALLOCATOR_H_
#define TENSORVERBS_TESTS_SUPPORT_RECORDING_ALLOCATOR_H_

#include <algorithm>
#include <cstddef>
#include <string>

#include "src/tensor/allocator.h"

namespace tensorverbs::testing {

class RecordingAllocator final : public Allocator {
 public:
  std::string Name() const override { return "recording"; }
  void* AllocateRaw(size_t bytes) override {
    largest_ = std::max(largest_, bytes);
    return CpuAllocator()->AllocateRaw(bytes);
  }
  void DeallocateRaw(void* ptr, size_t bytes) override { CpuAllocator()->DeallocateRaw(ptr, bytes); }

  // The largest allocation so far; 0 if none.
  size_t largest() const { return largest_; }

 private:
  size_t largest_ = 0;
};

}  // namespace tensorverbs::testing

#endif  // TENSORVERBS_TESTS_SUPPORT_RECORDING_ALLOCATOR_H_
