// TensorShape: the dimensions of a tensor (rank 0 .. kMaxRank, int64 sizes).
//
// Built only through Create(), which rejects negative sizes and element counts or byte sizes
// that overflow int64, so every TensorShape in the process is valid. A value type; not
// synchronized.
#ifndef TENSORVERBS_PUBLIC_TENSOR_SHAPE_H_
#define TENSORVERBS_PUBLIC_TENSOR_SHAPE_H_

#include <cstdint>
#include <initializer_list>
#include <string>

#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace tensorverbs {

class TensorShape {
 public:
  // TensorFlow's limit; wire formats store the rank in one byte.
  static constexpr int kMaxRank = 254;

  TensorShape() = default;  // a scalar

  static absl::StatusOr<TensorShape> Create(absl::Span<const int64_t> dims);

  // For literals in code and tests; CHECK-fails on an invalid shape (never use for input).
  static TensorShape Of(std::initializer_list<int64_t> dims);

  int rank() const { return static_cast<int>(dims_.size()); }
  // Back to a scalar, in place.
  void Clear() { dims_.clear(); }
  int64_t dim(int i) const { return dims_[i]; }
  absl::Span<const int64_t> dims() const { return dims_; }
  int64_t num_elements() const { return num_elements_; }

  std::string DebugString() const;  // "[2,3]"

  friend bool operator==(const TensorShape& a, const TensorShape& b) { return a.dims_ == b.dims_; }
  friend bool operator!=(const TensorShape& a, const TensorShape& b) { return !(a == b); }

 private:
  absl::InlinedVector<int64_t, 4> dims_;
  int64_t num_elements_ = 1;
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_PUBLIC_TENSOR_SHAPE_H_
