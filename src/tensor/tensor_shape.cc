#include "tensorverbs/tensor_shape.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/common/logging.h"

namespace tensorverbs {

absl::StatusOr<TensorShape> TensorShape::Create(absl::Span<const int64_t> dims) {
  if (dims.size() > static_cast<size_t>(kMaxRank)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape rank ", dims.size(), " exceeds the maximum rank ", kMaxRank));
  }
  TensorShape shape;
  int64_t n = 1;
  for (size_t i = 0; i < dims.size(); ++i) {
    int64_t d = dims[i];
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape dimension ", i, " is negative (", d, ")"));
    }
    int64_t product;
    if (__builtin_mul_overflow(n, d, &product)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shape [", absl::StrJoin(dims, ","), "] has more elements than fit in int64"));
    }
    n = product;
  }
  shape.dims_.assign(dims.begin(), dims.end());
  shape.num_elements_ = n;
  return shape;
}

TensorShape TensorShape::Of(std::initializer_list<int64_t> dims) {
  absl::StatusOr<TensorShape> shape = Create(dims);
  CHECK(shape.ok()) << shape.status();
  return *std::move(shape);
}

std::string TensorShape::DebugString() const {
  return absl::StrCat("[", absl::StrJoin(dims_, ","), "]");
}

}  // namespace tensorverbs
