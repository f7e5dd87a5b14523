#include "src/fabric/shmem/copy.h"

#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace tensorverbs::fabric::shmem {

void StreamingCopy(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  // Up to the first cache-line boundary of the destination with plain stores, so each group of
  // four streaming stores fills one whole line of the write-combining buffer.
  const size_t head = std::min(n, (64 - reinterpret_cast<uintptr_t>(d) % 64) % 64);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + i, s + i, n - i);
  _mm_sfence();
#else
  std::memcpy(dst, src, n);
#endif
}

CopyHelpers::CopyHelpers(int threads, size_t min_shared_bytes)
    : min_shared_bytes_(min_shared_bytes) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

CopyHelpers::~CopyHelpers() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void CopyHelpers::CopyParts(Job& job) {
  for (size_t i = job.next.fetch_add(1, std::memory_order_relaxed); i < job.parts;
       i = job.next.fetch_add(1, std::memory_order_relaxed)) {
    const size_t offset = i * job.part;
    const size_t len = std::min(job.part, job.n - offset);
    if (job.streaming) {
      StreamingCopy(job.dst + offset, job.src + offset, len);  // ends with a store fence
    } else {
      std::memcpy(job.dst + offset, job.src + offset, len);
    }
    job.done.fetch_add(1, std::memory_order_release);
  }
}

void CopyHelpers::Copy(void* dst, const void* src, size_t n, bool streaming) {
  if (!Shares(n)) {
    if (streaming) {
      StreamingCopy(dst, src, n);
    } else {
      std::memcpy(dst, src, n);
    }
    return;
  }
  Job job;
  job.dst = static_cast<char*>(dst);
  job.src = static_cast<const char*>(src);
  job.n = n;
  job.streaming = streaming;
  // One part per thread, in whole pages: with a page-aligned destination (pool chunks are) no
  // two writers share a cache line.
  const size_t ways = threads_.size() + 1;
  job.part = ((n + ways - 1) / ways + 4095) / 4096 * 4096;
  job.parts = (n + job.part - 1) / job.part;
  {
    MutexLock lock(&mu_);
    job_ = &job;
    ++generation_;
  }  // the unlock wakes the helpers
  CopyParts(job);
  {
    MutexLock lock(&mu_);
    job_ = nullptr;  // no helper joins from now on
  }
  // Parts a helper claimed and still writes, and helpers that joined and have yet to leave.
  while (job.done.load(std::memory_order_acquire) < job.parts ||
         users_.load(std::memory_order_acquire) != 0) {
    sched_yield();
  }
}

void CopyHelpers::Run() {
  uint64_t seen = 0;
  for (;;) {
    Job* job = nullptr;
    {
      MutexLock lock(&mu_);
      mu_.Await([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || (job_ != nullptr && generation_ != seen);
      });
      if (stopping_) return;
      seen = generation_;
      job = job_;
      users_.fetch_add(1, std::memory_order_relaxed);
    }
    CopyParts(*job);
    users_.fetch_sub(1, std::memory_order_release);
  }
}

}  // namespace tensorverbs::fabric::shmem
