// CudaCopier: the DeviceCopier of a process with GPUs. CopyAsync only queues the copy: the
// copier's own thread makes every runtime call. It issues each copy as a cudaMemcpyAsync on a
// non-blocking stream of its device and direction (one per pair, made on first use, so that
// device-to-host and host-to-device copies run at once on the two copy engines), records a
// pooled event after it, and asks the runtime which events have completed, running their
// `done`. So neither a progress loop nor a gRPC thread ever waits for a copy or for the
// runtime's locks, and `done` may call the runtime.
//
// While copies are pending the thread asks again at once for kSpin after each new copy or
// completion (small copies finish in microseconds); then it sleeps until a host function
// launched behind each copy wakes it, or kBackstopPoll passes (should a host function not run on
// a failed device, the copy's event still reports the error).
//
// Who calls it: the Server makes one when a GPU is present and hands it to its rendezvous
// (WorkerEnv::device_copier). Thread-safe. The destructor finishes every copy queued or in
// flight and runs its `done`. Host memory on either side should be page-locked (the pinned
// pool): from pageable memory the runtime copies synchronously.
#ifndef TENSORVERBS_DEVICE_CUDA_COPIER_H_
#define TENSORVERBS_DEVICE_CUDA_COPIER_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/device/cuda_runtime.h"
#include "src/tensor/device_copier.h"

namespace tensorverbs::device {

class CudaCopier final : public DeviceCopier {
 public:
  static constexpr absl::Duration kBackstopPoll = absl::Milliseconds(2);
  static constexpr absl::Duration kSpin = absl::Microseconds(50);

  // A copier over `runtime` (which outlives it) for every device the runtime has.
  explicit CudaCopier(const CudaRuntime* runtime);
  ~CudaCopier() override;
  CudaCopier(const CudaCopier&) = delete;
  CudaCopier& operator=(const CudaCopier&) = delete;

  std::string Name() const override;
  bool Handles(const MemoryPlacement& placement) const override;
  void CopyAsync(int device, void* dst, const void* src, size_t bytes, CopyDirection direction,
                 absl::string_view key, DoneCallback done) override;

  // Copies completed so far, failed ones included (tests, stats).
  int64_t copies_completed() const { return completed_.load(std::memory_order_relaxed); }

 private:
  struct Copy {
    int device = 0;
    void* dst = nullptr;
    const void* src = nullptr;
    size_t bytes = 0;
    CopyDirection direction = CopyDirection::kDeviceToDevice;
    void* event = nullptr;  // once issued; null: `status` is already the outcome
    absl::Status status;
    std::string key;
    DoneCallback done;
  };

  static void WakeFromRuntime(void* self);
  // On the copier's thread: issues `copy` (or sets its status), never blocking.
  void Issue(Copy& copy);
  absl::StatusOr<void*> Stream(int device, CopyDirection direction);
  absl::StatusOr<void*> TakeEvent(int device);
  void Loop();

  const CudaRuntime* const runtime_;
  std::atomic<int64_t> completed_{0};

  // The copier thread's alone.
  std::map<std::pair<int, int>, void*> streams_;
  std::map<int, std::vector<void*>> free_events_;
  std::vector<std::unique_ptr<Copy>> in_flight_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Copy>> queued_;  // guarded by mu_
  int host_funcs_ = 0;                         // host functions not yet run; guarded by mu_
  bool woken_ = false;                         // guarded by mu_
  bool stopping_ = false;                      // guarded by mu_
  std::thread thread_;
};

}  // namespace tensorverbs::device

#endif  // TENSORVERBS_DEVICE_CUDA_COPIER_H_
