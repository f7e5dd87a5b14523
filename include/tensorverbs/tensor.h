// Tensor: a typed, shaped view of a reference-counted, 64-byte-aligned buffer.
//
// Copying a Tensor shares the buffer (like TensorFlow's); Clone() copies the bytes. The buffer
// returns its memory to the Allocator it came from when the last Tensor referring to it goes.
// POD tensors hold num_elements * DataTypeSize bytes; string tensors hold std::string objects
// and report CanMemCopy() == false. A Tensor is not synchronized: share it across threads only
// for reading.
#ifndef TENSORVERBS_PUBLIC_TENSOR_H_
#define TENSORVERBS_PUBLIC_TENSOR_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "tensorverbs/allocator.h"
#include "tensorverbs/tensor_shape.h"
#include "tensorverbs/types.h"

namespace tensorverbs {

class TensorBuffer {
 public:
  // Takes ownership of `data` (from `allocator`, `size` bytes). For string tensors,
  // `num_strings` std::string objects live at `data` and are destroyed first.
  TensorBuffer(Allocator* allocator, void* data, size_t size, int64_t num_strings);
  TensorBuffer(const TensorBuffer&) = delete;
  TensorBuffer& operator=(const TensorBuffer&) = delete;
  ~TensorBuffer();

  void* data() const { return data_; }
  size_t size() const { return size_; }
  Allocator* allocator() const { return allocator_; }

 private:
  Allocator* allocator_;
  void* data_;
  size_t size_;
  int64_t num_strings_;
};

class Tensor {
 public:
  Tensor() = default;  // uninitialized: dtype kInvalid, no buffer

  // Allocates a tensor from `allocator`. String elements start empty; POD bytes are
  // uninitialized. ResourceExhausted if the allocator is out of memory, InvalidArgument if the
  // byte size overflows.
  static absl::StatusOr<Tensor> Allocate(Allocator* allocator, DataType dtype,
                                         const TensorShape& shape);

  // The bytes Allocate() takes for `dtype` and `shape` (the elements; for strings, their
  // std::string objects), checked before anything is allocated: InvalidArgument for a data type
  // it does not know or a size past 2^63.
  static absl::StatusOr<uint64_t> AllocationBytes(DataType dtype, const TensorShape& shape);

  // Allocate() from CpuAllocator() that CHECK-fails on error: for literals in tools and tests.
  static Tensor Make(DataType dtype, const TensorShape& shape);

  DataType dtype() const { return dtype_; }
  const TensorShape& shape() const { return shape_; }
  int64_t NumElements() const { return shape_.num_elements(); }
  bool IsInitialized() const { return dtype_ != DataType::kInvalid; }
  // Back to uninitialized, dropping this reference to the buffer.
  void Clear() {
    buffer_.reset();
    dtype_ = DataType::kInvalid;
    total_bytes_ = 0;
    shape_.Clear();
  }
  bool CanMemCopy() const { return DataTypeCanMemCopy(dtype_); }

  // Bytes of element storage (POD) or num_elements * sizeof(std::string) (string).
  size_t TotalBytes() const { return total_bytes_; }

  // Element storage; nullptr for an empty tensor.
  void* data() const { return buffer_ ? buffer_->data() : nullptr; }
  template <typename T>
  T* flat() const {
    return static_cast<T*>(data());
  }
  std::string* strings() const { return static_cast<std::string*>(data()); }

  Allocator* allocator() const { return buffer_ ? buffer_->allocator() : nullptr; }
  // Where the elements live; host for a tensor without a buffer.
  MemoryPlacement placement() const {
    return buffer_ && buffer_->allocator() ? buffer_->allocator()->Placement()
                                           : MemoryPlacement::Host();
  }
  const std::shared_ptr<TensorBuffer>& buffer() const { return buffer_; }
  bool SharesBufferWith(const Tensor& other) const {
    return buffer_ != nullptr && buffer_ == other.buffer_;
  }

  // A deep copy in memory from `allocator`; FailedPrecondition when either memory is a GPU's
  // (the CPU copies).
  absl::StatusOr<Tensor> Clone(Allocator* allocator) const;

  // Same dtype, shape and element values.
  bool ContentEquals(const Tensor& other) const;

  std::string DebugString() const;  // "float32[2,3]"

 private:
  DataType dtype_ = DataType::kInvalid;
  TensorShape shape_;
  size_t total_bytes_ = 0;
  std::shared_ptr<TensorBuffer> buffer_;
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_PUBLIC_TENSOR_H_
