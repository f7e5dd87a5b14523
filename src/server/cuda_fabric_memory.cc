#include "src/server/cuda_fabric_memory.h"

#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"

namespace tensorverbs {

CudaFabricMemory::~CudaFabricMemory() {
  MutexLock lock(&mu_);
  for (auto& [ticket, r] : running_) runtime_->EventDestroy(r.device, r.event);
  for (auto& [device, events] : free_events_) {
    for (void* e : events) runtime_->EventDestroy(device, e);
  }
  for (auto& [device, stream] : streams_) runtime_->StreamDestroy(device, stream);
}

std::string CudaFabricMemory::Name() const {
  return absl::StrCat("CUDA IPC (", runtime_->library(), ")");
}

std::string CudaFabricMemory::PciBusId(int device) const {
  absl::StatusOr<device::CudaDeviceInfo> info = runtime_->DeviceInfo(device);
  return info.ok() ? info->pci_bus_id : std::string();
}

absl::StatusOr<std::string> CudaFabricMemory::Export(int device, void* base) {
  ASSIGN_OR_RETURN(std::string handle, runtime_->IpcHandle(device, base));
  const Exported e{static_cast<uint32_t>(getpid()), static_cast<uint32_t>(device),
                   reinterpret_cast<uint64_t>(base)};
  return absl::StrCat(absl::string_view(reinterpret_cast<const char*>(&e), sizeof(e)), handle);
}

absl::StatusOr<void*> CudaFabricMemory::Import(int device, absl::string_view handle) {
  Exported e;
  if (handle.size() <= sizeof(e)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a ", handle.size(), "-byte device handle is not one this build exports"));
  }
  std::memcpy(&e, handle.data(), sizeof(e));
  if (e.pid == static_cast<uint32_t>(getpid())) return reinterpret_cast<void*>(e.base);
  ASSIGN_OR_RETURN(void* base, runtime_->IpcOpen(device, handle.substr(sizeof(e))));
  MutexLock lock(&mu_);
  ++opened_[base];
  return base;
}

void CudaFabricMemory::Close(int device, void* imported) {
  {
    MutexLock lock(&mu_);
    auto it = opened_.find(imported);
    if (it == opened_.end()) return;  // this process's own memory
    if (--it->second == 0) opened_.erase(it);
  }
  if (absl::Status s = runtime_->IpcClose(device, imported); !s.ok()) {
    LOG(WARNING) << "closing a peer's imported GPU memory: " << s;
  }
}

absl::Status CudaFabricMemory::RegisterHost(void* addr, size_t bytes) {
  return runtime_->HostRegister(addr, bytes);
}

void CudaFabricMemory::UnregisterHost(void* addr) {
  if (absl::Status s = runtime_->HostUnregister(addr); !s.ok()) {
    VLOG(1) << "unregistering a peer's host region from CUDA: " << s;
  }
}

absl::StatusOr<uint64_t> CudaFabricMemory::StartCopy(int device, Side dst, Side src, size_t bytes) {
  if (!dst.on_device && !src.on_device) {
    return absl::InvalidArgumentError("a device copy between two host buffers");
  }
  const CopyDirection direction = !src.on_device   ? CopyDirection::kHostToDevice
                                  : !dst.on_device ? CopyDirection::kDeviceToHost
                                                   : CopyDirection::kDeviceToDevice;
  MutexLock lock(&mu_);
  void*& stream = streams_[device];
  if (stream == nullptr) {
    absl::StatusOr<void*> made = runtime_->StreamCreate(device);
    if (!made.ok()) {
      streams_.erase(device);
      return made.status();
    }
    stream = *made;
  }
  void* event = nullptr;
  std::vector<void*>& events = free_events_[device];
  if (!events.empty()) {
    event = events.back();
    events.pop_back();
  } else {
    ASSIGN_OR_RETURN(event, runtime_->EventCreate(device));
  }
  absl::Status s = runtime_->MemcpyAsync(device, dst.addr, src.addr, bytes, direction, stream, {});
  if (s.ok()) s = runtime_->EventRecord(device, event, stream);
  if (!s.ok()) {
    events.push_back(event);
    return s;
  }
  const uint64_t ticket = next_ticket_++;
  running_[ticket] = Running{device, event};
  return ticket;
}

absl::StatusOr<bool> CudaFabricMemory::CopyDone(uint64_t ticket) {
  MutexLock lock(&mu_);
  auto it = running_.find(ticket);
  if (it == running_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("no device copy has ticket ", ticket));
  }
  const Running r = it->second;
  absl::Status s = runtime_->EventQuery(r.device, r.event, {});
  if (absl::IsUnavailable(s)) return false;
  running_.erase(it);
  if (s.ok()) {
    free_events_[r.device].push_back(r.event);
    return true;
  }
  // An event whose work failed may stay in that state: it is not reused.
  runtime_->EventDestroy(r.device, r.event);
  return s;
}

}  // namespace tensorverbs
