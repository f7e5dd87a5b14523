// fabric::DeviceMemory: what a fabric needs of a GPU runtime to reach device memory directly,
// without the fabric layer linking one. The device layer implements it with CUDA
// (device::CudaDeviceMemory); tests implement it with host memory.
//
// The same-host fabric (shmem) uses it for its direct device path: a registered device region
// is exported once (Export: a CUDA IPC handle), the peer that writes into it imports it once
// (Import) and moves bytes with an asynchronous copy (StartCopy) whose completion it polls
// (CopyDone) before it publishes the write's immediate. Either side of a copy may be device
// memory or host memory; the runtime picks the direction from the addresses.
//
// Threading: Export may run on any thread (registration); Import, Close, StartCopy and
// CopyDone run on the domain's progress thread. None blocks on a copy. Implementations are
// thread-safe and outlive every domain given them.
#ifndef TENSORVERBS_FABRIC_DEVICE_MEMORY_H_
#define TENSORVERBS_FABRIC_DEVICE_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tensorverbs::fabric {

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  // "CUDA IPC (libcudart.so.13)": for logs and `tensorverbs info`.
  virtual std::string Name() const = 0;
  // GPU `device`'s PCI bus id ("0000:3B:00.0"), for ranking the NICs nearest it
  // (pci_topology.h); empty where unknown.
  virtual std::string PciBusId(int device) const {
    (void)device;
    return "";
  }
  // Bytes another process on this host passes to Import to reach the allocation that starts
  // at `base` on `device` (a whole allocation: the pool's regions are).
  virtual absl::StatusOr<std::string> Export(int device, void* base) = 0;
  // Maps a peer's exported allocation into this process, on `device` (the writer's device;
  // the runtime enables peer access where the memory lives on another). Returns its base here.
  // A handle this process exported itself imports as the allocation's own address.
  virtual absl::StatusOr<void*> Import(int device, absl::string_view handle) = 0;
  virtual void Close(int device, void* imported) = 0;
  // Page-locks host memory that copies from or to device memory will touch (a peer's mapped
  // region), so they run by DMA without blocking the caller. Unregister undoes it.
  virtual absl::Status RegisterHost(void* addr, size_t bytes) = 0;
  virtual void UnregisterHost(void* addr) = 0;
  // Where one side of a copy lies.
  struct Side {
    void* addr = nullptr;
    bool on_device = false;
  };
  // Starts copying `bytes` from `src` to `dst` on `device`'s copy stream; copies started on one
  // device complete in the order started. Returns a ticket for CopyDone, which the caller polls
  // (a progress thread does not sleep while copies run).
  virtual absl::StatusOr<uint64_t> StartCopy(int device, Side dst, Side src, size_t bytes) = 0;
  // True once the copy has completed, false while it runs, or the error it failed with. A
  // ticket is spent once it reported true or an error.
  virtual absl::StatusOr<bool> CopyDone(uint64_t ticket) = 0;
};

}  // namespace tensorverbs::fabric

#endif  // TENSORVERBS_FABRIC_DEVICE_MEMORY_H_
