#include "src/tensor/adopted_memory.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tensorverbs {
namespace {

// Hands out `data` once; the buffer's return runs `release` and ends this allocator.
class AdoptedMemory final : public Allocator {
 public:
  AdoptedMemory(MemoryPlacement placement, void* data, size_t bytes, std::function<void()> release)
      : placement_(placement), data_(data), bytes_(bytes), release_(std::move(release)) {}

  std::string Name() const override {
    return absl::StrCat("adopted ", placement_.ToString(), " memory");
  }
  void* AllocateRaw(size_t bytes) override {
    if (handed_out_ || bytes > bytes_) return nullptr;
    handed_out_ = true;
    return data_;
  }
  void DeallocateRaw(void*, size_t) override {
    std::function<void()> release = std::move(release_);
    delete this;
    if (release) release();
  }
  MemoryPlacement Placement() const override { return placement_; }

 private:
  const MemoryPlacement placement_;
  void* const data_;
  const size_t bytes_;
  std::function<void()> release_;
  bool handed_out_ = false;
};

}  // namespace

absl::StatusOr<Tensor> AdoptMemory(MemoryPlacement placement, void* data, DataType dtype,
                                   const TensorShape& shape, std::function<void()> release) {
  auto refuse = [&release](absl::Status status) {
    if (release) release();
    return status;
  };
  if (!DataTypeCanMemCopy(dtype)) {
    return refuse(absl::InvalidArgumentError(
        absl::StrCat("adopting ", placement.ToString(), " memory as a tensor of ",
                     DataTypeName(dtype), ": string tensors are objects, not bytes to lend")));
  }
  absl::StatusOr<uint64_t> bytes = Tensor::AllocationBytes(dtype, shape);
  if (!bytes.ok()) return refuse(bytes.status());
  if (*bytes == 0) {
    if (release) release();
    return Tensor::Allocate(CpuAllocator(), dtype, shape);  // no memory to hold
  }
  if (data == nullptr) {
    return refuse(absl::InvalidArgumentError(absl::StrCat(
        "adopting ", placement.ToString(), " memory: a null pointer for ", *bytes, " bytes")));
  }
  auto* allocator =
      new AdoptedMemory(placement, data, static_cast<size_t>(*bytes), std::move(release));
  absl::StatusOr<Tensor> t = Tensor::Allocate(allocator, dtype, shape);
  if (!t.ok()) allocator->DeallocateRaw(data, 0);  // releases, once
  return t;
}

}  // namespace tensorverbs
