// CudaFabricMemory: the fabric's view of GPU memory (fabric::DeviceMemory) over the CUDA runtime,
// so a fabric that can reach device memory directly (the same-host fabric, by CUDA IPC) does so
// without the fabric layer knowing CUDA. It lives here, where the server wires the device and
// fabric layers together, because neither of them may include the other.
//
// Exports are cudaIpcGetMemHandle, imports cudaIpcOpenMemHandle (peer access enabled lazily),
// copies cudaMemcpyAsync on one non-blocking stream per device with a pooled event recorded
// behind each, polled with cudaEventQuery. Who calls it: the shmem domains of the server's
// grpc+verbs transport, on their progress threads (Export on whichever thread registers).
// Thread-safe; it must outlive every domain given it (domains hold it by shared_ptr).
#ifndef TENSORVERBS_SERVER_CUDA_FABRIC_MEMORY_H_
#define TENSORVERBS_SERVER_CUDA_FABRIC_MEMORY_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "src/common/mutex.h"
#include "src/device/cuda_runtime.h"
#include "src/fabric/device_memory.h"

namespace tensorverbs {

class CudaFabricMemory final : public fabric::DeviceMemory {
 public:
  // Over `runtime`, which outlives this object.
  explicit CudaFabricMemory(const device::CudaRuntime* runtime) : runtime_(runtime) {}
  ~CudaFabricMemory() override;  // destroys the streams and events it made
  CudaFabricMemory(const CudaFabricMemory&) = delete;
  CudaFabricMemory& operator=(const CudaFabricMemory&) = delete;

  std::string Name() const override;
  std::string PciBusId(int device) const override;
  absl::StatusOr<std::string> Export(int device, void* base) override;
  absl::StatusOr<void*> Import(int device, absl::string_view handle) override;
  void Close(int device, void* imported) override;
  absl::Status RegisterHost(void* addr, size_t bytes) override;
  void UnregisterHost(void* addr) override;
  absl::StatusOr<uint64_t> StartCopy(int device, Side dst, Side src, size_t bytes) override;
  absl::StatusOr<bool> CopyDone(uint64_t ticket) override;

 private:
  // Export's bytes: the exporting process and address (so that process imports its own memory
  // as it is: CUDA IPC refuses that), then the runtime's handle.
  struct Exported {
    uint32_t pid;
    uint32_t device;
    uint64_t base;
  };
  struct Running {
    int device = 0;
    void* event = nullptr;
  };

  const device::CudaRuntime* const runtime_;
  Mutex mu_;
  std::map<int, void*> streams_ ABSL_GUARDED_BY(mu_);                   // device -> stream
  std::map<int, std::vector<void*>> free_events_ ABSL_GUARDED_BY(mu_);  // device -> events
  std::map<uint64_t, Running> running_ ABSL_GUARDED_BY(mu_);            // ticket -> copy
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  // Imports CUDA IPC mapped, with how often each was opened: the runtime hands out the same
  // address for the same allocation again, and each open needs its close.
  std::map<void*, int> opened_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_SERVER_CUDA_FABRIC_MEMORY_H_
