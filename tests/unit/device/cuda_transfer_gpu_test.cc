// GPU tensors between two tasks on a real GPU (label `gpu`): the CUDA copier on its own, then
// the proxy path end to end over each protocol (device-to-host staging on the sender, a host
// proxy and host-to-device on the receiver), and the direct path of grpc+verbs over the
// same-host fabric, checked byte for byte and by the copy counters.
// Skipped, with the reason, where the CUDA runtime finds no GPU; the same bookkeeping runs
// everywhere against a stand-in GPU (protocol_conformance_test's Device* tests).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/common/mutex.h"
#include "src/device/cuda_allocator.h"
#include "src/device/cuda_copier.h"
#include "src/device/cuda_runtime.h"
#include "tests/support/fixtures.h"
#include "tests/support/inprocess_cluster.h"
#include "tests/support/pending_recv.h"

namespace tensorverbs::device {
namespace {

using ::testing::HasSubstr;

absl::StatusOr<CudaRuntime*> Gpu() { return CudaRuntime::Get(); }

// Waits for one copy's outcome and remembers the thread it came on.
struct CopyOutcome {
  Notification done;
  absl::Status status;
  std::thread::id thread;
  int calls = 0;
  DeviceCopier::DoneCallback Callback() {
    return [this](absl::Status s) {
      status = std::move(s);
      thread = std::this_thread::get_id();
      ++calls;
      done.Notify();
    };
  }
};

class CudaCopierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<CudaRuntime*> rt = Gpu();
    if (!rt.ok()) GTEST_SKIP() << "no GPU: " << rt.status();
    rt_ = *rt;
  }
  CudaRuntime* rt_ = nullptr;
};

TEST_F(CudaCopierTest, CopiesEveryWayAndCompletesOffTheCallersThread) {
  CudaCopier copier(rt_);
  EXPECT_TRUE(copier.Handles(MemoryPlacement::CudaDevice(0)));
  EXPECT_FALSE(copier.Handles(MemoryPlacement::CudaDevice(rt_->device_count())));
  EXPECT_FALSE(copier.Handles(MemoryPlacement::PinnedHost()));
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{4099}, size_t{64} << 20}) {
    std::vector<uint8_t> src(bytes), back(bytes, 0);
    for (size_t i = 0; i < bytes; ++i) src[i] = static_cast<uint8_t>(i * 7 + bytes);
    void* a = bytes > 0 ? *rt_->Malloc(0, bytes) : nullptr;
    void* b = bytes > 0 ? *rt_->Malloc(0, bytes) : nullptr;
    CopyOutcome up, across, down;
    copier.CopyAsync(0, a, src.data(), bytes, CopyDirection::kHostToDevice, "up", up.Callback());
    ASSERT_TRUE(up.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
    copier.CopyAsync(0, b, a, bytes, CopyDirection::kDeviceToDevice, "across", across.Callback());
    ASSERT_TRUE(across.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
    copier.CopyAsync(0, back.data(), b, bytes, CopyDirection::kDeviceToHost, "down",
                     down.Callback());
    ASSERT_TRUE(down.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
    for (CopyOutcome* o : {&up, &across, &down}) {
      EXPECT_TRUE(o->status.ok()) << bytes << ": " << o->status;
      EXPECT_EQ(o->calls, 1);
      EXPECT_NE(o->thread, std::this_thread::get_id()) << "never inline";
    }
    EXPECT_EQ(src, back) << bytes << " bytes";
    if (bytes > 0) {
      EXPECT_TRUE(rt_->Free(0, a).ok());
      EXPECT_TRUE(rt_->Free(0, b).ok());
    }
  }
}

TEST_F(CudaCopierTest, AFailedCopyIsAStatusNamingDeviceCallAndKey) {
  CudaCopier copier(rt_);
  std::vector<uint8_t> host(4096);
  CopyOutcome bad;
  // Not device memory: the runtime refuses the copy.
  copier.CopyAsync(0, reinterpret_cast<void*>(uintptr_t{0x10}), host.data(), host.size(),
                   CopyDirection::kHostToDevice, "the_key", bad.Callback());
  ASSERT_TRUE(bad.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_FALSE(bad.status.ok());
  EXPECT_THAT(std::string(bad.status.message()),
              ::testing::AllOf(HasSubstr("cuda:0"), HasSubstr("the_key"), HasSubstr("cudaMemcpy")));
  EXPECT_EQ(bad.calls, 1);
  // A bad ordinal.
  CopyOutcome no_device;
  copier.CopyAsync(rt_->device_count(), host.data(), host.data(), host.size(),
                   CopyDirection::kDeviceToHost, "k2", no_device.Callback());
  ASSERT_TRUE(no_device.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(no_device.status.code(), absl::StatusCode::kInvalidArgument) << no_device.status;
}

TEST_F(CudaCopierTest, TheDestructorFinishesCopiesInFlight) {
  const size_t bytes = size_t{256} << 20;
  void* a = *rt_->Malloc(0, bytes);
  void* b = *rt_->Malloc(0, bytes);
  int calls = 0;
  {
    CudaCopier copier(rt_);
    for (int i = 0; i < 8; ++i) {
      copier.CopyAsync(0, b, a, bytes, CopyDirection::kDeviceToDevice, "inflight",
                       [&calls](absl::Status s) {
                         EXPECT_TRUE(s.ok()) << s;
                         ++calls;  // the completion thread only
                       });
    }
  }
  EXPECT_EQ(calls, 8);
  EXPECT_TRUE(rt_->Free(0, a).ok());
  EXPECT_TRUE(rt_->Free(0, b).ok());
}

TEST_F(CudaCopierTest, AGpuPoolCarvesCudaMallocedRegionsAndReusesThem) {
  PoolAllocator::Options o;
  o.region_bytes = size_t{16} << 20;
  absl::StatusOr<std::unique_ptr<PoolAllocator>> pool = NewCudaPool(rt_, 0, o);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ((*pool)->Placement(), MemoryPlacement::CudaDevice(0));
  EXPECT_EQ(NewCudaPool(rt_, rt_->device_count(), o).status().code(),
            absl::StatusCode::kInvalidArgument);
  int regions = 0;
  (*pool)->AddRegionVisitor([&](const MemoryRegion&) { ++regions; }, nullptr);
  std::vector<float> host(1 << 20), back(1 << 20);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i) * 0.5f;
  for (int round = 0; round < 20; ++round) {
    Tensor t = *Tensor::Allocate(pool->get(), DataType::kFloat32, TensorShape::Of({1 << 20}));
    EXPECT_EQ(t.placement(), MemoryPlacement::CudaDevice(0));
    ASSERT_TRUE(
        rt_->Memcpy(0, t.data(), host.data(), t.TotalBytes(), CopyKind::kHostToDevice).ok());
    ASSERT_TRUE(
        rt_->Memcpy(0, back.data(), t.data(), t.TotalBytes(), CopyKind::kDeviceToHost).ok());
    EXPECT_EQ(host, back);
  }
  EXPECT_EQ(regions, 1) << "one cudaMalloc for 20 tensors";
  // A tensor larger than a region gets one of its own.
  Tensor big = *Tensor::Allocate(pool->get(), DataType::kUInt8, TensorShape::Of({64 << 20}));
  EXPECT_EQ(regions, 2);
}

struct Route {
  const char* name;
  const char* protocol;
  const char* fabric;
  const char* provider;
  bool big;     // also 256 MiB and 1 GiB
  bool direct;  // TENSORVERBS_GPU_DIRECT on: the fabric writes GPU memory where it can
};

std::string RouteName(const ::testing::TestParamInfo<Route>& info) { return info.param.name; }

class ProxyPathGpuTest : public ::testing::TestWithParam<Route> {
 protected:
  void SetUp() override {
    absl::StatusOr<CudaRuntime*> rt = Gpu();
    if (!rt.ok()) GTEST_SKIP() << "no GPU: " << rt.status();
    rt_ = *rt;
    testing::ClusterOptions o;
    o.protocol = GetParam().protocol;
    o.fabric = GetParam().fabric;
    o.provider = GetParam().provider;
    if (!GetParam().direct) o.tune = [](ServerOptions& v) { v.verbs.gpu_direct = false; };
    absl::Status s = cluster_.Start(2, o);
    ASSERT_TRUE(s.ok()) << s;
    // Each task's tensors on the GPU come from its own GPU pool, as a program's would.
    for (int t : {0, 1}) {
      absl::StatusOr<PoolAllocator*> pool = cluster_.server(t).DeviceAllocator(0);
      ASSERT_TRUE(pool.ok()) << pool.status();
      gpu_[t] = *pool;
    }
  }
  void TearDown() override { cluster_.Stop(); }

  // A device tensor with `host`'s bytes.
  Tensor OnGpu(const Tensor& host) {
    Tensor t = *Tensor::Allocate(gpu_[1], host.dtype(), host.shape());
    if (host.TotalBytes() > 0) {
      EXPECT_TRUE(
          rt_->Memcpy(0, t.data(), host.data(), host.TotalBytes(), CopyKind::kHostToDevice).ok());
    }
    return t;
  }
  // Whether a device tensor holds `host`'s bytes.
  bool SameOnGpu(const Tensor& device, const Tensor& host) {
    if (device.dtype() != host.dtype() || device.shape() != host.shape()) return false;
    if (host.TotalBytes() == 0) return true;
    std::vector<char> back(host.TotalBytes());
    if (!rt_->Memcpy(0, back.data(), device.data(), back.size(), CopyKind::kDeviceToHost).ok()) {
      return false;
    }
    return std::memcmp(back.data(), host.data(), back.size()) == 0;
  }
  ParsedKey Key(const std::string& name) { return cluster_.Key(1, name); }

  // Host tensor `sent` (with `host`'s bytes) from task 1 into task 0's GPU pool (step 1), then
  // a GPU copy of `host` from task 1 into task 0's host memory (step 2), both checked.
  void IntoTheGpuAndOut(const Tensor& sent, const Tensor& host) {
    RecvArgs to_gpu;
    to_gpu.allocator = gpu_[0];
    ASSERT_TRUE(cluster_.Step(1, 1)->Send(Key("h2d"), sent).ok());
    PendingRecv into_gpu(*cluster_.Step(0, 1), Key("h2d"), to_gpu);
    ASSERT_TRUE(into_gpu.Wait());
    ASSERT_TRUE(into_gpu.status().ok()) << into_gpu.status();
    EXPECT_TRUE(SameOnGpu(into_gpu.tensor(), host));
    ASSERT_TRUE(cluster_.Step(1, 2)->Send(Key("d2h"), OnGpu(host)).ok());
    PendingRecv into_host(*cluster_.Step(0, 2), Key("d2h"));
    ASSERT_TRUE(into_host.Wait());
    ASSERT_TRUE(into_host.status().ok()) << into_host.status();
    EXPECT_TRUE(into_host.tensor().placement().host_accessible());
    EXPECT_TRUE(into_host.tensor().ContentEquals(host));
  }

  // Every dtype but strings, empty to 4 MiB (and 256 MiB and 1 GiB on big routes), from task
  // 1's GPU pool into task 0's, each checked byte for byte. Returns the non-empty transfers.
  int64_t RoundTripEveryCase() {
    RecvArgs to_gpu;
    to_gpu.allocator = gpu_[0];
    int64_t step = 1, transfers = 0;
    uint32_t seed = 11;
    std::vector<std::pair<DataType, std::vector<int64_t>>> cases;
    for (DataType dtype : AllDataTypes()) {
      if (dtype == DataType::kString) continue;
      for (std::vector<int64_t> dims : {std::vector<int64_t>{0}, {1}, {3, 5}, {1 << 20}}) {
        cases.emplace_back(dtype, dims);
      }
    }
    if (GetParam().big) {
      cases.push_back({DataType::kUInt8, {int64_t{256} << 20}});
      cases.push_back({DataType::kUInt8, {int64_t{1} << 30}});
    }
    for (const auto& [dtype, dims] : cases) {
      Tensor host = *Tensor::Allocate(CpuAllocator(), dtype, *TensorShape::Create(dims));
      testing::FillPattern(host, seed++);
      const std::string name = absl::StrCat(DataTypeName(dtype), "_", host.NumElements());
      {
        Tensor sent = OnGpu(host);
        EXPECT_TRUE(cluster_.Step(1, step)->Send(Key(name), sent).ok()) << name;
      }  // the rendezvous holds the only reference now
      PendingRecv recv(*cluster_.Step(0, step), Key(name), to_gpu);
      EXPECT_TRUE(recv.Wait(absl::Seconds(120))) << name;
      EXPECT_TRUE(recv.status().ok()) << name << ": " << recv.status();
      if (!recv.status().ok()) return transfers;
      EXPECT_TRUE(SameOnGpu(recv.tensor(), host)) << name;
      if (host.TotalBytes() > 0) {
        EXPECT_EQ(recv.tensor().placement(), MemoryPlacement::CudaDevice(0)) << name;
        ++transfers;
      }
      EXPECT_EQ(recv.calls(), 1);
      cluster_.server(0).rendezvous_mgr()->Cleanup(step);
      cluster_.server(1).rendezvous_mgr()->Cleanup(step);
      ++step;
    }
    return transfers;
  }

  CudaRuntime* rt_ = nullptr;
  Allocator* gpu_[2] = {nullptr, nullptr};  // the tasks' GPU pools
  testing::InProcessCluster cluster_;
};

TEST_P(ProxyPathGpuTest, EveryDtypeAndSizeRoundTripsExactlyWithOneCopyEachWay) {
  const int64_t transfers = RoundTripEveryCase();
  EXPECT_EQ(cluster_.server(1).stats().device_to_host.load(), transfers);
  EXPECT_EQ(cluster_.server(0).stats().host_to_device.load(), transfers);
  EXPECT_EQ(cluster_.server(0).stats().device_copy_errors.load(), 0);
  EXPECT_EQ(cluster_.server(1).stats().device_copy_errors.load(), 0);
  // The pools the proxies and staging buffers come from are page-locked for the copies.
  EXPECT_EQ(cluster_.server(0).recv_allocator()->Placement(), MemoryPlacement::PinnedHost());
}

TEST_P(ProxyPathGpuTest, HostToDeviceAndDeviceToHostTakeOneCopyEach) {
  Tensor host = *Tensor::Allocate(CpuAllocator(), DataType::kFloat32, TensorShape::Of({4096}));
  testing::FillPattern(host, 3);
  ASSERT_NO_FATAL_FAILURE(IntoTheGpuAndOut(host, host));
  EXPECT_EQ(cluster_.server(1).stats().device_to_host.load(), 1);
  EXPECT_EQ(cluster_.server(0).stats().host_to_device.load(), 1);
}

INSTANTIATE_TEST_SUITE_P(
    Routes, ProxyPathGpuTest,
    ::testing::Values(Route{"GrpcVerbs_Shmem", "grpc+verbs", "shmem", "", true, false},
                      Route{"GrpcVerbs_OfiTcp", "grpc+verbs", "ofi", "tcp", false, true},
                      Route{"GrpcGdr_Shmem", "grpc+gdr", "shmem", "", false, true},
                      Route{"Grpc", "grpc", "", "", false, true}),
    RouteName);

// grpc+verbs over the same-host fabric with GPU direct on: tensors in the tasks' GPU pools are
// written from and into GPU memory by device copies (CUDA IPC between processes; here both
// tasks share one, and the copy is the same), with no copy through host memory.
class DirectPathGpuTest : public ProxyPathGpuTest {
 protected:
  // A host tensor first: the channel is set up, and the receiver knows the sender's end writes
  // GPU memory.
  void WarmUp() {
    // From the sender's pool, so that it needs no staging copy.
    Tensor host = *Tensor::Allocate(cluster_.server(1).recv_allocator(), DataType::kInt32,
                                    TensorShape::Of({8}));
    ASSERT_TRUE(cluster_.Step(1, 9999)->Send(Key("warm"), host).ok());
    PendingRecv warm(*cluster_.Step(0, 9999), Key("warm"));
    ASSERT_TRUE(warm.Wait());
    ASSERT_TRUE(warm.status().ok()) << warm.status();
  }
};

TEST_P(DirectPathGpuTest, EveryDtypeAndSizeRoundTripsExactlyWithNoCopyThroughTheHost) {
  ASSERT_NO_FATAL_FAILURE(WarmUp());
  ASSERT_TRUE(cluster_.transport(0).device_direct());
  const int64_t transfers = RoundTripEveryCase();
  const TransferStats& sender = cluster_.server(1).stats();
  const TransferStats& receiver = cluster_.server(0).stats();
  EXPECT_EQ(sender.device_direct_sends.load(), transfers);
  EXPECT_GE(receiver.device_direct_recvs.load(), transfers);
  EXPECT_EQ(sender.device_to_host.load() + receiver.host_to_device.load(), 0);
  EXPECT_EQ(sender.copies.load() + receiver.copies.load(), 0);
  EXPECT_EQ(receiver.device_copy_errors.load(), 0);
}

TEST_P(DirectPathGpuTest, HostToDeviceAndDeviceToHostAreOneDeviceCopyByTheFabric) {
  ASSERT_NO_FATAL_FAILURE(WarmUp());
  Tensor host = *Tensor::Allocate(CpuAllocator(), DataType::kFloat32, TensorShape::Of({1 << 20}));
  testing::FillPattern(host, 3);
  Tensor in_pool = *Tensor::Allocate(cluster_.server(1).recv_allocator(), DataType::kFloat32,
                                     TensorShape::Of({1 << 20}));
  std::memcpy(in_pool.data(), host.data(), host.TotalBytes());
  ASSERT_NO_FATAL_FAILURE(IntoTheGpuAndOut(in_pool, host));
  EXPECT_EQ(cluster_.server(1).stats().device_to_host.load(), 0);
  EXPECT_EQ(cluster_.server(0).stats().host_to_device.load(), 0);
  EXPECT_EQ(cluster_.server(1).stats().device_direct_sends.load(), 1);
  EXPECT_EQ(cluster_.server(0).stats().device_direct_recvs.load(), 1);
}

INSTANTIATE_TEST_SUITE_P(Routes, DirectPathGpuTest,
                         ::testing::Values(Route{"GrpcVerbs_Shmem", "grpc+verbs", "shmem", "", true,
                                                 true}),
                         RouteName);

}  // namespace
}  // namespace tensorverbs::device
