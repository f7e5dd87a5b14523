// CopyHelpers (src/fabric/shmem/copy.h): a copy shared among threads lands every byte exactly,
// whatever the size, the number of helpers and the kind of stores, and one whose helpers never
// get to run is finished by the caller alone.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "src/fabric/shmem/copy.h"

namespace tensorverbs::fabric::shmem {
namespace {

std::vector<char> Pattern(size_t n, uint32_t seed) {
  std::vector<char> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (char& c : v) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<char>(x >> 24);
  }
  return v;
}

TEST(CopyHelpersTest, EverySizeLandsExactlyWithAnyNumberOfHelpers) {
  const size_t kMin = CopyHelpers::kMinSharedBytes;
  for (int threads : {0, 1, 3}) {
    CopyHelpers helpers(threads);
    EXPECT_EQ(helpers.threads(), threads);
    uint32_t seed = 1;
    for (size_t n : {size_t{0}, size_t{1}, size_t{4095}, kMin - 1, kMin, kMin + 1,
                     kMin + 4096 * 3 + 17, 3 * kMin + 5}) {
      for (bool streaming : {false, true}) {
        const std::vector<char> src = Pattern(n, seed++);
        // Guard bytes on both sides: nothing is written outside the destination.
        std::vector<char> dst(n + 128, 0x77);
        helpers.Copy(dst.data() + 64, src.data(), n, streaming);
        EXPECT_EQ(std::memcmp(dst.data() + 64, src.data(), n), 0)
            << n << " bytes, " << threads << " helpers, streaming " << streaming;
        for (size_t i = 0; i < 64; ++i) {
          ASSERT_EQ(dst[i], 0x77) << "before the destination, " << n << " bytes";
          ASSERT_EQ(dst[64 + n + i], 0x77) << "after the destination, " << n << " bytes";
        }
      }
    }
  }
}

TEST(CopyHelpersTest, ManyCopiesInARowReuseTheHelpers) {
  CopyHelpers helpers(2);
  const size_t n = CopyHelpers::kMinSharedBytes * 2 + 12345;
  std::vector<char> dst(n);
  for (uint32_t round = 0; round < 50; ++round) {
    const std::vector<char> src = Pattern(n, round);
    helpers.Copy(dst.data(), src.data(), n, round % 2 == 0);
    ASSERT_EQ(std::memcmp(dst.data(), src.data(), n), 0) << "round " << round;
  }
}

TEST(CopyHelpersTest, HelpersStopWithTheirOwnerWhetherOrNotTheyEverCopied) {
  for (int threads : {1, 4}) {
    CopyHelpers idle(threads);  // never used: its destructor must not wait for work
  }
  CopyHelpers used(4);
  const size_t n = CopyHelpers::kMinSharedBytes * 5;
  const std::vector<char> src = Pattern(n, 9);
  std::vector<char> dst(n);
  used.Copy(dst.data(), src.data(), n, true);
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), n), 0);
}

}  // namespace
}  // namespace tensorverbs::fabric::shmem
