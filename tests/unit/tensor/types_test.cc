#include "tensorverbs/types.h"

#include <gtest/gtest.h>

namespace tensorverbs {
namespace {

TEST(DataType, SizesAndNames) {
  EXPECT_EQ(DataTypeSize(DataType::kFloat16), 2u);
  EXPECT_EQ(DataTypeSize(DataType::kBFloat16), 2u);
  EXPECT_EQ(DataTypeSize(DataType::kFloat32), 4u);
  EXPECT_EQ(DataTypeSize(DataType::kFloat64), 8u);
  EXPECT_EQ(DataTypeSize(DataType::kComplex64), 8u);
  EXPECT_EQ(DataTypeSize(DataType::kComplex128), 16u);
  EXPECT_EQ(DataTypeSize(DataType::kBool), 1u);
  EXPECT_EQ(DataTypeSize(DataType::kUInt64), 8u);
  EXPECT_EQ(DataTypeSize(DataType::kString), 0u);
  EXPECT_FALSE(DataTypeCanMemCopy(DataType::kString));
  EXPECT_TRUE(DataTypeCanMemCopy(DataType::kInt8));
  EXPECT_EQ(AllDataTypes().size(), 16u);
  for (DataType d : AllDataTypes()) {
    EXPECT_EQ(*DataTypeFromName(DataTypeName(d)), d);
    EXPECT_EQ(*DataTypeFromInt(static_cast<int>(d)), d);
  }
}

TEST(DataType, MatchesTensorFlowValues) {
  EXPECT_EQ(static_cast<int>(DataType::kFloat32), 1);
  EXPECT_EQ(static_cast<int>(DataType::kString), 7);
  EXPECT_EQ(static_cast<int>(DataType::kBFloat16), 14);
  EXPECT_EQ(static_cast<int>(DataType::kFloat16), 19);
  EXPECT_EQ(static_cast<int>(DataType::kUInt64), 23);
}

TEST(DataType, RejectsUnknown) {
  EXPECT_FALSE(DataTypeFromInt(0).ok());
  EXPECT_FALSE(DataTypeFromInt(11).ok());
  EXPECT_FALSE(DataTypeFromInt(1000).ok());
  EXPECT_FALSE(DataTypeFromName("float").ok());
  EXPECT_EQ(DataTypeName(static_cast<DataType>(99)), "invalid(99)");
}

}  // namespace
}  // namespace tensorverbs
