#include "src/tensor/tensor_codec.h"

#include <gtest/gtest.h>

#include <random>

namespace tensorverbs {
namespace {

Tensor Filled(DataType d, const TensorShape& shape, uint32_t seed) {
  Tensor t = Tensor::Make(d, shape);
  std::mt19937 rng(seed);
  if (t.CanMemCopy()) {
    auto* p = static_cast<unsigned char*>(t.data());
    for (size_t i = 0; i < t.TotalBytes(); ++i) p[i] = static_cast<unsigned char>(rng());
  } else {
    for (int64_t i = 0; i < t.NumElements(); ++i) {
      t.strings()[i] = std::string(rng() % 40, static_cast<char>('a' + i % 26));
    }
  }
  return t;
}

TEST(TensorCodec, RoundTripsEveryDtypeIncludingEmpty) {
  for (DataType d : AllDataTypes()) {
    for (const TensorShape& shape :
         {TensorShape(), TensorShape::Of({0}), TensorShape::Of({7}), TensorShape::Of({2, 3, 4}),
          TensorShape::Of({1, 1, 1, 1, 1, 1, 1, 2})}) {
      Tensor t = Filled(d, shape, 3);
      proto::TensorProto p;
      TensorToProto(t, &p);
      std::string bytes = p.SerializeAsString();
      proto::TensorProto back_proto;
      ASSERT_TRUE(back_proto.ParseFromString(bytes));
      absl::StatusOr<Tensor> back = TensorFromProto(back_proto, CpuAllocator());
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_TRUE(back->ContentEquals(t)) << t.DebugString();
    }
  }
}

TEST(TensorCodec, StringsWithEmbeddedZerosAndEmptyElements) {
  Tensor t = Tensor::Make(DataType::kString, TensorShape::Of({3}));
  t.strings()[0] = std::string("a\0b", 3);
  t.strings()[2] = std::string(100000, 'z');
  proto::TensorProto p;
  TensorToProto(t, &p);
  absl::StatusOr<Tensor> back = TensorFromProto(p, CpuAllocator());
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(back->ContentEquals(t));
  EXPECT_EQ(back->strings()[0].size(), 3u);
}

TEST(TensorCodec, RejectsInconsistentProtos) {
  proto::TensorProto p;
  p.set_dtype(1);
  p.mutable_tensor_shape()->add_dim()->set_size(4);
  p.set_tensor_content(std::string(15, 'x'));  // 16 expected
  EXPECT_EQ(TensorFromProto(p, CpuAllocator()).status().code(),
            absl::StatusCode::kInvalidArgument);
  p.set_dtype(12345);
  EXPECT_FALSE(TensorFromProto(p, CpuAllocator()).ok());
  p.set_dtype(1);
  p.mutable_tensor_shape()->mutable_dim(0)->set_size(-4);
  EXPECT_FALSE(TensorFromProto(p, CpuAllocator()).ok());
  proto::TensorProto s;
  s.set_dtype(static_cast<int>(DataType::kString));
  s.mutable_tensor_shape()->add_dim()->set_size(2);
  s.add_string_val("only one");
  EXPECT_FALSE(TensorFromProto(s, CpuAllocator()).ok());
  // A shape whose byte size overflows must not allocate.
  proto::TensorProto o;
  o.set_dtype(static_cast<int>(DataType::kFloat64));
  o.mutable_tensor_shape()->add_dim()->set_size(int64_t{1} << 61);
  EXPECT_FALSE(TensorFromProto(o, CpuAllocator()).ok());
}

TEST(TensorCodec, CountsAnEncodingsStringsAndDimensionsWithoutParsingIt) {
  Tensor t = Filled(DataType::kString, TensorShape::Of({3, 5}), 7);
  proto::TensorProto p;
  TensorToProto(t, &p);
  const std::string bytes = p.SerializeAsString();
  absl::StatusOr<EncodedTensorCounts> counts = CountEncodedTensor(bytes);
  ASSERT_TRUE(counts.ok()) << counts.status();
  EXPECT_EQ(counts->strings, 15);
  EXPECT_EQ(counts->dims, 2);
  absl::StatusOr<Tensor> back = TensorFromEncodedProto(bytes, *counts, CpuAllocator());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->ContentEquals(t));

  // Two shape fields merge when parsed, so their dimensions add up.
  proto::TensorProto deep;
  deep.set_dtype(static_cast<int>(DataType::kFloat32));
  for (int i = 0; i < 200; ++i) deep.mutable_tensor_shape()->add_dim()->set_size(1);
  std::string twice = deep.SerializeAsString();
  twice += twice;
  counts = CountEncodedTensor(twice);
  ASSERT_TRUE(counts.ok()) << counts.status();
  EXPECT_EQ(counts->dims, 400);
  EXPECT_EQ(TensorFromEncodedProto(twice, *counts, CpuAllocator()).status().code(),
            absl::StatusCode::kDataLoss);

  // Every truncation and random bytes: a count or DataLoss, never a crash.
  for (size_t len = 0; len < bytes.size(); ++len) {
    absl::StatusOr<EncodedTensorCounts> c = CountEncodedTensor(bytes.substr(0, len));
    if (!c.ok()) {
      EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss);
    }
  }
  std::mt19937 rng(5);
  for (int i = 0; i < 2000; ++i) {
    std::string noise(rng() % 64, '\0');
    for (char& c : noise) c = static_cast<char>(rng());
    absl::StatusOr<EncodedTensorCounts> c = CountEncodedTensor(noise);
    if (c.ok()) (void)TensorFromEncodedProto(noise, *c, CpuAllocator());
  }
}

// Parsing keeps unknown fields (tens of bytes each for two bytes of wire), so a peer could make
// a small encoding cost a large parse by padding it with them. The counter accepts only the
// fields this project writes, each with its own wire type, at every level.
TEST(TensorCodec, CountingRefusesFieldsThisProjectNeverWrites) {
  proto::TensorProto p;
  p.set_dtype(static_cast<int>(DataType::kFloat32));
  p.mutable_tensor_shape()->add_dim()->set_size(2);
  p.set_tensor_content(std::string(8, '\1'));
  const std::string good = p.SerializeAsString();
  ASSERT_TRUE(CountEncodedTensor(good).ok());

  auto expect_refused = [](const std::string& bytes, absl::string_view why) {
    absl::StatusOr<EncodedTensorCounts> c = CountEncodedTensor(bytes);
    ASSERT_FALSE(c.ok()) << why;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss) << why;
  };
  // A flood of unknown varint fields (field 3: tag 0x18, value 0) after a valid tensor.
  std::string flood = good;
  for (int i = 0; i < 100000; ++i) flood += std::string("\x18\x00", 2);
  expect_refused(flood, "unknown varint fields");
  // An unknown length-delimited field, and a group (start-group tag of field 9).
  expect_refused(good + std::string("\x2a\x00", 2), "unknown field 5");
  expect_refused(good + std::string("\x4b\x4c", 2), "group");
  // The known fields with the wrong wire type: dtype delimited, string_val as a varint.
  expect_refused(std::string("\x0a\x00", 2), "dtype as bytes");
  expect_refused(std::string("\x40\x01", 2), "string_val as a varint");
  // Unknown fields inside the shape and inside a dimension.
  expect_refused(std::string("\x12\x02\x08\x01", 4), "shape field 1");
  expect_refused(std::string("\x12\x04\x12\x02\x10\x01", 6), "dimension field 2");
  expect_refused(std::string("\x12\x03\x12\x01\x0a", 5), "dimension size as bytes");
  // A dimension claiming more bytes than its shape holds (the shape is followed by content
  // bytes the dimension would swallow without the check).
  expect_refused(std::string("\x12\x02\x12\x05\x22\x03\x08\x01\x00", 9),
                 "dimension longer than its shape");
}

}  // namespace
}  // namespace tensorverbs
