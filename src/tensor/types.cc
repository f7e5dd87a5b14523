#include "tensorverbs/types.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace tensorverbs {
namespace {

struct TypeInfo {
  DataType dtype;
  size_t size;
  absl::string_view name;
};

constexpr TypeInfo kTypes[] = {
    {DataType::kFloat16, 2, "float16"},     {DataType::kBFloat16, 2, "bfloat16"},
    {DataType::kFloat32, 4, "float32"},     {DataType::kFloat64, 8, "float64"},
    {DataType::kInt8, 1, "int8"},           {DataType::kInt16, 2, "int16"},
    {DataType::kInt32, 4, "int32"},         {DataType::kInt64, 8, "int64"},
    {DataType::kUInt8, 1, "uint8"},         {DataType::kUInt16, 2, "uint16"},
    {DataType::kUInt32, 4, "uint32"},       {DataType::kUInt64, 8, "uint64"},
    {DataType::kBool, 1, "bool"},           {DataType::kComplex64, 8, "complex64"},
    {DataType::kComplex128, 16, "complex128"}, {DataType::kString, 0, "string"},
};

const TypeInfo* Find(DataType dtype) {
  for (const TypeInfo& t : kTypes) {
    if (t.dtype == dtype) return &t;
  }
  return nullptr;
}

}  // namespace

size_t DataTypeSize(DataType dtype) {
  const TypeInfo* t = Find(dtype);
  return t ? t->size : 0;
}

bool DataTypeCanMemCopy(DataType dtype) { return dtype != DataType::kString; }

absl::string_view DataTypeName(DataType dtype) {
  const TypeInfo* t = Find(dtype);
  if (t) return t->name;
  thread_local std::string unknown;
  unknown = absl::StrCat("invalid(", static_cast<int>(dtype), ")");
  return unknown;
}

absl::StatusOr<DataType> DataTypeFromInt(int64_t value) {
  for (const TypeInfo& t : kTypes) {
    if (static_cast<int64_t>(t.dtype) == value) return t.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown data type value ", value));
}

absl::StatusOr<DataType> DataTypeFromName(absl::string_view name) {
  for (const TypeInfo& t : kTypes) {
    if (t.name == name) return t.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown data type '", name, "'"));
}

const std::vector<DataType>& AllDataTypes() {
  static const std::vector<DataType> all = [] {
    std::vector<DataType> v;
    for (const TypeInfo& t : kTypes) v.push_back(t.dtype);
    return v;
  }();
  return all;
}

}  // namespace tensorverbs
