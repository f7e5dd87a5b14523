#include "python/src/torch/reduce.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/complex.h>

#include <algorithm>
#include <type_traits>

#include "absl/strings/str_cat.h"

namespace tensorverbs::torch_backend {
namespace {

template <typename T>
constexpr bool kIsComplex =
    std::is_same_v<T, c10::complex<float>> || std::is_same_v<T, c10::complex<double>>;

template <typename T>
void ReduceTyped(RedOp op, T* __restrict acc, const T* __restrict in, int64_t count) {
  switch (op) {
    case RedOp::SUM:
    case RedOp::AVG:
      if constexpr (std::is_same_v<T, bool>) {
        for (int64_t i = 0; i < count; ++i) acc[i] = acc[i] || in[i];
      } else {
        for (int64_t i = 0; i < count; ++i) acc[i] = static_cast<T>(acc[i] + in[i]);
      }
      return;
    case RedOp::PRODUCT:
      if constexpr (std::is_same_v<T, bool>) {
        for (int64_t i = 0; i < count; ++i) acc[i] = acc[i] && in[i];
      } else {
        for (int64_t i = 0; i < count; ++i) acc[i] = static_cast<T>(acc[i] * in[i]);
      }
      return;
    case RedOp::MIN:
      if constexpr (!kIsComplex<T>) {
        for (int64_t i = 0; i < count; ++i) acc[i] = in[i] < acc[i] ? in[i] : acc[i];
      }
      return;
    case RedOp::MAX:
      if constexpr (!kIsComplex<T>) {
        for (int64_t i = 0; i < count; ++i) acc[i] = acc[i] < in[i] ? in[i] : acc[i];
      }
      return;
    case RedOp::BAND:
    case RedOp::BOR:
    case RedOp::BXOR:
      if constexpr (std::is_integral_v<T>) {
        for (int64_t i = 0; i < count; ++i) {
          acc[i] = static_cast<T>(op == RedOp::BAND  ? (acc[i] & in[i])
                                  : op == RedOp::BOR ? (acc[i] | in[i])
                                                     : (acc[i] ^ in[i]));
        }
      }
      return;
    default:
      return;  // CheckReducible refused it
  }
}

// Calls `f` with a null pointer of the C++ type of `dtype`; false for a type it does not carry.
template <typename F>
bool Dispatch(c10::ScalarType dtype, F&& f) {
  switch (dtype) {
    case c10::ScalarType::Float:
      f(static_cast<float*>(nullptr));
      return true;
    case c10::ScalarType::Double:
      f(static_cast<double*>(nullptr));
      return true;
    case c10::ScalarType::Half:
      f(static_cast<c10::Half*>(nullptr));
      return true;
    case c10::ScalarType::BFloat16:
      f(static_cast<c10::BFloat16*>(nullptr));
      return true;
    case c10::ScalarType::Char:
      f(static_cast<int8_t*>(nullptr));
      return true;
    case c10::ScalarType::Byte:
      f(static_cast<uint8_t*>(nullptr));
      return true;
    case c10::ScalarType::Short:
      f(static_cast<int16_t*>(nullptr));
      return true;
    case c10::ScalarType::Int:
      f(static_cast<int32_t*>(nullptr));
      return true;
    case c10::ScalarType::Long:
      f(static_cast<int64_t*>(nullptr));
      return true;
    case c10::ScalarType::Bool:
      f(static_cast<bool*>(nullptr));
      return true;
    case c10::ScalarType::ComplexFloat:
      f(static_cast<c10::complex<float>*>(nullptr));
      return true;
    case c10::ScalarType::ComplexDouble:
      f(static_cast<c10::complex<double>*>(nullptr));
      return true;
    default:
      return false;
  }
}

}  // namespace

const char* RedOpName(RedOp op) {
  switch (op) {
    case RedOp::SUM:
      return "SUM";
    case RedOp::AVG:
      return "AVG";
    case RedOp::PRODUCT:
      return "PRODUCT";
    case RedOp::MIN:
      return "MIN";
    case RedOp::MAX:
      return "MAX";
    case RedOp::BAND:
      return "BAND";
    case RedOp::BOR:
      return "BOR";
    case RedOp::BXOR:
      return "BXOR";
    case RedOp::PREMUL_SUM:
      return "PREMUL_SUM";
    default:
      return "UNKNOWN";
  }
}

absl::Status CheckReducible(c10::ScalarType dtype, RedOp op) {
  const bool floating = c10::isFloatingType(dtype);
  const bool complex = c10::isComplexType(dtype);
  const bool integral = c10::isIntegralType(dtype, /*includeBool=*/true);
  bool ok = false;
  switch (op) {
    case RedOp::SUM:
    case RedOp::PRODUCT:
      ok = true;
      break;
    case RedOp::AVG:
      ok = floating || complex;
      break;
    case RedOp::MIN:
    case RedOp::MAX:
      ok = !complex;
      break;
    case RedOp::BAND:
    case RedOp::BOR:
    case RedOp::BXOR:
      ok = integral;
      break;
    default:
      ok = false;
  }
  if (!ok || !Dispatch(dtype, [](auto*) {})) {
    return absl::InvalidArgumentError(
        absl::StrCat("ReduceOp.", RedOpName(op), " does not apply to ", c10::toString(dtype),
                     " tensors in the tensorverbs backend",
                     op == RedOp::AVG ? " (AVG needs a floating or complex dtype)" : "",
                     op == RedOp::PREMUL_SUM ? " (PREMUL_SUM is not supported)" : ""));
  }
  return absl::OkStatus();
}

void ReduceInto(c10::ScalarType dtype, RedOp op, void* acc, const void* in, int64_t count) {
  Dispatch(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    ReduceTyped<T>(op, static_cast<T*>(acc), static_cast<const T*>(in), count);
  });
}

void DivideBy(c10::ScalarType dtype, void* data, int64_t count, int64_t n) {
  Dispatch(dtype, [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    if constexpr (!std::is_integral_v<T>) {
      T* d = static_cast<T*>(data);
      for (int64_t i = 0; i < count; ++i) d[i] = static_cast<T>(d[i] / static_cast<T>(n));
    }
  });
}

}  // namespace tensorverbs::torch_backend
