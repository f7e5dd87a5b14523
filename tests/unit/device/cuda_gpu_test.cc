// Device memory through the CUDA runtime on a real GPU (label `gpu`): skipped, with the reason,
// where the runtime finds no GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "src/device/cuda_allocator.h"
#include "src/device/cuda_runtime.h"
#include "src/device/pinned_pool.h"
#include "src/tensor/allocator.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::device {
namespace {

using ::testing::HasSubstr;

class CudaGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<CudaRuntime*> rt = CudaRuntime::Get();
    if (!rt.ok()) GTEST_SKIP() << "no GPU: " << rt.status();
    rt_ = *rt;
  }
  CudaRuntime* rt_ = nullptr;
};

TEST_F(CudaGpuTest, EveryDeviceRoundTripsBytesOfEverySize) {
  for (int d = 0; d < rt_->device_count(); ++d) {
    absl::StatusOr<CudaDeviceInfo> info = rt_->DeviceInfo(d);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_FALSE(info->name.empty());
    EXPECT_GT(info->total_memory, 0u);
    for (size_t bytes : {size_t{1}, size_t{4096} + 3, size_t{1} << 20, size_t{64} << 20}) {
      std::vector<uint8_t> src(bytes), back(bytes, 0);
      std::iota(src.begin(), src.end(), static_cast<uint8_t>(bytes));
      absl::StatusOr<void*> dev = rt_->Malloc(d, bytes, "round trip");
      ASSERT_TRUE(dev.ok()) << dev.status();
      ASSERT_TRUE(rt_->Memcpy(d, *dev, src.data(), bytes, CopyKind::kHostToDevice).ok());
      ASSERT_TRUE(rt_->Memcpy(d, back.data(), *dev, bytes, CopyKind::kDeviceToHost).ok());
      EXPECT_EQ(src, back) << bytes << " bytes on cuda:" << d;
      EXPECT_TRUE(rt_->Free(d, *dev).ok());
    }
  }
}

TEST_F(CudaGpuTest, PinnedHostMemoryCopiesBothWays) {
  std::vector<uint8_t> host(1 << 20, 7);
  ASSERT_TRUE(rt_->HostRegister(host.data(), host.size()).ok());
  absl::StatusOr<void*> dev = rt_->Malloc(0, host.size());
  ASSERT_TRUE(dev.ok()) << dev.status();
  ASSERT_TRUE(rt_->Memcpy(0, *dev, host.data(), host.size(), CopyKind::kHostToDevice).ok());
  std::fill(host.begin(), host.end(), 0);
  ASSERT_TRUE(rt_->Memcpy(0, host.data(), *dev, host.size(), CopyKind::kDeviceToHost).ok());
  EXPECT_EQ(host[0], 7);
  EXPECT_EQ(host.back(), 7);
  EXPECT_TRUE(rt_->Free(0, *dev).ok());
  EXPECT_TRUE(rt_->HostUnregister(host.data()).ok());
}

TEST_F(CudaGpuTest, ExhaustedMemoryAndBadOrdinalsAreClearErrors) {
  absl::StatusOr<void*> huge = rt_->Malloc(0, size_t{1} << 50, "huge");  // 1 PiB
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_THAT(huge.status().message(), HasSubstr("on cuda:0 for 'huge'"));
  absl::StatusOr<void*> nowhere = rt_->Malloc(rt_->device_count(), 64, "k");
  ASSERT_FALSE(nowhere.ok());
  EXPECT_EQ(nowhere.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(nowhere.status().message(), HasSubstr("there is no cuda:"));
}

TEST_F(CudaGpuTest, AnAllocationHasAnIpcHandleOfItsSize) {
  absl::StatusOr<void*> dev = rt_->Malloc(0, 1 << 20);
  ASSERT_TRUE(dev.ok()) << dev.status();
  absl::StatusOr<std::string> handle = rt_->IpcHandle(0, *dev);
  ASSERT_TRUE(handle.ok()) << handle.status();
  EXPECT_EQ(handle->size(), 64u);
  EXPECT_EQ(rt_->IpcOpen(0, "short").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(rt_->Free(0, *dev).ok());
}

TEST_F(CudaGpuTest, TensorsFromTheDeviceAllocatorAreOnTheirDevice) {
  absl::StatusOr<std::unique_ptr<CudaAllocator>> alloc = CudaAllocator::Create(rt_, 0);
  ASSERT_TRUE(alloc.ok()) << alloc.status();
  EXPECT_EQ(CudaAllocator::Create(rt_, rt_->device_count()).status().code(),
            absl::StatusCode::kInvalidArgument);
  {
    absl::StatusOr<Tensor> t =
        Tensor::Allocate(alloc->get(), DataType::kFloat32, TensorShape::Of({1 << 20}));
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->placement(), MemoryPlacement::CudaDevice(0));
    EXPECT_EQ((*alloc)->bytes_in_use(), size_t{4} << 20);
    std::vector<float> host(1 << 20, 1.5f), back(1 << 20, 0.0f);
    ASSERT_TRUE(
        rt_->Memcpy(0, t->data(), host.data(), t->TotalBytes(), CopyKind::kHostToDevice).ok());
    ASSERT_TRUE(
        rt_->Memcpy(0, back.data(), t->data(), t->TotalBytes(), CopyKind::kDeviceToHost).ok());
    EXPECT_EQ(host, back);
    // The CPU does not copy device memory.
    EXPECT_EQ(t->Clone(CpuAllocator()).status().code(), absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_EQ((*alloc)->bytes_in_use(), 0u);
  absl::StatusOr<Tensor> huge =
      Tensor::Allocate(alloc->get(), DataType::kUInt8, TensorShape::Of({int64_t{1} << 50}));
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT((*alloc)->last_error().message(), HasSubstr("cudaMalloc"));
}

TEST_F(CudaGpuTest, APinnedPoolPinsEveryRegionAndCopiesFromIt) {
  PoolAllocator pool("pinned test", PoolAllocator::Options{.region_bytes = size_t{8} << 20});
  EXPECT_EQ(pool.Placement(), MemoryPlacement::Host());
  PinPoolRegions(&pool, rt_);
  EXPECT_EQ(pool.Placement(), MemoryPlacement::PinnedHost());
  absl::StatusOr<void*> dev = rt_->Malloc(0, size_t{1} << 20);
  ASSERT_TRUE(dev.ok()) << dev.status();
  {
    Tensor t = *Tensor::Allocate(&pool, DataType::kUInt8, TensorShape::Of({1 << 20}));
    EXPECT_EQ(t.placement(), MemoryPlacement::PinnedHost());
    std::memset(t.data(), 9, t.TotalBytes());
    ASSERT_TRUE(rt_->Memcpy(0, *dev, t.data(), t.TotalBytes(), CopyKind::kHostToDevice).ok());
    // Registering a region twice is refused: it was registered once, when the pool made it.
    EXPECT_FALSE(rt_->HostRegister(t.data(), t.TotalBytes()).ok());
  }
  EXPECT_EQ(pool.ReleaseFreeRegions(), 1u);
  EXPECT_TRUE(rt_->Free(0, *dev).ok());
}

}  // namespace
}  // namespace tensorverbs::device
