// A GPU stand-in for machines without one: StandInDeviceAllocator hands out host memory that
// says it is cuda:N (so every layer treats it as memory the CPU must not touch), and
// StandInDeviceCopier copies it with memcpy on a thread of its own, as a DeviceCopier must (never
// inline), counting copies per direction and failing the ones a test asks it to. Together they
// exercise the proxy path's bookkeeping (staging, proxies, copy counts, errors, callbacks) in
// every protocol without CUDA. A test may also hold the copies of one direction and let them run
// one by one (Hold, ReleaseHeld), to see what a transfer does while its copies wait.
//
// Thread-safe. The copier's destructor finishes every copy it was given, held ones too.
#ifndef TENSORVERBS_TESTS_SUPPORT_STAND_IN_DEVICE_H_
#define TENSORVERBS_TESTS_SUPPORT_STAND_IN_DEVICE_H_

#include <atomic>
#include <cstring>
#include <deque>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "src/common/executor.h"
#include "src/common/mutex.h"
#include "src/tensor/allocator.h"
#include "src/tensor/device_copier.h"

namespace tensorverbs::testing {

class StandInDeviceAllocator final : public Allocator {
 public:
  explicit StandInDeviceAllocator(int device = 0) : device_(device) {}
  std::string Name() const override { return absl::StrCat("stand-in cuda:", device_); }
  void* AllocateRaw(size_t bytes) override {
    if (fail_.load()) return nullptr;
    return CpuAllocator()->AllocateRaw(bytes);
  }
  void DeallocateRaw(void* p, size_t bytes) override { CpuAllocator()->DeallocateRaw(p, bytes); }
  MemoryPlacement Placement() const override { return MemoryPlacement::CudaDevice(device_); }
  // Every allocation from now on fails (the device is out of memory).
  void set_exhausted(bool exhausted) { fail_.store(exhausted); }

 private:
  const int device_;
  std::atomic<bool> fail_{false};
};

class StandInDeviceCopier final : public DeviceCopier {
 public:
  // Copies for devices 0 .. devices-1.
  explicit StandInDeviceCopier(int devices = 1) : devices_(devices) {}
  ~StandInDeviceCopier() override { ReleaseHeld(-1); }
  StandInDeviceCopier(const StandInDeviceCopier&) = delete;
  StandInDeviceCopier& operator=(const StandInDeviceCopier&) = delete;

  std::string Name() const override { return "stand-in copier"; }
  bool Handles(const MemoryPlacement& p) const override {
    return p.kind == MemoryPlacement::Kind::kCudaDevice && p.device >= 0 && p.device < devices_;
  }
  void CopyAsync(int device, void* dst, const void* src, size_t bytes, CopyDirection direction,
                 absl::string_view key, DoneCallback done) override {
    absl::Status outcome;
    {
      MutexLock lock(&mu_);
      if (!failures_.empty() && failures_.front().first == direction) {
        outcome = absl::Status(failures_.front().second.code(),
                               absl::StrCat(failures_.front().second.message(), " on cuda:", device,
                                            " for '", key, "'"));
        failures_.pop_front();
      }
    }
    Executor::Task copy = [this, dst, src, bytes, direction, outcome,
                           done = std::move(done)]() mutable {
      if (outcome.ok()) {
        if (bytes > 0) std::memcpy(dst, src, bytes);
        (direction == CopyDirection::kDeviceToHost   ? d2h_
         : direction == CopyDirection::kHostToDevice ? h2d_
                                                     : d2d_)
            .fetch_add(1);
      }
      std::move(done)(outcome);
    };
    {
      MutexLock lock(&mu_);
      if (holding_ && *holding_ == direction) {
        held_.push_back(std::move(copy));
        return;
      }
    }
    thread_.Schedule(std::move(copy));
  }

  // Copies in `direction` wait from now on, in order, until ReleaseHeld lets them run.
  void Hold(CopyDirection direction) {
    MutexLock lock(&mu_);
    holding_ = direction;
  }
  // Lets the first `n` held copies run; with n < 0 all of them, and holds no more.
  void ReleaseHeld(int n) {
    std::deque<Executor::Task> run;
    {
      MutexLock lock(&mu_);
      if (n < 0) holding_.reset();
      while (!held_.empty() && (n < 0 || static_cast<int>(run.size()) < n)) {
        run.push_back(std::move(held_.front()));
        held_.pop_front();
      }
    }
    for (Executor::Task& copy : run) thread_.Schedule(std::move(copy));
  }
  size_t held() const {
    MutexLock lock(&mu_);
    return held_.size();
  }

  // The next copy in `direction` fails with `status` (its message gains device and key).
  void FailNext(CopyDirection direction, absl::Status status) {
    MutexLock lock(&mu_);
    failures_.emplace_back(direction, std::move(status));
  }
  int64_t device_to_host() const { return d2h_.load(); }
  int64_t host_to_device() const { return h2d_.load(); }
  int64_t device_to_device() const { return d2d_.load(); }

 private:
  const int devices_;
  std::atomic<int64_t> d2h_{0}, h2d_{0}, d2d_{0};
  mutable Mutex mu_;
  std::deque<std::pair<CopyDirection, absl::Status>> failures_ ABSL_GUARDED_BY(mu_);
  std::optional<CopyDirection> holding_ ABSL_GUARDED_BY(mu_);
  std::deque<Executor::Task> held_ ABSL_GUARDED_BY(mu_);
  Executor thread_{"stand-in-gpu", 1};  // last: drained before the counters go
};

}  // namespace tensorverbs::testing

#endif  // TENSORVERBS_TESTS_SUPPORT_STAND_IN_DEVICE_H_
