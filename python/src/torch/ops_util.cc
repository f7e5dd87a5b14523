#include "python/src/torch/ops_util.h"

#include <c10/core/ScalarType.h>

#include <stdexcept>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tensorverbs::torch_backend {
namespace {

bool Carried(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float:
    case c10::ScalarType::Double:
    case c10::ScalarType::Half:
    case c10::ScalarType::BFloat16:
    case c10::ScalarType::Char:
    case c10::ScalarType::Byte:
    case c10::ScalarType::Short:
    case c10::ScalarType::Int:
    case c10::ScalarType::Long:
    case c10::ScalarType::Bool:
    case c10::ScalarType::ComplexFloat:
    case c10::ScalarType::ComplexDouble:
      return true;
    default:
      return false;
  }
}

}  // namespace

[[noreturn]] void Fail(const char* op, const std::string& message) {
  throw std::invalid_argument(absl::StrCat("tensorverbs ", op, ": ", message));
}

void CheckTensor(const at::Tensor& t, const char* op) {
  if (!t.defined()) Fail(op, "a tensor is undefined");
  if (!t.device().is_cpu()) {
    Fail(op, absl::StrCat("takes CPU tensors; this one is on ", t.device().str(),
                          " (this PyTorch build has no CUDA support for the backend)"));
  }
  if (t.layout() != c10::kStrided) Fail(op, "takes dense tensors; this one is sparse");
  if (!t.is_contiguous()) Fail(op, "takes contiguous tensors; call .contiguous() first");
  if (!Carried(t.scalar_type())) {
    Fail(op, absl::StrCat("does not carry dtype ", c10::toString(t.scalar_type())));
  }
}

at::Tensor& Single(std::vector<at::Tensor>& tensors, const char* op) {
  if (tensors.size() != 1) {
    Fail(op, absl::StrCat("takes one tensor per call, got ", tensors.size()));
  }
  CheckTensor(tensors[0], op);
  return tensors[0];
}

void CheckLike(const at::Tensor& t, const at::Tensor& like, int64_t numel, const char* op) {
  CheckTensor(t, op);
  if (t.scalar_type() != like.scalar_type() || t.numel() != numel) {
    Fail(op,
         absl::StrCat("a tensor of ", c10::toString(t.scalar_type()), "[", t.numel(), "] where ",
                      c10::toString(like.scalar_type()), "[", numel, "] is needed"));
  }
}

int CheckRoot(int64_t root, int size, const char* op) {
  if (root < 0 || root >= size) {
    Fail(op, absl::StrCat("root rank ", root, " is not in a group of size ", size));
  }
  return static_cast<int>(root);
}

RedOp CheckOp(const c10d::ReduceOp& reduce_op, const at::Tensor& t, const char* op) {
  const RedOp red = reduce_op.op_;
  absl::Status s = CheckReducible(t.scalar_type(), red);
  if (!s.ok()) Fail(op, std::string(s.message()));
  return red;
}

char* Bytes(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

}  // namespace tensorverbs::torch_backend
