#include "tests/support/fixtures.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace tensorverbs::testing {

void FillPattern(Tensor& t, uint32_t seed) {
  if (t.CanMemCopy()) {
    auto* p = static_cast<uint64_t*>(t.data());
    const size_t words = t.TotalBytes() / 8;
    uint64_t x = 0x9e3779b97f4a7c15ULL * (seed + 1);
    for (size_t i = 0; i < words; ++i) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      p[i] = x;
    }
    auto* tail = static_cast<unsigned char*>(t.data());
    for (size_t i = words * 8; i < t.TotalBytes(); ++i) tail[i] = static_cast<unsigned char>(seed + i);
    return;
  }
  for (int64_t i = 0; i < t.NumElements(); ++i) {
    std::string s((seed + i * 7) % 61, '\0');
    for (size_t j = 0; j < s.size(); ++j) s[j] = static_cast<char>(seed * 31 + i + j);
    t.strings()[i] = s;
  }
}

std::vector<Fixture> MakeFixtures(uint32_t seed, bool with_big) {
  std::vector<Fixture> out;
  for (DataType d : AllDataTypes()) {
    Tensor t = Tensor::Make(d, TensorShape::Of({3, 5}));
    FillPattern(t, seed + static_cast<uint32_t>(d));
    out.push_back({absl::StrCat("dtype/", DataTypeName(d)), t});
  }
  out.push_back({"empty", Tensor::Make(DataType::kFloat32, TensorShape::Of({0, 7}))});
  Tensor scalar = Tensor::Make(DataType::kFloat64, TensorShape());
  FillPattern(scalar, seed);
  out.push_back({"scalar", scalar});
  Tensor rank8 = Tensor::Make(DataType::kInt32, TensorShape::Of({2, 1, 3, 1, 2, 1, 2, 5}));
  FillPattern(rank8, seed + 100);
  out.push_back({"rank8", rank8});
  Tensor strings = Tensor::Make(DataType::kString, TensorShape::Of({40}));
  FillPattern(strings, seed + 200);
  out.push_back({"strings", strings});
  Tensor empty_strings = Tensor::Make(DataType::kString, TensorShape::Of({0}));
  out.push_back({"empty_strings", empty_strings});
  out.push_back({"dead", Tensor(), /*is_dead=*/true});
  Tensor medium = Tensor::Make(DataType::kFloat32, TensorShape::Of({256, 1024}));
  FillPattern(medium, seed + 300);
  out.push_back({"medium", medium});
  if (with_big) {
    Tensor big = Tensor::Make(DataType::kUInt8, TensorShape::Of({int64_t{64} << 20}));
    FillPattern(big, seed + 400);
    out.push_back({"big", big});
  }
  return out;
}

Tensor MakeSpare(uint32_t seed) {
  Tensor spare = Tensor::Make(DataType::kFloat32, TensorShape::Of({4096}));
  FillPattern(spare, seed + 700);
  return spare;
}

}  // namespace tensorverbs::testing
