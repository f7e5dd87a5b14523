// Task: one tensorverbs Task as Python's tensorverbs.Server holds it, and the conversion of
// whatever Python sends (a NumPy array, a pool array or another view of one, a DeviceTensor, a
// producer's CUDA tensor by DLPack, a list of bytes/str) into the tensor that is sent.
//
// Made and called by Python on the caller's thread with the GIL held. Shared (shared_ptr) by
// the Python object, every Step begun on it and every RecvFuture, so the task outlives them.
// Every call that may wait in the task (start, wait_for_peers, stop, a device's pending work)
// releases the GIL, because a RecvFuture's done-callbacks run on the task's callback threads
// with the GIL; stopping the task on destruction releases it too, for the same reason.
#ifndef TENSORVERBS_PYTHON_TASK_BINDING_H_
#define TENSORVERBS_PYTHON_TASK_BINDING_H_

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tensorverbs/allocator.h"
#include "tensorverbs/task.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::python {

class PyTask {
 public:
  PyTask(const std::string& cluster, const std::string& job, int task, const std::string& protocol,
         std::optional<double> recv_timeout);

  // Stopping the task waits for its callback threads, which may be waiting for the GIL.
  ~PyTask();

  const std::shared_ptr<Task>& task() const { return task_; }
  std::atomic<int64_t>& staged() { return staged_; }
  std::atomic<int64_t>& staged_bytes() { return staged_bytes_; }
  // A recv into `out` that landed elsewhere (the same-host fabric) and was copied in.
  void CountOutCopy(uint64_t bytes) {
    out_copies_.fetch_add(1, std::memory_order_relaxed);
    out_copied_bytes_.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  }

  // Every other task, or only `tasks` where given.
  void WaitForPeers(double timeout, std::optional<std::vector<std::string>> tasks);

  void Stop();

  // In the pool, or with `device` in that GPU's pool (a DeviceTensor).
  pybind11::object Empty(const std::vector<int64_t>& dims, const pybind11::dtype& dtype,
                         std::optional<int> device);

  // The allocator of a recv into GPU `device`, or null for host memory.
  Allocator* RecvAllocator(std::optional<int> device);

  pybind11::dict Stats() const;

  // The tensor `value` is sent as: a pool array as it is, anything else staged once.
  Tensor TensorFor(const pybind11::object& value);

 private:
  // Memory the caller's kernels may still be writing is complete before a send reads it.
  void WaitForDeviceWork(int device);

  // A producer's CUDA tensor (a PyTorch CUDA tensor, a CuPy array) by DLPack: one viewing all of
  // a GPU pool tensor of this module is that tensor; any other is adopted as it is, held until
  // the send's device-to-host copy is done. Either way without a copy here.
  Tensor GpuTensorFor(const pybind11::object& value);

  std::shared_ptr<Task> task_;
  std::atomic<int64_t> staged_{0};
  std::atomic<int64_t> staged_bytes_{0};
  std::atomic<int64_t> out_copies_{0};
  std::atomic<int64_t> out_copied_bytes_{0};
};

// Registers Task with `m`.
void BindTask(pybind11::module_& m);

}  // namespace tensorverbs::python

#endif  // TENSORVERBS_PYTHON_TASK_BINDING_H_
