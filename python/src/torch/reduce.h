// Element-wise reductions of torch.distributed's ReduceOp over raw tensor memory, for the
// collectives of ProcessGroupTensorVerbs. Pure functions, callable from any thread.
#ifndef TENSORVERBS_PYTHON_TORCH_REDUCE_H_
#define TENSORVERBS_PYTHON_TORCH_REDUCE_H_

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "absl/status/status.h"

namespace tensorverbs::torch_backend {

using RedOp = c10d::ReduceOp::RedOpType;

// OK when `op` applies to `dtype`; otherwise InvalidArgument naming both (asked before anything
// is sent, so a bad call sends nothing). AVG needs a floating or complex type; the bitwise ops an
// integral one or bool; MIN and MAX a real one; PREMUL_SUM is not supported.
absl::Status CheckReducible(c10::ScalarType dtype, RedOp op);

// acc[i] = acc[i] op in[i] for `count` elements; AVG sums (DivideBy finishes it).
void ReduceInto(c10::ScalarType dtype, RedOp op, void* acc, const void* in, int64_t count);

// data[i] /= n, for AVG's last step.
void DivideBy(c10::ScalarType dtype, void* data, int64_t count, int64_t n);

// "AVG", "SUM", ...
const char* RedOpName(RedOp op);

}  // namespace tensorverbs::torch_backend

#endif  // TENSORVERBS_PYTHON_TORCH_REDUCE_H_
