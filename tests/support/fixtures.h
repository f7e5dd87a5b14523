// Deterministic tensors that test peers send and tests verify: every dtype, empty, rank 8,
// strings, a dead tensor and a 64 MiB tensor, with contents derived from a seed so that each
// peer's data differs.
#ifndef TENSORVERBS_TESTS_SUPPORT_FIXTURES_H_
#define TENSORVERBS_TESTS_SUPPORT_FIXTURES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tensorverbs/tensor.h"

namespace tensorverbs::testing {

struct Fixture {
  std::string name;
  Tensor tensor;
  bool is_dead = false;
};

// Fills `t` with a pattern derived from `seed` (strings get seed-dependent lengths and bytes).
void FillPattern(Tensor& t, uint32_t seed);

// The standard set. `with_big` adds "big", a 64 MiB uint8 tensor.
std::vector<Fixture> MakeFixtures(uint32_t seed, bool with_big);

// What a test peer sends as each "spare<i>" (--spares): 16 KiB, so that grpc+gdr lends it.
Tensor MakeSpare(uint32_t seed);

}  // namespace tensorverbs::testing

#endif  // TENSORVERBS_TESTS_SUPPORT_FIXTURES_H_
