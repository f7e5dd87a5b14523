// The CUDA copier's threading and bookkeeping without a GPU: CudaRuntime loads a fake libcudart
// (tests/support/fake_cudart.cc) whose streams run copies later on threads of their own, so
// every path of the copier runs here and under the sanitizers. A real GPU runs the same
// copier in cuda_transfer_gpu_test.
#include "src/device/cuda_copier.h"

#include <dlfcn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "src/common/mutex.h"

namespace tensorverbs::device {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

class CudaCopierFakeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // TV_FAKE_CUDART names the library where the build folder is not at hand (the GPU bundle).
    const char* carried = std::getenv("TV_FAKE_CUDART");
    absl::StatusOr<std::unique_ptr<CudaRuntime>> rt =
        CudaRuntime::Load({carried != nullptr ? carried : TV_FAKE_CUDART_PATH});
    ASSERT_TRUE(rt.ok()) << rt.status();
    rt_ = *std::move(rt);
  }
  std::unique_ptr<CudaRuntime> rt_;
};

TEST_F(CudaCopierFakeTest, EveryCopyCompletesOnceOffTheCallersThreadWithItsBytes) {
  CudaCopier copier(rt_.get());
  EXPECT_TRUE(copier.Handles(MemoryPlacement::CudaDevice(0)));
  EXPECT_FALSE(copier.Handles(MemoryPlacement::CudaDevice(1)));
  EXPECT_FALSE(copier.Handles(MemoryPlacement::Host()));
  constexpr int kThreads = 4, kPerThread = 300;
  std::vector<std::vector<uint8_t>> src(kThreads * kPerThread), dst(kThreads * kPerThread);
  std::vector<std::atomic<int>> calls(kThreads * kPerThread);
  std::atomic<int> inline_calls{0}, finished{0};
  Notification all_done;
  const CopyDirection directions[] = {CopyDirection::kHostToDevice, CopyDirection::kDeviceToHost,
                                      CopyDirection::kDeviceToDevice};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const int n = t * kPerThread + i;
        const size_t bytes = (n * 37) % 5000;  // 0 included
        src[n].assign(bytes, static_cast<uint8_t>(n));
        dst[n].assign(bytes, 0);
        const std::thread::id caller = std::this_thread::get_id();
        copier.CopyAsync(0, dst[n].data(), src[n].data(), bytes, directions[n % 3], "k",
                         [&, n, caller](absl::Status s) {
                           EXPECT_TRUE(s.ok()) << s;
                           if (std::this_thread::get_id() == caller) ++inline_calls;
                           ++calls[n];
                           if (++finished == kThreads * kPerThread) all_done.Notify();
                         });
      }
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_TRUE(all_done.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_EQ(inline_calls.load(), 0);
  for (int n = 0; n < kThreads * kPerThread; ++n) {
    EXPECT_EQ(calls[n].load(), 1) << n;
    EXPECT_EQ(src[n], dst[n]) << n;
  }
  EXPECT_EQ(copier.copies_completed(), kThreads * kPerThread);
}

TEST_F(CudaCopierFakeTest, ARefusedCopyFailsOnceNamingDeviceCallAndKey) {
  CudaCopier copier(rt_.get());
  std::vector<uint8_t> host(64);
  Notification done;
  absl::Status status;
  copier.CopyAsync(0, reinterpret_cast<void*>(uintptr_t{16}), host.data(), host.size(),
                   CopyDirection::kHostToDevice, "w/grad", [&](absl::Status s) {
                     status = std::move(s);
                     done.Notify();
                   });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << status;
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("cudaMemcpyAsync(64 bytes, host-to-device)"), HasSubstr("cuda:0"),
                    HasSubstr("'w/grad'"), HasSubstr("cudaErrorInvalidValue")));
  // A device this runtime does not have.
  Notification done2;
  copier.CopyAsync(3, host.data(), host.data(), host.size(), CopyDirection::kDeviceToHost, "x",
                   [&](absl::Status s) {
                     status = std::move(s);
                     done2.Notify();
                   });
  ASSERT_TRUE(done2.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  // The copier still works.
  std::vector<uint8_t> a(100, 7), b(100, 0);
  Notification done3;
  copier.CopyAsync(0, b.data(), a.data(), a.size(), CopyDirection::kDeviceToDevice, "y",
                   [&](absl::Status s) {
                     status = std::move(s);
                     done3.Notify();
                   });
  ASSERT_TRUE(done3.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(a, b);
}

TEST_F(CudaCopierFakeTest, TheDestructorRunsEveryQueuedAndInFlightCopysCallback) {
  std::vector<uint8_t> a(size_t{4} << 20, 1), b(size_t{4} << 20, 0);
  std::atomic<int> calls{0};
  {
    CudaCopier copier(rt_.get());
    for (int i = 0; i < 50; ++i) {
      copier.CopyAsync(0, b.data(), a.data(), a.size(), CopyDirection::kDeviceToDevice, "d",
                       [&calls](absl::Status s) {
                         EXPECT_TRUE(s.ok()) << s;
                         ++calls;
                       });
    }
  }
  EXPECT_EQ(calls.load(), 50);
  EXPECT_EQ(a, b);
}

}  // namespace
}  // namespace tensorverbs::device

namespace tensorverbs::device {
namespace {

TEST_F(CudaCopierFakeTest, WaitingForTheDefaultStreamAsksTheRuntimeOnThatDevice) {
  const char* carried = std::getenv("TV_FAKE_CUDART");
  void* lib = dlopen(carried != nullptr ? carried : TV_FAKE_CUDART_PATH, RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(lib, nullptr) << dlerror();
  auto syncs = reinterpret_cast<long (*)()>(dlsym(lib, "tv_fake_cudart_default_stream_syncs"));
  ASSERT_NE(syncs, nullptr);
  const long before = syncs();
  EXPECT_TRUE(rt_->SynchronizeDefaultStream(0, "k").ok());
  EXPECT_EQ(syncs(), before + 1);
  absl::Status bad = rt_->SynchronizeDefaultStream(3, "k");
  EXPECT_FALSE(bad.ok());
  EXPECT_THAT(bad.message(), HasSubstr("cudaStreamSynchronize")) << bad;
  EXPECT_EQ(syncs(), before + 1);
  dlclose(lib);
}

}  // namespace
}  // namespace tensorverbs::device
