// The all-to-all collectives of ProcessGroupTensorVerbs (alltoall, alltoall_base): every rank
// sends one block of its input to each rank. Checked on the caller's thread, run on the group's
// worker (process_group.h).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "python/src/torch/collective.h"
#include "python/src/torch/ops_util.h"
#include "python/src/torch/process_group.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::torch_backend {
namespace {

// Every rank sends block i of its input to rank i and receives rank i's into block i of its
// output; all sends go first, so no rank waits on another's order.
absl::Status Exchange(Collective& c, const std::vector<const char*>& in,
                      const std::vector<size_t>& in_bytes, const std::vector<char*>& out,
                      const std::vector<size_t>& out_bytes) {
  const int n = c.size(), r = c.rank();
  for (int k = 1; k < n; ++k) {
    const int dst = (r + k) % n;
    absl::Status s = c.Send(dst, 0, in[dst], in_bytes[dst]);
    if (!s.ok()) return s;
  }
  if (in_bytes[r] != out_bytes[r]) {
    return absl::InvalidArgumentError("this rank's own input and output blocks differ in size");
  }
  absl::Status s = c.WriteOut(out[r], in[r], in_bytes[r]);
  if (!s.ok()) return s;
  for (int k = 1; k < n; ++k) {
    const int src = (r - k + n) % n;
    absl::StatusOr<Tensor> m = c.Recv(src, 0, out_bytes[src], out[src]);
    if (!m.ok()) return m.status();
    s = c.WriteOut(out[src], m->data(), out_bytes[src]);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// Block sizes in bytes of `t` split along dim 0 by `splits` (equal blocks when empty).
std::vector<size_t> Blocks(const at::Tensor& t, const std::vector<int64_t>& splits, int n,
                           const char* what) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const size_t row_bytes = rows == 0 ? 0 : t.nbytes() / rows;
  std::vector<size_t> bytes(n);
  if (splits.empty()) {
    if (rows % n != 0) {
      Fail("alltoall_base", absl::StrCat("the ", what, " has ", rows, " rows, not a multiple of ",
                                         n, "; pass split sizes"));
    }
    for (int i = 0; i < n; ++i) bytes[i] = row_bytes * (rows / n);
    return bytes;
  }
  if (static_cast<int>(splits.size()) != n) {
    Fail("alltoall_base", absl::StrCat(splits.size(), " ", what, " split sizes for ", n, " ranks"));
  }
  int64_t total = 0;
  for (int i = 0; i < n; ++i) {
    if (splits[i] < 0) Fail("alltoall_base", "a split size is negative");
    total += splits[i];
    bytes[i] = row_bytes * splits[i];
  }
  if (total != rows) {
    Fail("alltoall_base",
         absl::StrCat("the ", what, " split sizes add up to ", total, ", not ", rows, " rows"));
  }
  return bytes;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
    std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) {
  CheckTensor(input, "alltoall_base");
  CheckTensor(output, "alltoall_base");
  if (input.scalar_type() != output.scalar_type()) {
    Fail("alltoall_base", "input and output dtypes differ");
  }
  const int n = getSize();
  std::vector<size_t> in_bytes = Blocks(input, input_splits, n, "input");
  std::vector<size_t> out_bytes = Blocks(output, output_splits, n, "output");
  at::Tensor in = input, out = output;
  return Enqueue(c10d::OpType::ALLTOALL_BASE, "alltoall_base", {out}, opts.timeout,
                 [in, out, in_bytes, out_bytes](Collective& c) {
                   std::vector<const char*> ins;
                   std::vector<char*> outs;
                   size_t a = 0, b = 0;
                   for (int i = 0; i < c.size(); ++i) {
                     ins.push_back(Bytes(in) + a);
                     outs.push_back(Bytes(out) + b);
                     a += in_bytes[i];
                     b += out_bytes[i];
                   }
                   return Exchange(c, ins, in_bytes, outs, out_bytes);
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::alltoall(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  const int n = getSize();
  if (static_cast<int>(inputs.size()) != n || static_cast<int>(outputs.size()) != n) {
    Fail("alltoall", absl::StrCat("takes ", n, " input and ", n, " output tensors"));
  }
  for (int i = 0; i < n; ++i) {
    CheckTensor(inputs[i], "alltoall");
    CheckTensor(outputs[i], "alltoall");
    if (inputs[i].scalar_type() != inputs[0].scalar_type() ||
        outputs[i].scalar_type() != inputs[0].scalar_type()) {
      Fail("alltoall", "every input and output tensor must have one dtype");
    }
  }
  std::vector<at::Tensor> ins = inputs, outs = outputs;
  return Enqueue(c10d::OpType::ALLTOALL, "alltoall", outs, opts.timeout,
                 [ins, outs](Collective& c) {
                   std::vector<const char*> in;
                   std::vector<char*> out;
                   std::vector<size_t> in_bytes, out_bytes;
                   for (int i = 0; i < c.size(); ++i) {
                     in.push_back(Bytes(ins[i]));
                     out.push_back(Bytes(outs[i]));
                     in_bytes.push_back(ins[i].nbytes());
                     out_bytes.push_back(outs[i].nbytes());
                   }
                   return Exchange(c, in, in_bytes, out, out_bytes);
                 });
}

}  // namespace tensorverbs::torch_backend
