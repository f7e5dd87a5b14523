#include "tools/bench_device.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/common/checksum.h"
#include "src/device/cuda_allocator.h"
#include "src/device/cuda_runtime.h"
#include "tools/bench_util.h"

namespace tensorverbs::tools {

absl::StatusOr<MemoryPlacement> ParseDevice(const std::string& text, const char* flag) {
  if (text == "cpu") return MemoryPlacement::Host();
  if (text == "cuda") return MemoryPlacement::CudaDevice(0);
  int ordinal = -1;
  if (absl::StartsWith(text, "cuda:") && absl::SimpleAtoi(text.substr(5), &ordinal) &&
      ordinal >= 0) {
    return MemoryPlacement::CudaDevice(ordinal);
  }
  return absl::InvalidArgumentError(
      absl::StrCat(flag, " '", text, "': expected cpu, cuda or cuda:N"));
}

absl::StatusOr<DevicePair> ParseDevicePair(const std::string& text) {
  std::vector<std::string> parts = absl::StrSplit(text, ',');
  if (parts.empty() || parts.size() > 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device '", text, "': expected SRC or SRC,DST (cpu, cuda, cuda:N)"));
  }
  DevicePair out;
  auto src = ParseDevice(parts[0], "--device");
  if (!src.ok()) return src.status();
  out.src = *src;
  out.dst = *src;
  if (parts.size() == 2) {
    auto dst = ParseDevice(parts[1], "--device");
    if (!dst.ok()) return dst.status();
    out.dst = *dst;
  }
  return out;
}

absl::Status CheckDevice(const MemoryPlacement& placement) {
  if (placement.host_accessible()) return absl::OkStatus();
  absl::StatusOr<device::CudaRuntime*> rt = device::CudaRuntime::Get();
  if (!rt.ok()) return rt.status();
  if (placement.device >= (*rt)->device_count()) {
    return absl::InvalidArgumentError(absl::StrCat("there is no ", placement.ToString(), " (",
                                                   (*rt)->device_count(), " GPUs here)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Allocator*> AllocatorFor(const MemoryPlacement& placement, Server& server) {
  if (placement.host_accessible()) return server.recv_allocator();
  absl::StatusOr<PoolAllocator*> pool = server.DeviceAllocator(placement.device);
  if (!pool.ok()) return pool.status();
  return *pool;
}

absl::StatusOr<Tensor> PatternTensor(const MemoryPlacement& placement, Server& server, size_t bytes,
                                     uint32_t seed) {
  const TensorShape shape = TensorShape::Of({static_cast<int64_t>(bytes)});
  absl::StatusOr<Tensor> h = Tensor::Allocate(server.recv_allocator(), DataType::kUInt8, shape);
  if (!h.ok()) return h.status();
  FillBenchPattern(h->data(), bytes, seed);
  if (placement.host_accessible()) return h;
  absl::StatusOr<Allocator*> a = AllocatorFor(placement, server);
  if (!a.ok()) return a.status();
  absl::StatusOr<Tensor> d = Tensor::Allocate(*a, DataType::kUInt8, shape);
  if (!d.ok()) return d.status();
  absl::StatusOr<device::CudaRuntime*> rt = device::CudaRuntime::Get();
  if (!rt.ok()) return rt.status();
  if (absl::Status s = (*rt)->Memcpy(placement.device, d->data(), h->data(), bytes,
                                     device::CopyKind::kHostToDevice, "bench pattern");
      !s.ok()) {
    return s;
  }
  return d;
}

absl::StatusOr<uint32_t> TensorCrc(const Tensor& t) {
  if (t.placement().host_accessible()) return Crc32c(t.data(), t.TotalBytes());
  absl::StatusOr<device::CudaRuntime*> rt = device::CudaRuntime::Get();
  if (!rt.ok()) return rt.status();
  std::vector<char> host(t.TotalBytes());
  if (absl::Status s = (*rt)->Memcpy(t.placement().device, host.data(), t.data(), host.size(),
                                     device::CopyKind::kDeviceToHost, "bench check");
      !s.ok()) {
    return s;
  }
  return Crc32c(host.data(), host.size());
}

absl::StatusOr<CopyBandwidth> MeasureDeviceCopies(int device, size_t bytes) {
  absl::StatusOr<device::CudaRuntime*> rt = device::CudaRuntime::Get();
  if (!rt.ok()) return rt.status();
  void* host = nullptr;
  if (posix_memalign(&host, 4096, bytes) != 0) {
    return absl::ResourceExhaustedError(absl::StrCat("no ", bytes, " bytes of host memory"));
  }
  std::unique_ptr<void, void (*)(void*)> host_owner(host, std::free);
  FillBenchPattern(host, bytes, 1);
  if (absl::Status s = (*rt)->HostRegister(host, bytes); !s.ok()) return s;
  absl::StatusOr<void*> dev = (*rt)->Malloc(device, bytes, "bench copy ceiling");
  CopyBandwidth out;
  absl::Status status = dev.status();
  for (int rep = 0; status.ok() && rep < 5; ++rep) {
    for (auto kind : {device::CopyKind::kHostToDevice, device::CopyKind::kDeviceToHost}) {
      const absl::Time t0 = absl::Now();
      status = kind == device::CopyKind::kHostToDevice
                   ? (*rt)->Memcpy(device, *dev, host, bytes, kind)
                   : (*rt)->Memcpy(device, host, *dev, bytes, kind);
      if (!status.ok()) break;
      const double gbps = bytes / absl::ToDoubleSeconds(absl::Now() - t0) / 1e9;
      double& best = kind == device::CopyKind::kHostToDevice ? out.host_to_device_gbps
                                                             : out.device_to_host_gbps;
      best = std::max(best, gbps);
    }
  }
  // Device to device: cudaMemcpy does not wait for that copy, so it is timed to its event.
  absl::StatusOr<void*> other = status.ok() ? (*rt)->Malloc(device, bytes, "bench copy ceiling")
                                            : absl::StatusOr<void*>(status);
  absl::StatusOr<void*> stream = other.ok() ? (*rt)->StreamCreate(device) : other.status();
  absl::StatusOr<void*> event = stream.ok() ? (*rt)->EventCreate(device) : stream.status();
  status = event.status();
  for (int rep = 0; status.ok() && rep < 5; ++rep) {
    const absl::Time t0 = absl::Now();
    status = (*rt)->MemcpyAsync(device, *other, *dev, bytes, device::CopyKind::kDeviceToDevice,
                                *stream, "bench copy ceiling");
    if (status.ok()) status = (*rt)->EventRecord(device, *event, *stream);
    while (status.ok()) {
      absl::Status q = (*rt)->EventQuery(device, *event, "bench copy ceiling");
      if (!absl::IsUnavailable(q)) {
        status = q;
        break;
      }
    }
    if (!status.ok()) break;
    out.device_to_device_gbps =
        std::max(out.device_to_device_gbps, bytes / absl::ToDoubleSeconds(absl::Now() - t0) / 1e9);
  }
  if (event.ok()) (*rt)->EventDestroy(device, *event);
  if (stream.ok()) (*rt)->StreamDestroy(device, *stream);
  if (other.ok()) (void)(*rt)->Free(device, *other);
  if (dev.ok()) (void)(*rt)->Free(device, *dev);
  (void)(*rt)->HostUnregister(host);
  if (!status.ok()) return status;
  return out;
}

}  // namespace tensorverbs::tools
