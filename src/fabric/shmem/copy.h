// How the shmem fabric moves a write's bytes into a peer's mapping: memcpy, or StreamingCopy
// here, which ShmemEndpoint::Copy and SharedWrites use from kStreamingCopyBytes up (measured
// against each other per size by bench/copy_bench.cc); and for large writes CopyHelpers, which
// shares one copy among threads.
//
// StreamingCopy writes the destination with non-temporal stores: the bytes go to memory without
// first pulling each destination line into this core's cache, which is the reader's memory
// anyway. It ends with a store fence, so a release store after it (publishing the immediate)
// orders the bytes before it as plain stores would be. Any thread; no state.
#ifndef TENSORVERBS_FABRIC_SHMEM_COPY_H_
#define TENSORVERBS_FABRIC_SHMEM_COPY_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>

#include "src/common/mutex.h"

namespace tensorverbs::fabric::shmem {

// Writes of at least this many bytes into a peer's mapping use non-temporal stores. Measured
// (docs/perf/history.md): into destinations the writer has not touched lately
// (bench/copy_bench.cc) streaming stores beat memcpy at every size from 64 KiB, 1.3x at
// 4-64 MiB; but into a destination still in cache, as a pool chunk reused at once often is,
// memcpy won at 1 MiB (`bench fabric`: 0.72x memcpy streaming, 1.06x plain). From twice a
// core's L2 up a destination cannot be in that cache anyway.
inline constexpr size_t kStreamingCopyBytes = size_t{4} << 20;

void StreamingCopy(void* dst, const void* src, size_t n);

// CopyHelpers: threads that take parts of a large copy, so that one write draws on several
// cores' memory bandwidth (one core's copy is bound by its own load and store throughput, well
// below what memory gives: bench/copy_bench.cc's BM_ParallelCopy). Owned by a shmem domain;
// Copy is called by its progress thread, one copy at a time.
//
// The caller copies parts too and takes every part no helper has claimed, so a copy never waits
// for a helper to wake: with the helpers busy elsewhere or slow to be scheduled, it is the
// caller's plain copy plus one wake-up call. It does wait for a part a helper claimed and is
// still writing (a helper preempted mid-part costs the caller that part's time, or more). Copy
// returns once every part is written and no helper holds the job; parts written with streaming
// stores are fenced by their writer before it reports them, so a release store after Copy orders
// every byte before it.
class CopyHelpers {
 public:
  // Copies of at least `min_shared_bytes` are shared. The default is where sharing paid in the
  // protocol on two cores (docs/perf/history.md: at 1 and 4 MiB the helper's wake-up and the cores
  // it competes for cost more than half a copy saves; from 8 MiB it wins).
  static constexpr size_t kMinSharedBytes = size_t{8} << 20;

  explicit CopyHelpers(int threads, size_t min_shared_bytes = kMinSharedBytes);
  ~CopyHelpers();
  CopyHelpers(const CopyHelpers&) = delete;
  CopyHelpers& operator=(const CopyHelpers&) = delete;

  int threads() const { return static_cast<int>(threads_.size()); }
  // Whether a copy of `n` bytes is shared with the helpers.
  bool Shares(size_t n) const { return !threads_.empty() && n >= min_shared_bytes_; }
  // `n` bytes from `src` to `dst`, with streaming stores or memcpy.
  void Copy(void* dst, const void* src, size_t n, bool streaming);

 private:
  struct Job {
    char* dst;
    const char* src;
    size_t n;
    size_t part;  // bytes per part (the last may be shorter)
    size_t parts;
    bool streaming;
    std::atomic<size_t> next{0};  // the next part to claim
    std::atomic<size_t> done{0};  // parts written
  };
  // Claims and writes parts of `job` until none is left.
  static void CopyParts(Job& job);
  void Run();

  const size_t min_shared_bytes_;
  Mutex mu_;
  Job* job_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Helpers that took the current job (joined under mu_, left without it).
  std::atomic<int> users_{0};
  std::vector<std::thread> threads_;
};

}  // namespace tensorverbs::fabric::shmem

#endif  // TENSORVERBS_FABRIC_SHMEM_COPY_H_
