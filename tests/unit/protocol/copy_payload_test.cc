#include "src/protocol/copy_payload.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "proto/tensor.pb.h"
#include "src/rendezvous/remote_rendezvous.h"
#include "tests/support/recording_allocator.h"

namespace tensorverbs::protocol {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kLimit = kDefaultMaxTensorBytes;

// A payload whose proto header is `header` and which carries no raw content.
std::vector<uint8_t> WithHeader(const proto::TensorProto& header) {
  const std::string h = header.SerializeAsString();
  std::vector<uint8_t> out(kCopyPayloadHeaderBytes, 0);
  const uint32_t magic = 0x50435654;
  std::memcpy(out.data(), &magic, 4);
  out[4] = 1;
  const auto len = static_cast<uint32_t>(h.size());
  std::memcpy(out.data() + 8, &len, 4);
  out.insert(out.end(), h.begin(), h.end());
  return out;
}

std::vector<uint8_t> Lay(const Tensor& t, bool dead) {
  CopyPayload p(t, dead);
  std::vector<uint8_t> out(p.Size());
  p.WriteTo(out.data());
  return out;
}

Tensor Pattern(DataType d, TensorShape shape, int seed) {
  Tensor t = Tensor::Make(d, shape);
  if (t.CanMemCopy()) {
    auto* b = static_cast<uint8_t*>(t.data());
    for (size_t i = 0; i < t.TotalBytes(); ++i) b[i] = static_cast<uint8_t>(seed + i * 7);
  } else {
    for (int64_t i = 0; i < t.NumElements(); ++i) t.strings()[i] = std::string(i % 9, 'a' + seed);
  }
  return t;
}

TEST(CopyPayload, RoundTripsEveryDtypeShapeStringsAndDeadness) {
  for (DataType d : AllDataTypes()) {
    for (const TensorShape& shape : {TensorShape(), TensorShape::Of({0, 3}), TensorShape::Of({5}),
                                     TensorShape::Of({2, 1, 3, 1, 2, 1, 2, 5})}) {
      Tensor t = Pattern(d, shape, 3);
      std::vector<uint8_t> bytes = Lay(t, false);
      // The receiver's buffer is often larger than the payload (a buffer kept from a larger
      // tensor of the same name).
      bytes.resize(bytes.size() + 100, 0xEE);
      absl::StatusOr<ReadPayload> got = ReadCopyPayload(bytes.data(), bytes.size(), CpuAllocator(), kLimit);
      ASSERT_TRUE(got.ok()) << DataTypeName(d) << shape.DebugString() << ": " << got.status();
      EXPECT_FALSE(got->is_dead);
      EXPECT_TRUE(got->tensor.ContentEquals(t)) << DataTypeName(d) << shape.DebugString();
    }
  }
  std::vector<uint8_t> dead = Lay(Tensor(), true);
  EXPECT_EQ(dead.size(), kCopyPayloadHeaderBytes);
  absl::StatusOr<ReadPayload> got = ReadCopyPayload(dead.data(), dead.size(), CpuAllocator(), kLimit);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->is_dead);
}

// A header announcing int32[2^29] (2 GiB) over 16 content bytes: DataLoss, nothing allocated.
TEST(CopyPayload, AHeaderLargerThanItsContentAllocatesNothing) {
  const std::vector<uint8_t> good = Lay(Pattern(DataType::kInt32, TensorShape::Of({4}), 1), false);
  uint32_t header_len;
  std::memcpy(&header_len, good.data() + 8, 4);
  proto::TensorProto header;
  ASSERT_TRUE(header.ParseFromArray(good.data() + kCopyPayloadHeaderBytes,
                                    static_cast<int>(header_len)));
  header.mutable_tensor_shape()->mutable_dim(0)->set_size(int64_t{1} << 29);
  const std::string liar = header.SerializeAsString();
  std::vector<uint8_t> bad(good.begin(), good.begin() + kCopyPayloadHeaderBytes);
  const auto liar_len = static_cast<uint32_t>(liar.size());
  std::memcpy(bad.data() + 8, &liar_len, 4);
  bad.insert(bad.end(), liar.begin(), liar.end());
  bad.insert(bad.end(), good.begin() + kCopyPayloadHeaderBytes + header_len, good.end());
  testing::RecordingAllocator allocator;
  absl::StatusOr<ReadPayload> got = ReadCopyPayload(bad.data(), bad.size(), &allocator, kLimit);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << got.status();
  EXPECT_THAT(got.status().message(), HasSubstr("16 content bytes"));
  EXPECT_EQ(allocator.largest(), 0u);
}

// Empty strings cost two bytes each on the wire and a string object each once built: a header
// of 200,000 of them is counted against the limit before it is parsed, whatever shape it names.
TEST(CopyPayload, StringElementsAreCountedAgainstTheLimitBeforeTheyAreBuilt) {
  proto::TensorProto header;
  header.set_dtype(static_cast<int32_t>(DataType::kString));
  header.mutable_tensor_shape()->add_dim()->set_size(1);
  for (int i = 0; i < 200000; ++i) header.add_string_val("");
  const std::vector<uint8_t> liar = WithHeader(header);
  testing::RecordingAllocator allocator;
  absl::StatusOr<ReadPayload> got =
      ReadCopyPayload(liar.data(), liar.size(), &allocator, uint64_t{1} << 20);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();
  EXPECT_THAT(got.status().message(), HasSubstr("TENSORVERBS_MAX_TENSOR_MB"));
  EXPECT_EQ(allocator.largest(), 0u);
  // Within the limit the shape must still match the elements.
  got = ReadCopyPayload(liar.data(), liar.size(), &allocator, kLimit);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << got.status();
  EXPECT_EQ(allocator.largest(), 0u);
  // And strings in a tensor that says it holds numbers are refused.
  header.set_dtype(static_cast<int32_t>(DataType::kFloat32));
  header.mutable_tensor_shape()->mutable_dim(0)->set_size(0);
  const std::vector<uint8_t> mixed = WithHeader(header);
  got = ReadCopyPayload(mixed.data(), mixed.size(), CpuAllocator(), kLimit);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << got.status();
}

TEST(CopyPayload, TruncationsAndCorruptionsAreDataLossNeverACrash) {
  Tensor t = Pattern(DataType::kInt32, TensorShape::Of({4, 4}), 1);
  const std::vector<uint8_t> good = Lay(t, false);
  for (size_t len = 0; len < good.size(); ++len) {
    absl::StatusOr<ReadPayload> got = ReadCopyPayload(good.data(), len, CpuAllocator(), kLimit);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << "truncated to " << len;
  }
  // Every single-bit flip of the fixed header and the proto header: never a crash; a flip
  // that still parses must describe a tensor that fits the buffer.
  const size_t header_end = good.size() - t.TotalBytes();
  for (size_t byte = 0; byte < header_end; ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      std::vector<uint8_t> bad = good;
      bad[byte] ^= static_cast<uint8_t>(1 << bit);
      absl::StatusOr<ReadPayload> got = ReadCopyPayload(bad.data(), bad.size(), CpuAllocator(), kLimit);
      if (got.ok() && !got->is_dead) {
        EXPECT_LE(got->tensor.TotalBytes(), bad.size());
      }
    }
  }
  std::vector<uint8_t> magic = good;
  magic[0] ^= 1;
  EXPECT_THAT(ReadCopyPayload(magic.data(), magic.size(), CpuAllocator(), kLimit).status().message(),
              HasSubstr("bad magic"));
  std::mt19937 rng(3);
  for (int i = 0; i < 2000; ++i) {
    std::vector<uint8_t> noise(rng() % 96);
    for (uint8_t& b : noise) b = static_cast<uint8_t>(rng());
    if (noise.size() >= 6) {
      noise[0] = 'T', noise[1] = 'V', noise[2] = 'C', noise[3] = 'P', noise[4] = 1;
    }
    (void)ReadCopyPayload(noise.data(), noise.size(), CpuAllocator(), kLimit);
  }
}

}  // namespace
}  // namespace tensorverbs::protocol
