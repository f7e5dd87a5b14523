#include "tensorverbs/tensor.h"

#include <cstddef>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "src/common/bounded_queue.h"
#include "src/common/logging.h"
#include "src/common/sanitizers.h"
#include "src/common/status_macros.h"

namespace tensorverbs {
namespace {

// A tensor's shared count and its TensorBuffer are one small allocation (allocate_shared). A
// received tensor is usually allocated on a progress thread and dropped on a user's, so these
// blocks are recycled through a lock-free queue shared by every thread: a steady stream of
// tensors then costs no malloc and no allocator lock per tensor. ASan builds free each block, so
// that a use after free stays visible.
constexpr size_t kBufferBlockSize = 64;
constexpr size_t kSpareBufferBlocks = 4096;

BoundedQueue<void*>& SpareBufferBlocks() {
  static auto* const spares = new BoundedQueue<void*>(kSpareBufferBlocks);
  return *spares;
}

template <typename T>
struct BufferBlockAllocator {
  using value_type = T;

  BufferBlockAllocator() = default;
  template <typename U>
  BufferBlockAllocator(const BufferBlockAllocator<U>& /*other*/) {}  // NOLINT: rebinding

  T* allocate(size_t n) {
    if (n != 1 || sizeof(T) > kBufferBlockSize || alignof(T) > alignof(std::max_align_t)) {
      return std::allocator<T>().allocate(n);
    }
    void* block = nullptr;
    if (kUnderAddressSanitizer || !SpareBufferBlocks().TryPop(&block)) {
      block = ::operator new(kBufferBlockSize);
    }
    return static_cast<T*>(block);
  }

  void deallocate(T* p, size_t n) {
    if (n != 1 || sizeof(T) > kBufferBlockSize || alignof(T) > alignof(std::max_align_t)) {
      std::allocator<T>().deallocate(p, n);
      return;
    }
    if (kUnderAddressSanitizer || !SpareBufferBlocks().TryPush(p)) ::operator delete(p);
  }

  template <typename U>
  bool operator==(const BufferBlockAllocator<U>& /*other*/) const {
    return true;
  }
  template <typename U>
  bool operator!=(const BufferBlockAllocator<U>& /*other*/) const {
    return false;
  }
};

}  // namespace

TensorBuffer::TensorBuffer(Allocator* allocator, void* data, size_t size, int64_t num_strings)
    : allocator_(allocator), data_(data), size_(size), num_strings_(num_strings) {}

TensorBuffer::~TensorBuffer() {
  auto* strings = static_cast<std::string*>(data_);
  for (int64_t i = 0; i < num_strings_; ++i) strings[i].~basic_string();
  allocator_->DeallocateRaw(data_, size_);
}

absl::StatusOr<uint64_t> Tensor::AllocationBytes(DataType dtype, const TensorShape& shape) {
  if (!DataTypeFromInt(static_cast<int64_t>(dtype)).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot allocate a tensor of data type ", static_cast<int>(dtype)));
  }
  const size_t element_size = DataTypeCanMemCopy(dtype) ? DataTypeSize(dtype) : sizeof(std::string);
  int64_t bytes;
  if (__builtin_mul_overflow(shape.num_elements(), static_cast<int64_t>(element_size), &bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", DataTypeName(dtype),
                                                   shape.DebugString(),
                                                   " is larger than 2^63 bytes"));
  }
  return static_cast<uint64_t>(bytes);
}

absl::StatusOr<Tensor> Tensor::Allocate(Allocator* allocator, DataType dtype,
                                        const TensorShape& shape) {
  ASSIGN_OR_RETURN(const uint64_t bytes, AllocationBytes(dtype, shape));
  const bool is_string = !DataTypeCanMemCopy(dtype);
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = shape;
  t.total_bytes_ = static_cast<size_t>(bytes);
  if (bytes == 0) return t;
  void* data = allocator->AllocateRaw(static_cast<size_t>(bytes));
  if (data == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("allocator ", allocator->Name(),
                                                     " could not allocate ", bytes,
                                                     " bytes for ", t.DebugString()));
  }
  int64_t num_strings = 0;
  if (is_string) {
    auto* strings = static_cast<std::string*>(data);
    for (int64_t i = 0; i < shape.num_elements(); ++i) new (&strings[i]) std::string();
    num_strings = shape.num_elements();
  }
  t.buffer_ = std::allocate_shared<TensorBuffer>(BufferBlockAllocator<TensorBuffer>(), allocator,
                                                 data, static_cast<size_t>(bytes), num_strings);
  return t;
}

Tensor Tensor::Make(DataType dtype, const TensorShape& shape) {
  absl::StatusOr<Tensor> t = Allocate(CpuAllocator(), dtype, shape);
  CHECK(t.ok()) << t.status();
  return *std::move(t);
}

absl::StatusOr<Tensor> Tensor::Clone(Allocator* allocator) const {
  if (!placement().host_accessible() || !allocator->Placement().host_accessible()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Clone copies with the CPU; ", DebugString(), " is in ", placement().ToString(),
        " memory and the copy would be in ", allocator->Placement().ToString(),
        " memory: copy device memory with the CUDA runtime"));
  }
  absl::StatusOr<Tensor> copy = Allocate(allocator, dtype_, shape_);
  if (!copy.ok()) return copy.status();
  if (CanMemCopy()) {
    if (total_bytes_ > 0) std::memcpy(copy->data(), data(), total_bytes_);
  } else {
    for (int64_t i = 0; i < NumElements(); ++i) copy->strings()[i] = strings()[i];
  }
  return copy;
}

bool Tensor::ContentEquals(const Tensor& other) const {
  if (dtype_ != other.dtype_ || shape_ != other.shape_) return false;
  if (CanMemCopy()) {
    return total_bytes_ == 0 || std::memcmp(data(), other.data(), total_bytes_) == 0;
  }
  for (int64_t i = 0; i < NumElements(); ++i) {
    if (strings()[i] != other.strings()[i]) return false;
  }
  return true;
}

std::string Tensor::DebugString() const {
  return absl::StrCat(DataTypeName(dtype_), shape_.DebugString());
}

}  // namespace tensorverbs
