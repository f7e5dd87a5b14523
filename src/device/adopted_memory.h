// AdoptDeviceMemory: a Tensor over GPU memory its caller owns (a PyTorch or CuPy tensor's,
// handed over by DLPack, or memory the caller cudaMalloc'd), so the task can send it without a
// copy into its own pools.
//
// The tensor's buffer comes from a one-use Allocator that hands out exactly that memory and,
// when the last Tensor referring to it goes, runs `release` and deletes itself; so `release`
// runs exactly once, on whichever thread drops the last reference (a copier's or progress
// thread, or the caller's), and also when adopting fails. Called on any thread.
#ifndef TENSORVERBS_DEVICE_ADOPTED_MEMORY_H_
#define TENSORVERBS_DEVICE_ADOPTED_MEMORY_H_

#include <functional>

#include "absl/status/statusor.h"
#include "tensorverbs/allocator.h"
#include "tensorverbs/tensor.h"
#include "tensorverbs/tensor_shape.h"
#include "tensorverbs/types.h"

namespace tensorverbs::device {

// InvalidArgument for a string dtype (strings live in host memory only), a placement that is
// not a GPU's, or a null `data` for a non-empty shape. An empty tensor holds no memory, so its
// `release` runs before this returns. The memory needs no particular alignment.
absl::StatusOr<Tensor> AdoptDeviceMemory(MemoryPlacement placement, void* data, DataType dtype,
                                         const TensorShape& shape, std::function<void()> release);

}  // namespace tensorverbs::device

#endif  // TENSORVERBS_DEVICE_ADOPTED_MEMORY_H_
