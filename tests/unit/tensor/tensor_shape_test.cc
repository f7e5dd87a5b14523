#include "tensorverbs/tensor_shape.h"

#include <gtest/gtest.h>

#include <limits>
#include <vector>

namespace tensorverbs {
namespace {

TEST(TensorShape, ScalarAndEmpty) {
  TensorShape scalar;
  EXPECT_EQ(scalar.rank(), 0);
  EXPECT_EQ(scalar.num_elements(), 1);
  EXPECT_EQ(scalar.DebugString(), "[]");
  TensorShape empty = TensorShape::Of({3, 0, 5});
  EXPECT_EQ(empty.num_elements(), 0);
}

TEST(TensorShape, RanksUpTo8AndBeyond) {
  std::vector<int64_t> dims;
  int64_t expected = 1;
  for (int rank = 1; rank <= 8; ++rank) {
    dims.push_back(rank + 1);
    expected *= rank + 1;
    absl::StatusOr<TensorShape> s = TensorShape::Create(dims);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->rank(), rank);
    EXPECT_EQ(s->num_elements(), expected);
    EXPECT_EQ(s->dim(rank - 1), rank + 1);
  }
  std::vector<int64_t> many(TensorShape::kMaxRank, 1);
  EXPECT_TRUE(TensorShape::Create(many).ok());
  many.push_back(1);
  EXPECT_EQ(TensorShape::Create(many).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TensorShape, RejectsNegativeAndOverflow) {
  EXPECT_EQ(TensorShape::Create({2, -1}).status().code(), absl::StatusCode::kInvalidArgument);
  const int64_t big = int64_t{1} << 32;
  EXPECT_EQ(TensorShape::Create({big, big}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(TensorShape::Create({big, (int64_t{1} << 30)}).ok());
  const int64_t max = std::numeric_limits<int64_t>::max();
  EXPECT_TRUE(TensorShape::Create({max}).ok());
  EXPECT_FALSE(TensorShape::Create({max, 2}).ok());
  // The running product overflows before the zero is reached; TensorFlow rejects this too.
  EXPECT_FALSE(TensorShape::Create({max, 2, 0}).ok());
}

TEST(TensorShape, Equality) {
  EXPECT_EQ(TensorShape::Of({2, 3}), TensorShape::Of({2, 3}));
  EXPECT_NE(TensorShape::Of({2, 3}), TensorShape::Of({3, 2}));
  EXPECT_NE(TensorShape::Of({6}), TensorShape::Of({2, 3}));
}

}  // namespace
}  // namespace tensorverbs
