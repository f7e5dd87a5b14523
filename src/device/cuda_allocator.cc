#include "src/device/cuda_allocator.h"

#include "absl/strings/str_cat.h"
#include "src/common/logging.h"

namespace tensorverbs::device {

absl::StatusOr<std::unique_ptr<CudaAllocator>> CudaAllocator::Create(const CudaRuntime* runtime,
                                                                     int device) {
  if (device < 0 || device >= runtime->device_count()) {
    return absl::InvalidArgumentError(absl::StrCat("no cuda:", device, " for an allocator (",
                                                   runtime->device_count(), " GPUs here)"));
  }
  return std::unique_ptr<CudaAllocator>(new CudaAllocator(runtime, device));
}

std::string CudaAllocator::Name() const { return absl::StrCat("cuda:", device_); }

void* CudaAllocator::AllocateRaw(size_t bytes) {
  // cudaMalloc aligns to at least 256 bytes, past Allocator::kAlignment.
  absl::StatusOr<void*> p = runtime_->Malloc(device_, bytes);
  if (!p.ok()) {
    MutexLock lock(&mu_);
    last_error_ = p.status();
    return nullptr;
  }
  in_use_.fetch_add(bytes, std::memory_order_relaxed);
  return *p;
}

void CudaAllocator::DeallocateRaw(void* ptr, size_t bytes) {
  if (ptr == nullptr) return;
  if (absl::Status s = runtime_->Free(device_, ptr); !s.ok()) {
    LOG(ERROR) << "freeing " << bytes << " bytes of " << Name() << ": " << s.message();
  }
  in_use_.fetch_sub(bytes, std::memory_order_relaxed);
}

absl::Status CudaAllocator::last_error() const {
  MutexLock lock(&mu_);
  return last_error_;
}

absl::StatusOr<std::unique_ptr<PoolAllocator>> NewCudaPool(const CudaRuntime* runtime, int device,
                                                           PoolAllocator::Options options) {
  if (device < 0 || device >= runtime->device_count()) {
    return absl::InvalidArgumentError(
        absl::StrCat("there is no cuda:", device, " (", runtime->device_count(), " GPUs here)"));
  }
  auto source = std::make_shared<RegionSource>();
  source->placement = MemoryPlacement::CudaDevice(device);
  source->allocate = [runtime, device](size_t bytes) -> void* {
    absl::StatusOr<void*> p = runtime->Malloc(device, bytes, "a pool region");
    if (!p.ok()) {
      LOG(WARNING) << p.status();
      return nullptr;
    }
    return *p;
  };
  source->release = [runtime, device](void* base, size_t) {
    if (absl::Status s = runtime->Free(device, base); !s.ok()) LOG(WARNING) << s;
  };
  options.source = std::move(source);
  options.shareable = false;
  return std::make_unique<PoolAllocator>(absl::StrCat("cuda:", device, " pool"), options);
}

}  // namespace tensorverbs::device
