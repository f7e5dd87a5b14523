#include "python/src/dtypes.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <string>
#include <unordered_map>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "python/src/binding_util.h"
#include "tensorverbs/types.h"

namespace py = pybind11;

namespace tensorverbs::python {
namespace {

py::dtype NumpyDtypeByName(DataType dtype) {
  switch (dtype) {
    case DataType::kBool:
      return py::dtype("bool");
    case DataType::kFloat16:
      return py::dtype("float16");
    case DataType::kFloat32:
      return py::dtype("float32");
    case DataType::kFloat64:
      return py::dtype("float64");
    case DataType::kInt8:
      return py::dtype("int8");
    case DataType::kInt16:
      return py::dtype("int16");
    case DataType::kInt32:
      return py::dtype("int32");
    case DataType::kInt64:
      return py::dtype("int64");
    case DataType::kUInt8:
      return py::dtype("uint8");
    case DataType::kUInt16:
      return py::dtype("uint16");
    case DataType::kUInt32:
      return py::dtype("uint32");
    case DataType::kUInt64:
      return py::dtype("uint64");
    case DataType::kComplex64:
      return py::dtype("complex64");
    case DataType::kComplex128:
      return py::dtype("complex128");
    case DataType::kBFloat16:
      return py::dtype("uint16");  // NumPy has none: its bits
    default:
      Raise(absl::InvalidArgumentError(
          absl::StrCat("a tensor of type ", DataTypeName(dtype), " has no NumPy form")));
  }
}

}  // namespace

DataType DataTypeOf(const py::dtype& dtype) {
  const char kind = dtype.kind();
  const size_t size = static_cast<size_t>(dtype.itemsize());
  if (kind == 'b' && size == 1) return DataType::kBool;
  if (kind == 'f') {
    if (size == 2) return DataType::kFloat16;
    if (size == 4) return DataType::kFloat32;
    if (size == 8) return DataType::kFloat64;
  }
  if (kind == 'i') {
    if (size == 1) return DataType::kInt8;
    if (size == 2) return DataType::kInt16;
    if (size == 4) return DataType::kInt32;
    if (size == 8) return DataType::kInt64;
  }
  if (kind == 'u') {
    if (size == 1) return DataType::kUInt8;
    if (size == 2) return DataType::kUInt16;
    if (size == 4) return DataType::kUInt32;
    if (size == 8) return DataType::kUInt64;
  }
  if (kind == 'c') {
    if (size == 8) return DataType::kComplex64;
    if (size == 16) return DataType::kComplex128;
  }
  Raise(absl::InvalidArgumentError(
      absl::StrCat("NumPy dtype '", dtype.attr("name").cast<std::string>(),
                   "' has no tensor type: use bool, int8-64, uint8-64, float16-64 or "
                   "complex64/128 arrays, or a list of bytes/str for strings")));
}

py::dtype NumpyDtypeOf(DataType dtype) {
  static auto* const cache = new std::unordered_map<int, py::dtype>();  // never destroyed
  auto it = cache->find(static_cast<int>(dtype));
  if (it != cache->end()) return it->second;
  py::dtype made = NumpyDtypeByName(dtype);
  cache->emplace(static_cast<int>(dtype), made);
  return made;
}

}  // namespace tensorverbs::python
