// The argument checks every operation of ProcessGroupTensorVerbs runs before anything else:
// each operation (ops_collective.cc, ops_alltoall.cc, ops_p2p.cc) checks its arguments on the
// caller's thread, so that a bad call raises (std::invalid_argument, naming the operation) and
// sends nothing, then runs as a p2p message or a queued collective (see process_group.h).
//
// Pure functions of their arguments, callable from any thread; they hold nothing. Bytes() is
// also what the collectives' bodies address a tensor's memory by, on the group's worker thread.
#ifndef TENSORVERBS_PYTHON_TORCH_OPS_UTIL_H_
#define TENSORVERBS_PYTHON_TORCH_OPS_UTIL_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <vector>

#include "python/src/torch/reduce.h"

namespace tensorverbs::torch_backend {

// Throws std::invalid_argument: "tensorverbs <op>: <message>".
[[noreturn]] void Fail(const char* op, const std::string& message);

// A tensor the backend carries: defined, on the CPU, dense, contiguous, of a dtype it moves.
void CheckTensor(const at::Tensor& t, const char* op);

// The one tensor of a call that takes one per call, checked.
at::Tensor& Single(std::vector<at::Tensor>& tensors, const char* op);

// `t` checked, and of `like`'s dtype with `numel` elements.
void CheckLike(const at::Tensor& t, const at::Tensor& like, int64_t numel, const char* op);

// `root` as a rank of a group of `size`.
int CheckRoot(int64_t root, int size, const char* op);

// `reduce_op` as the reduction to run on `t`'s dtype (CheckReducible).
RedOp CheckOp(const c10d::ReduceOp& reduce_op, const at::Tensor& t, const char* op);

// The first byte of `t`'s memory.
char* Bytes(const at::Tensor& t);

}  // namespace tensorverbs::torch_backend

#endif  // TENSORVERBS_PYTHON_TORCH_OPS_UTIL_H_
