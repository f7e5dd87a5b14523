// DataType: the element types a tensor can hold, with their sizes and names.
//
// The numeric values equal TensorFlow's DataType enum so that TensorProto bytes and logs read
// the same as TensorFlow's. Pure functions, callable from any thread.
#ifndef TENSORVERBS_PUBLIC_TYPES_H_
#define TENSORVERBS_PUBLIC_TYPES_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tensorverbs {

enum class DataType : int32_t {
  kInvalid = 0,
  kFloat32 = 1,
  kFloat64 = 2,
  kInt32 = 3,
  kUInt8 = 4,
  kInt16 = 5,
  kInt8 = 6,
  kString = 7,
  kComplex64 = 8,
  kInt64 = 9,
  kBool = 10,
  kBFloat16 = 14,
  kUInt16 = 17,
  kComplex128 = 18,
  kFloat16 = 19,
  kUInt32 = 22,
  kUInt64 = 23,
};

// Bytes per element; 0 for kString (variable length) and kInvalid.
size_t DataTypeSize(DataType dtype);

// False only for kString: its elements are std::string objects, not plain bytes.
bool DataTypeCanMemCopy(DataType dtype);

// "float32", "string", ... ("invalid(N)" for an unknown value).
absl::string_view DataTypeName(DataType dtype);

// Accepts a wire value; InvalidArgument for values that are not a known DataType.
absl::StatusOr<DataType> DataTypeFromInt(int64_t value);

// Parses "float32", "int8", ... for tools.
absl::StatusOr<DataType> DataTypeFromName(absl::string_view name);

// Every valid DataType, for tests and benchmarks.
const std::vector<DataType>& AllDataTypes();

}  // namespace tensorverbs

#endif  // TENSORVERBS_PUBLIC_TYPES_H_
