// A stand-in for a GPU runtime as the fabric sees it (fabric::DeviceMemory), for machines without
// one: "device memory" is host memory that only the stand-in's copies touch, exported handles
// name an address in this process (so only this process imports them: tests run both tasks in
// one process, and the fabric's exchange of handles runs in full), and copies run on a thread of
// their own, completing later as a GPU's do. Counts what the fabric asked for and
// fails what a test asks it to.
//
// NewStandInDevicePool makes a PoolAllocator of such memory (placement cuda:N), as
// device::NewCudaPool makes one of a GPU's.
//
// Thread-safe. The destructor finishes every copy started.
#ifndef TENSORVERBS_TESTS_SUPPORT_STAND_IN_DEVICE_MEMORY_H_
#define TENSORVERBS_TESTS_SUPPORT_STAND_IN_DEVICE_MEMORY_H_

#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/common/executor.h"
#include "src/common/mutex.h"
#include "src/fabric/device_memory.h"
#include "src/tensor/allocator.h"

namespace tensorverbs::testing {

class StandInDeviceMemory final : public fabric::DeviceMemory {
 public:
  std::string Name() const override { return "stand-in device memory"; }

  absl::StatusOr<std::string> Export(int device, void* base) override {
    if (fail_exports_.load()) return absl::InternalError("stand-in export failure");
    exports_.fetch_add(1);
    const Handle h{static_cast<uint32_t>(getpid()), static_cast<uint32_t>(device),
                   reinterpret_cast<uint64_t>(base)};
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
  }
  absl::StatusOr<void*> Import(int device, absl::string_view handle) override {
    Handle h;
    if (handle.size() != sizeof(h)) return absl::InvalidArgumentError("not a stand-in handle");
    std::memcpy(&h, handle.data(), sizeof(h));
    if (h.pid != static_cast<uint32_t>(getpid())) {
      return absl::UnavailableError("stand-in device memory is reachable in its own process only");
    }
    imports_.fetch_add(1);
    return reinterpret_cast<void*>(h.base);
  }
  void Close(int, void*) override { closes_.fetch_add(1); }
  absl::Status RegisterHost(void*, size_t) override {
    host_registrations_.fetch_add(1);
    return absl::OkStatus();
  }
  void UnregisterHost(void*) override { host_unregistrations_.fetch_add(1); }

  absl::StatusOr<uint64_t> StartCopy(int device, Side dst, Side src, size_t bytes) override {
    auto copy = std::make_shared<Copy>();
    uint64_t ticket;
    {
      MutexLock lock(&mu_);
      if (!failures_.empty()) {
        copy->error = absl::Status(failures_.front().code(),
                                   absl::StrCat(failures_.front().message(), " on cuda:", device));
        failures_.pop_front();
      }
      ticket = next_ticket_++;
      copies_[ticket] = copy;
    }
    (src.on_device ? (dst.on_device ? d2d_ : d2h_) : h2d_).fetch_add(1);
    thread_.Schedule([this, copy, dst, src, bytes] {
      while (held_.load(std::memory_order_acquire)) absl::SleepFor(absl::Microseconds(100));
      if (copy->error.ok() && bytes > 0) DmaCopy(dst.addr, src.addr, bytes);
      copy->done.store(true, std::memory_order_release);
    });
    return ticket;
  }
  absl::StatusOr<bool> CopyDone(uint64_t ticket) override {
    MutexLock lock(&mu_);
    auto it = copies_.find(ticket);
    if (it == copies_.end()) return absl::InvalidArgumentError("no such ticket");
    if (!it->second->done.load(std::memory_order_acquire)) return false;
    absl::Status error = it->second->error;
    copies_.erase(it);
    if (!error.ok()) return error;
    return true;
  }

  // The next copy fails with `status` (its message gains the device).
  void FailNextCopy(absl::Status status) {
    MutexLock lock(&mu_);
    failures_.push_back(std::move(status));
  }
  void set_fail_exports(bool fail) { fail_exports_.store(fail); }
  // While held, copies do not finish (as a slow GPU's): set before the copies to hold start.
  void set_held(bool held) { held_.store(held, std::memory_order_release); }

  int64_t host_to_device() const { return h2d_.load(); }
  int64_t device_to_host() const { return d2h_.load(); }
  int64_t device_to_device() const { return d2d_.load(); }
  int64_t exports() const { return exports_.load(); }
  int64_t imports() const { return imports_.load(); }
  int64_t closes() const { return closes_.load(); }
  int64_t host_registrations() const { return host_registrations_.load(); }
  int64_t host_unregistrations() const { return host_unregistrations_.load(); }

 private:
  // Copies as a DMA engine does, with no CPU thread touching the bytes: the kernel copies within
  // this process. The fabric orders a copy before the peer reads its bytes through an immediate
  // in shared memory mapped at two addresses, which ThreadSanitizer cannot follow; a memcpy on
  // this thread would be reported against the receiver's read, a copy by the kernel is not.
  static void DmaCopy(void* dst, const void* src, size_t bytes) {
    size_t done = 0;
    while (done < bytes) {
      iovec from{const_cast<char*>(static_cast<const char*>(src)) + done, bytes - done};
      iovec to{static_cast<char*>(dst) + done, bytes - done};
      const ssize_t n = process_vm_writev(getpid(), &from, 1, &to, 1, 0);
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    if (done < bytes) {
      std::memcpy(static_cast<char*>(dst) + done, static_cast<const char*>(src) + done,
                  bytes - done);
    }
  }

  struct Handle {
    uint32_t pid;
    uint32_t device;
    uint64_t base;
  };
  struct Copy {
    std::atomic<bool> done{false};
    absl::Status error;
  };

  Mutex mu_;
  std::map<uint64_t, std::shared_ptr<Copy>> copies_ ABSL_GUARDED_BY(mu_);
  std::deque<absl::Status> failures_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  std::atomic<bool> held_{false};
  std::atomic<bool> fail_exports_{false};
  std::atomic<int64_t> h2d_{0}, d2h_{0}, d2d_{0}, exports_{0}, imports_{0}, closes_{0},
      host_registrations_{0}, host_unregistrations_{0};
  Executor thread_{"stand-in-dma", 1};  // last: drained before the rest goes
};

// A pool of stand-in device memory of `device`: host memory from malloc that says it is cuda:N.
inline std::unique_ptr<PoolAllocator> NewStandInDevicePool(int device,
                                                           size_t region_bytes = size_t{4} << 20) {
  PoolAllocator::Options options;
  options.region_bytes = region_bytes;
  options.pretouch = false;
  options.source = std::make_shared<const RegionSource>(RegionSource{
      [](size_t bytes) { return std::malloc(bytes); },
      [](void* base, size_t) { std::free(base); },
      MemoryPlacement::CudaDevice(device),
  });
  return std::make_unique<PoolAllocator>(absl::StrCat("stand-in cuda:", device), options);
}

}  // namespace tensorverbs::testing

#endif  // TENSORVERBS_TESTS_SUPPORT_STAND_IN_DEVICE_MEMORY_H_
