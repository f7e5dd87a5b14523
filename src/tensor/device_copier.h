// DeviceCopier: asynchronous copies between host memory and a GPU's memory, which the CPU
// cannot read or write (MemoryPlacement::host_accessible() is false). The rendezvous layer
// stages device tensors through host memory with it: a device tensor a peer asks for is
// copied device-to-host into the registered pool before the protocol writes it, and a recv into
// a device allocator lands in the pool (the proxy) and is copied host-to-device before `done`.
//
// Who implements it: device::CudaCopier (CUDA streams and events) where a GPU is present, and
// tests (a stand-in that copies with memcpy). Who calls it: RemoteRendezvous, from any thread:
// CopyAsync never blocks on the copy. `done` runs exactly once, when the copy has completed or
// failed, on a thread of the copier's (never inline in CopyAsync, never a thread inside the
// GPU runtime), so it may call the GPU runtime and start further copies. The copier must
// outlive every copy it started.
#ifndef TENSORVERBS_TENSOR_DEVICE_COPIER_H_
#define TENSORVERBS_TENSOR_DEVICE_COPIER_H_

#include <cstddef>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "tensorverbs/allocator.h"

namespace tensorverbs {

enum class CopyDirection { kHostToDevice, kDeviceToHost, kDeviceToDevice };

inline const char* CopyDirectionName(CopyDirection d) {
  switch (d) {
    case CopyDirection::kHostToDevice:
      return "host-to-device";
    case CopyDirection::kDeviceToHost:
      return "device-to-host";
    case CopyDirection::kDeviceToDevice:
      return "device-to-device";
  }
  return "?";
}

class DeviceCopier {
 public:
  using DoneCallback = absl::AnyInvocable<void(absl::Status) &&>;

  virtual ~DeviceCopier() = default;
  virtual std::string Name() const = 0;
  // Whether it copies to and from memory of `placement` (a GPU it drives).
  virtual bool Handles(const MemoryPlacement& placement) const = 0;
  // Copies `bytes` from `src` to `dst` on GPU `device` (the device side's ordinal). `key` names
  // the tensor in errors. A failure is a Status naming the device, the call and the key.
  virtual void CopyAsync(int device, void* dst, const void* src, size_t bytes,
                         CopyDirection direction, absl::string_view key, DoneCallback done) = 0;
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_TENSOR_DEVICE_COPIER_H_
