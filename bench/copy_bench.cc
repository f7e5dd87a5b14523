// memcpy against non-temporal stores for a shmem write: the source is private memory (the
// sender's tensor), the destination a second mapping of a memfd (the writer's view of the
// receiver's pool), rotating over destinations that together exceed the last-level cache, as
// a stream of tensors into the pool does. The shmem fabric picks its copy per size from this.
//
//   build/bench/copy_bench --benchmark_min_time=0.5
#include <benchmark/benchmark.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "src/common/shared_memory.h"
#include "src/fabric/shmem/copy.h"

namespace tensorverbs {
namespace {

struct Target {
  std::unique_ptr<SharedMemory> memory;
  char* alias = nullptr;  // the writer's mapping of it
  size_t size = 0;
};

class Buffers {
 public:
  // `count` destinations, or enough to exceed 256 MiB (and at least 4) when 0.
  Buffers(size_t size, size_t count) : size_(size) {
    src_ = static_cast<char*>(
        mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    std::memset(src_, 0x5A, size);
    if (count == 0) count = std::max<size_t>(4, (size_t{256} << 20) / size);
    for (size_t i = 0; i < count; ++i) {
      Target t;
      t.memory = *SharedMemory::Create(size, "copy-bench");
      std::memset(t.memory->data(), 0, t.memory->size());
      t.alias = static_cast<char*>(mmap(nullptr, t.memory->size(), PROT_READ | PROT_WRITE,
                                        MAP_SHARED | MAP_POPULATE, t.memory->fd(), 0));
      t.size = t.memory->size();
      targets_.push_back(std::move(t));
    }
  }
  ~Buffers() {
    munmap(src_, size_);
    for (Target& t : targets_) munmap(t.alias, t.size);
  }
  char* src() const { return src_; }
  char* Next() { return targets_[next_++ % targets_.size()].alias; }

 private:
  size_t size_;
  char* src_;
  std::vector<Target> targets_;
  size_t next_ = 0;
};

// Times `copy(dst, src, size)` into the destinations the benchmark's arguments name, in turn.
template <typename CopyFn>
void TimeCopies(benchmark::State& state, CopyFn copy) {
  const auto size = static_cast<size_t>(state.range(0));
  Buffers b(size, static_cast<size_t>(state.range(1)));
  for (auto _ : state) {
    char* dst = b.Next();
    copy(dst, b.src(), size);
    benchmark::DoNotOptimize(dst);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(size));
}

void BM_Memcpy(benchmark::State& state) {
  TimeCopies(state, [](char* dst, const char* src, size_t n) { std::memcpy(dst, src, n); });
}

void BM_StreamingCopy(benchmark::State& state) {
  TimeCopies(state, [](char* dst, const char* src, size_t n) {
    fabric::shmem::StreamingCopy(dst, src, n);
  });
}

// Streaming stores shared with one helper thread (CopyHelpers, as a shmem domain with
// TENSORVERBS_SHMEM_COPY_THREADS=1 copies a write of 8 MiB and more), here from 4 MiB.
void BM_SharedStreamingCopy(benchmark::State& state) {
  fabric::shmem::CopyHelpers helpers(1, size_t{4} << 20);
  TimeCopies(state, [&](char* dst, const char* src, size_t n) {
    helpers.Copy(dst, src, n, /*streaming=*/true);
  });
}

// memcpy shared with one helper from 256 KiB (for sizes below the fabric's threshold).
void BM_SharedMemcpy(benchmark::State& state) {
  fabric::shmem::CopyHelpers helpers(1, size_t{256} << 10);
  TimeCopies(state, [&](char* dst, const char* src, size_t n) {
    helpers.Copy(dst, src, n, /*streaming=*/false);
  });
}

// memcpy shared with a thread that is already awake and polling, as the receiver's progress
// thread is when the shmem fabric offers it a shared write: each copy in parts of 128 KiB that
// both threads claim by advancing (copy number << 32 | next part), as the fabric's two sides do,
// with no wake-up.
void BM_MemcpyWithAPollingPartner(benchmark::State& state) {
  const auto size = static_cast<size_t>(state.range(0));
  Buffers b(size, static_cast<size_t>(state.range(1)));
  const uint64_t part = std::min<uint64_t>(size, 128 << 10);
  const uint64_t parts = (size + part - 1) / part;
  std::atomic<char*> dst{nullptr};
  std::atomic<uint64_t> claim{0}, done{0};
  std::atomic<bool> stop{false};
  // Claims and copies parts of copy `seq` while it has some left.
  auto copy_parts = [&](uint64_t seq, char* to) {
    uint64_t s = claim.load(std::memory_order_acquire);
    while ((s >> 32) == seq && (s & 0xffffffffu) < parts) {
      if (!claim.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
      const uint64_t i = s & 0xffffffffu;
      std::memcpy(to + i * part, b.src() + i * part, std::min(part, size - i * part));
      done.fetch_add(1, std::memory_order_release);
      ++s;
    }
  };
  std::thread partner([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      const uint64_t s = claim.load(std::memory_order_acquire);
      if ((s & 0xffffffffu) < parts) copy_parts(s >> 32, dst.load(std::memory_order_relaxed));
    }
  });
  uint64_t seq = 0;
  for (auto _ : state) {
    char* to = b.Next();
    done.store(0, std::memory_order_relaxed);
    dst.store(to, std::memory_order_relaxed);
    claim.store(++seq << 32, std::memory_order_release);
    copy_parts(seq, to);
    while (done.load(std::memory_order_acquire) < parts) {
    }
    benchmark::DoNotOptimize(to);
  }
  stop.store(true);
  partner.join();
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(size));
}

// Second argument: how many destinations the copies rotate over (0: past the cache). A stream
// of large tensors rotates over as many pool chunks as it has recvs outstanding.
void CopyArgs(benchmark::internal::Benchmark* b) {
  for (int64_t size = 64 << 10; size <= (64 << 20); size *= 4) b->Args({size, 0});
  for (int64_t count : {1, 2, 3, 4, 8}) b->Args({64 << 20, count});
  // A stream of 1 MiB tensors: one destination (the raw fabric bench) against a window's.
  for (int64_t count : {1, 2, 4, 16}) b->Args({1 << 20, count});
}

BENCHMARK(BM_Memcpy)->Apply(CopyArgs)->UseRealTime();
BENCHMARK(BM_StreamingCopy)->Apply(CopyArgs)->UseRealTime();
BENCHMARK(BM_SharedStreamingCopy)->Apply(CopyArgs)->UseRealTime();
BENCHMARK(BM_SharedMemcpy)->Apply(CopyArgs)->UseRealTime();
BENCHMARK(BM_MemcpyWithAPollingPartner)->Apply(CopyArgs)->UseRealTime();

}  // namespace
}  // namespace tensorverbs

BENCHMARK_MAIN();
