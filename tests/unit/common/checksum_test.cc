#include "src/common/checksum.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace tensorverbs {
namespace {

TEST(Crc32c, KnownVectors) {
  // RFC 3720 (iSCSI) appendix B.4 test vectors.
  std::vector<uint8_t> zeros(32, 0), ones(32, 0xFF), inc(32);
  for (int i = 0; i < 32; ++i) inc[i] = static_cast<uint8_t>(i);
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(inc.data(), inc.size()), 0x46DD794Eu);
  const std::string digits = "123456789";
  EXPECT_EQ(Crc32c(digits.data(), digits.size()), 0xE3069283u);
  EXPECT_EQ(Crc32c(nullptr, 0), 0u);
}

TEST(Crc32c, HardwareAndPortableAgreeAtEveryAlignmentAndLength) {
  std::mt19937 rng(1);
  std::vector<uint8_t> data(4096 + 16);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  for (size_t offset = 0; offset < 9; ++offset) {
    for (size_t len : {0, 1, 7, 8, 9, 63, 64, 65, 1000, 4096}) {
      EXPECT_EQ(Crc32c(data.data() + offset, len),
                checksum_internal::Crc32cPortable(data.data() + offset, len, 0))
          << offset << " " << len;
    }
  }
}

TEST(Crc32c, Extends) {
  const std::string s = "the quick brown fox jumps over the lazy dog";
  uint32_t whole = Crc32c(s.data(), s.size());
  uint32_t part = Crc32c(s.data(), 10);
  EXPECT_EQ(Crc32c(s.data() + 10, s.size() - 10, part), whole);
}

}  // namespace
}  // namespace tensorverbs
