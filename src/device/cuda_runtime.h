// CudaRuntime: the CUDA runtime (libcudart), loaded at run time, so one binary runs every CPU
// path on a machine without a GPU, a driver or the runtime library, and uses GPUs where they
// are. Nothing links libcudart: its entry points are resolved by name. When CMake finds the
// toolkit (TENSORVERBS_HAVE_CUDA), its headers check the ABI values used here and its library
// folder is one more place to look.
//
// Who calls it: device allocators, the transports' device copies, `tensorverbs info`, the gpu
// tests. Get() loads once per process (any thread) and the object lives until the process
// ends; its methods are thread-safe as the CUDA runtime is. Every failure is a Status naming
// the call, the device and, where the caller gives one, the tensor key: out of memory is
// ResourceExhausted, no driver or no device FailedPrecondition, a bad ordinal InvalidArgument.
#ifndef TENSORVERBS_DEVICE_CUDA_RUNTIME_H_
#define TENSORVERBS_DEVICE_CUDA_RUNTIME_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "src/tensor/device_copier.h"

namespace tensorverbs::device {

// Whether the NVIDIA kernel driver is loaded (its /proc or /dev entries exist): without it there
// is no GPU, and callers that only want a GPU if there is one need not load the runtime.
bool NvidiaDriverLoaded();

// The CUDA toolkit version the build found (its headers checked this file), or empty.
std::string BuildToolkit();

// A CUDA error as a Status: `code` (a cudaError_t) with the runtime's name and text for it, the
// call that failed, the device and the key it was for (either may be -1 / empty).
absl::Status CudaErrorStatus(int code, absl::string_view error_name, absl::string_view error_text,
                             absl::string_view call, int device, absl::string_view key);

using CopyKind = CopyDirection;

struct CudaDeviceInfo {
  int ordinal = 0;
  std::string name;
  std::string pci_bus_id;
  uint64_t total_memory = 0;
  int compute_major = 0;
  int compute_minor = 0;
};

class CudaRuntime {
 public:
  // The process's runtime, loaded on first use: from TENSORVERBS_CUDA_RUNTIME's path if set,
  // else libcudart.so.13/.12/.so from the loader's path, else the build's toolkit. Not OK when
  // the build has no CUDA, no library loads, or the library finds no driver or no GPU; the
  // message says which and what to do. The same answer every call.
  static absl::StatusOr<CudaRuntime*> Get();
  // Loads the first of `candidates` that dlopen accepts (tests; Get uses it).
  static absl::StatusOr<std::unique_ptr<CudaRuntime>> Load(
      const std::vector<std::string>& candidates);
  ~CudaRuntime();
  CudaRuntime(const CudaRuntime&) = delete;
  CudaRuntime& operator=(const CudaRuntime&) = delete;

  const std::string& library() const { return library_; }
  // Versions as CUDA encodes them (13000 for 13.0); the driver's says what it supports.
  int runtime_version() const { return runtime_version_; }
  int driver_version() const { return driver_version_; }
  int device_count() const { return device_count_; }

  absl::StatusOr<CudaDeviceInfo> DeviceInfo(int device) const;

  // Device memory on `device`; `key` names the tensor it is for, in errors.
  absl::StatusOr<void*> Malloc(int device, size_t bytes, absl::string_view key = {}) const;
  absl::Status Free(int device, void* ptr) const;
  // A copy that returns when it is complete (tools and tests; the data path uses streams).
  absl::Status Memcpy(int device, void* dst, const void* src, size_t bytes, CopyKind kind,
                      absl::string_view key = {}) const;
  // Streams and events, as opaque handles (cudaStream_t, cudaEvent_t), for the copier's
  // asynchronous copies. A stream is non-blocking (it never waits for the legacy default
  // stream); an event records no timing.
  absl::StatusOr<void*> StreamCreate(int device) const;
  void StreamDestroy(int device, void* stream) const;
  absl::Status MemcpyAsync(int device, void* dst, const void* src, size_t bytes, CopyKind kind,
                           void* stream, absl::string_view key) const;
  absl::StatusOr<void*> EventCreate(int device) const;
  void EventDestroy(int device, void* event) const;
  absl::Status EventRecord(int device, void* event, void* stream) const;
  // OK once the work before the event has completed, Unavailable while it has not, or the
  // error the work (or the device) failed with.
  absl::Status EventQuery(int device, void* event, absl::string_view key) const;
  // Runs fn(arg) on a runtime thread once the stream's earlier work is done; fn must not call
  // the runtime.
  absl::Status LaunchHostFunc(int device, void* stream, void (*fn)(void*), void* arg) const;
  // Returns once the work queued on `device`'s legacy default stream has completed, and with it
  // the work of every blocking stream queued before (what a DLPack producer orders its own
  // stream's work before, when the consumer names no stream). Blocks the caller.
  absl::Status SynchronizeDefaultStream(int device, absl::string_view key) const;
  // Page-locks host memory so device copies reach it by DMA (pinned staging and proxies).
  absl::Status HostRegister(void* ptr, size_t bytes) const;
  absl::Status HostUnregister(void* ptr) const;
  // CUDA IPC: a handle (its bytes) another process on this host opens to map `ptr`'s
  // allocation into its own address space.
  absl::StatusOr<std::string> IpcHandle(int device, void* ptr) const;
  absl::StatusOr<void*> IpcOpen(int device, absl::string_view handle) const;
  absl::Status IpcClose(int device, void* ptr) const;

 private:
  struct Api;
  CudaRuntime(void* library_handle, std::string library, std::unique_ptr<Api> api);
  absl::Status Check(int code, absl::string_view call, int device, absl::string_view key) const;
  absl::Status SetDevice(int device, absl::string_view call, absl::string_view key) const;

  void* handle_ = nullptr;
  std::string library_;
  std::unique_ptr<Api> api_;
  int runtime_version_ = 0;
  int driver_version_ = 0;
  int device_count_ = 0;
};

}  // namespace tensorverbs::device

#endif  // TENSORVERBS_DEVICE_CUDA_RUNTIME_H_
