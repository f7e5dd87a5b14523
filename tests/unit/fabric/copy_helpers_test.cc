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

// Distinct bytes, made once: tests copy from different offsets of it.
const std::vector<char>& Source() {
  static const std::vector<char>* source = [] {
    auto* v = new std::vector<char>(4 * CopyHelpers::kMinSharedBytes);
    uint32_t x = 12345;
    for (char& c : *v) {
      x = x * 1664525u + 1013904223u;
      c = static_cast<char>(x >> 24);
    }
    return v;
  }();
  return *source;
}

TEST(CopyHelpersTest, EverySizeLandsExactlyWithAnyNumberOfHelpers) {
  const size_t kMin = CopyHelpers::kMinSharedBytes;
  std::vector<char> dst(3 * kMin + 4096);
  for (int threads : {0, 1, 3}) {
    CopyHelpers helpers(threads);
    EXPECT_EQ(helpers.threads(), threads);
    size_t offset = 0;
    for (size_t n : {size_t{0}, size_t{1}, size_t{4095}, kMin - 1, kMin, kMin + 1,
                     kMin + 4096 * 3 + 17, 2 * kMin + 5}) {
      for (bool streaming : {false, true}) {
        const char* src = Source().data() + (offset++ * 4097) % kMin;
        // Guard bytes on both sides: nothing is written outside the destination.
        std::memset(dst.data(), 0x77, n + 128);
        helpers.Copy(dst.data() + 64, src, n, streaming);
        EXPECT_EQ(std::memcmp(dst.data() + 64, src, n), 0)
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
  const size_t n = CopyHelpers::kMinSharedBytes + 12345;
  std::vector<char> dst(n);
  for (size_t round = 0; round < 16; ++round) {
    const char* src = Source().data() + round * 65537;
    helpers.Copy(dst.data(), src, n, round % 2 == 0);
    ASSERT_EQ(std::memcmp(dst.data(), src, n), 0) << "round " << round;
  }
}

TEST(CopyHelpersTest, HelpersStopWithTheirOwnerWhetherOrNotTheyEverCopied) {
  for (int threads : {1, 4}) {
    CopyHelpers idle(threads);  // never used: its destructor must not wait for work
  }
  CopyHelpers used(4);
  const size_t n = CopyHelpers::kMinSharedBytes * 3;
  std::vector<char> dst(n);
  used.Copy(dst.data(), Source().data(), n, true);
  EXPECT_EQ(std::memcmp(dst.data(), Source().data(), n), 0);
}

}  // namespace
}  // namespace tensorverbs::fabric::shmem
