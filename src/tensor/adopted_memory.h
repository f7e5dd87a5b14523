// AdoptMemory: a Tensor over memory its caller owns, so that a task can send it without first
// copying it into its own pools: GPU memory (a PyTorch or CuPy tensor's, handed over by DLPack,
// or memory the caller cudaMalloc'd) or host memory (a PyTorch CPU tensor's, which the torch
// backend sends from).
//
// The tensor's buffer comes from a one-use Allocator that hands out exactly that memory and,
// when the last Tensor referring to it goes, runs `release` and deletes itself; so `release`
// runs exactly once, on whichever thread drops the last reference (a copier's or progress
// thread, or the caller's), and also when adopting fails. Called on any thread.
#ifndef TENSORVERBS_TENSOR_ADOPTED_MEMORY_H_
#define TENSORVERBS_TENSOR_ADOPTED_MEMORY_H_

#include <functional>

#include "absl/status/statusor.h"
#include "tensorverbs/allocator.h"
#include "tensorverbs/tensor.h"
#include "tensorverbs/tensor_shape.h"
#include "tensorverbs/types.h"

namespace tensorverbs {

// `data` lies in `placement`'s memory (the caller says where; nothing here can check it).
// InvalidArgument for a string dtype (string elements are objects, not bytes another task can
// be given) or a null `data` for a non-empty shape. An empty tensor holds no memory, so its
// `release` runs before this returns. The memory needs no particular alignment.
absl::StatusOr<Tensor> AdoptMemory(MemoryPlacement placement, void* data, DataType dtype,
                                   const TensorShape& shape, std::function<void()> release);

}  // namespace tensorverbs

#endif  // TENSORVERBS_TENSOR_ADOPTED_MEMORY_H_
