// What the fuzz targets share: a check that, unlike assert, stays on in every build and names
// what broke, and the limit the targets give decoders that allocate.
//
// A target runs on libFuzzer's thread only; a failed check aborts, which libFuzzer reports as a
// crash with the input that caused it (see fuzz/README.md for turning one into a test).
#ifndef TENSORVERBS_FUZZ_FUZZ_CHECK_H_
#define TENSORVERBS_FUZZ_FUZZ_CHECK_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define FUZZ_CHECK(condition, what)                                                              \
  do {                                                                                           \
    if (!(condition)) {                                                                          \
      std::fprintf(stderr, "%s:%d: fuzz check failed: %s: %s\n", __FILE__, __LINE__, #condition, \
                   what);                                                                        \
      std::abort();                                                                              \
    }                                                                                            \
  } while (0)

namespace tensorverbs::fuzz {

// The largest tensor a decoder may allocate for one input: far above what any input of
// libFuzzer's default length can justify, far below what would exhaust a test machine.
inline constexpr uint64_t kMaxTensorBytes = uint64_t{64} << 20;

}  // namespace tensorverbs::fuzz

#endif  // TENSORVERBS_FUZZ_FUZZ_CHECK_H_
