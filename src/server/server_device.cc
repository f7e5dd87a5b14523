// The server's GPU side: the CUDA copier and the fabric's view of GPU memory, the task's GPU
// pools, memory adopted from the caller, and the receive pool's pinning: the Server methods
// that deal with GPUs, apart from the rest of server.cc.
#include <functional>
#include <limits>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "src/common/config.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"
#include "src/device/cuda_allocator.h"
#include "src/device/cuda_copier.h"
#include "src/device/cuda_runtime.h"
#include "src/device/pinned_pool.h"
#include "src/server/cuda_fabric_memory.h"
#include "src/server/server.h"
#include "src/tensor/adopted_memory.h"

namespace tensorverbs {

namespace {

// The CUDA runtime if this host has a GPU. Without the NVIDIA driver there is no GPU to copy
// to: the runtime is not even loaded, unless TENSORVERBS_CUDA_RUNTIME names one (a runtime
// the user chose is asked, and says itself whether it finds a device).
absl::StatusOr<device::CudaRuntime*> CudaIfPresent() {
  if (Config::Get().cuda_runtime.empty() && !device::NvidiaDriverLoaded()) {
    return absl::FailedPreconditionError("no NVIDIA driver is loaded on this host");
  }
  return device::CudaRuntime::Get();
}

}  // namespace

void Server::SetUpDeviceCopier() {
  if (options_.device_copier != nullptr) {
    env_.device_copier = options_.device_copier;
    return;
  }
  absl::StatusOr<device::CudaRuntime*> cuda = CudaIfPresent();
  if (!cuda.ok()) return;  // device tensors stay within the task; info says why
  cuda_copier_ = std::make_unique<device::CudaCopier>(*cuda);
  env_.device_copier = cuda_copier_.get();
}

std::shared_ptr<fabric::DeviceMemory> Server::FabricDeviceMemory() {
  if (options_.device_memory != nullptr) return options_.device_memory;
  absl::StatusOr<device::CudaRuntime*> cuda = CudaIfPresent();
  if (!cuda.ok()) return nullptr;
  return std::make_shared<CudaFabricMemory>(*cuda);
}

absl::StatusOr<std::unique_ptr<PoolAllocator>> Server::NewDevicePool(int device) {
  if (options_.device_pool_factory) return options_.device_pool_factory(device);
  absl::StatusOr<device::CudaRuntime*> cuda = CudaIfPresent();
  if (!cuda.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "task ", env_.task_name, " has no GPU memory to offer: ", cuda.status().message()));
  }
  PoolAllocator::Options pool_options;
  pool_options.region_bytes = static_cast<size_t>(options_.pool_region_bytes);
  pool_options.keep_free_bytes = static_cast<size_t>(options_.pool_keep_free_bytes);
  pool_options.release_after = ServerOptions::kPoolReleaseAfter;
  if (verbs_ != nullptr && verbs_->device_direct()) {
    // Peers import these regions (CUDA IPC) and keep them imported while their channel lives;
    // freeing one under them is undefined behaviour, so the pool keeps what it grew to.
    pool_options.keep_free_bytes = std::numeric_limits<size_t>::max();
  }
  return device::NewCudaPool(*cuda, device, pool_options);
}

absl::StatusOr<PoolAllocator*> Server::DeviceAllocator(int device) {
  MutexLock lock(&device_pools_mu_);
  auto it = device_pools_.find(device);
  if (it != device_pools_.end()) return it->second.get();
  ASSIGN_OR_RETURN(std::unique_ptr<PoolAllocator> pool, NewDevicePool(device));
  if (verbs_ != nullptr) verbs_->AddDevicePool(pool.get());
  return device_pools_.emplace(device, std::move(pool)).first->second.get();
}

bool Server::PoolsInUse() {
  if (recv_allocator_->GetStats().allocations > 0) return true;
  MutexLock lock(&device_pools_mu_);
  for (const auto& [device, pool] : device_pools_) {
    if (pool->GetStats().allocations > 0) return true;
  }
  return false;
}

absl::StatusOr<Tensor> Server::AdoptDeviceMemory(int device, void* data, DataType dtype,
                                                 const TensorShape& shape,
                                                 std::function<void()> release) {
  const MemoryPlacement where = MemoryPlacement::CudaDevice(device);
  if (env_.device_copier == nullptr || !env_.device_copier->Handles(where)) {
    if (release) release();
    return absl::FailedPreconditionError(absl::StrCat(
        "task ", env_.task_name, " cannot send ", where.ToString(),
        " memory: it has no CUDA runtime driving that device (`tensorverbs info` says why); "
        "copy the tensor to the host first"));
  }
  return AdoptMemory(where, data, dtype, shape, std::move(release));
}

absl::Status Server::WaitForDeviceWork(int device) {
  if (options_.device_copier != nullptr) return absl::OkStatus();
  absl::StatusOr<device::CudaRuntime*> runtime = CudaIfPresent();
  if (!runtime.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("task ", env_.task_name, " has no CUDA runtime driving cuda:", device, " (",
                     runtime.status().message(), "); copy GPU tensors to the host first"));
  }
  // A bad ordinal is the runtime's InvalidArgument, naming the device.
  return (*runtime)->SynchronizeDefaultStream(device, {});
}

void Server::PinPoolIfAsked() {
  if (options_.pin_pool == "off") return;
  absl::StatusOr<device::CudaRuntime*> cuda = CudaIfPresent();
  if (!cuda.ok()) {
    if (options_.pin_pool == "on") {
      LOG(WARNING) << "TENSORVERBS_PIN_POOL=on: the receive pool stays pageable: "
                   << cuda.status().message();
    }
    return;
  }
  device::PinPoolRegions(recv_allocator_.get(), *cuda);
}

}  // namespace tensorverbs
