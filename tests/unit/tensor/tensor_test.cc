#include "tensorverbs/tensor.h"

#include <gtest/gtest.h>

#include <cstring>

namespace tensorverbs {
namespace {

TEST(Tensor, AllocatesAlignedBuffersOfTheRightSize) {
  for (DataType d : AllDataTypes()) {
    absl::StatusOr<Tensor> t = Tensor::Allocate(CpuAllocator(), d, TensorShape::Of({3, 5}));
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->dtype(), d);
    EXPECT_EQ(t->NumElements(), 15);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data()) % Allocator::kAlignment, 0u);
    if (d == DataType::kString) {
      EXPECT_FALSE(t->CanMemCopy());
      EXPECT_EQ(t->strings()[14], "");
    } else {
      EXPECT_EQ(t->TotalBytes(), 15 * DataTypeSize(d));
    }
  }
}

TEST(Tensor, EmptyTensorHasNoBuffer) {
  Tensor t = Tensor::Make(DataType::kFloat32, TensorShape::Of({0, 4}));
  EXPECT_TRUE(t.IsInitialized());
  EXPECT_EQ(t.TotalBytes(), 0u);
  EXPECT_EQ(t.data(), nullptr);
  EXPECT_FALSE(Tensor().IsInitialized());
}

TEST(Tensor, CopiesShareTheBufferAndCloneCopiesIt) {
  Tensor a = Tensor::Make(DataType::kInt32, TensorShape::Of({4}));
  for (int i = 0; i < 4; ++i) a.flat<int32_t>()[i] = i;
  Tensor b = a;
  EXPECT_TRUE(a.SharesBufferWith(b));
  EXPECT_EQ(a.buffer().use_count(), 2);
  absl::StatusOr<Tensor> c = a.Clone(CpuAllocator());
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->SharesBufferWith(a));
  EXPECT_TRUE(c->ContentEquals(a));
  c->flat<int32_t>()[0] = 9;
  EXPECT_FALSE(c->ContentEquals(a));
  EXPECT_EQ(a.flat<int32_t>()[0], 0);
}

TEST(Tensor, StringsAreConstructedClonedAndDestroyed) {
  Tensor s = Tensor::Make(DataType::kString, TensorShape::Of({3}));
  s.strings()[0] = "a";
  s.strings()[1] = std::string(1000, 'x');  // heap-allocated: a leak would show under ASan
  absl::StatusOr<Tensor> c = s.Clone(CpuAllocator());
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->ContentEquals(s));
  EXPECT_EQ(c->strings()[1].size(), 1000u);
}

TEST(Tensor, ReportsOverflowAndExhaustion) {
  absl::StatusOr<Tensor> huge = Tensor::Allocate(
      CpuAllocator(), DataType::kComplex128, TensorShape::Of({int64_t{1} << 62}));
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<Tensor> too_much = Tensor::Allocate(
      CpuAllocator(), DataType::kUInt8, TensorShape::Of({int64_t{1} << 60}));
  EXPECT_EQ(too_much.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(Tensor::Allocate(CpuAllocator(), DataType::kInvalid, TensorShape()).ok());
}

}  // namespace
}  // namespace tensorverbs
