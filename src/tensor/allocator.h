// PoolAllocator: the registered-pool allocator (Allocator and CpuAllocator() are public, in
// tensorverbs/allocator.h).
//
// PoolAllocator obtains large regions from the OS once (huge-page advised and pre-touched,
// because first-touch page faults cost ~11 µs per 4 KiB page on the VMs this runs on), carves
// tensors out of them and reuses freed space, so steady-state allocation never faults fresh
// memory. Region visitors are told when a region is created or released: this is where the
// RDMA layer registers memory once per region (seed 000, remedy 3). Unlike TensorFlow, a visitor
// added after regions exist is called at once for each of them, so registration does not depend
// on the order in which allocators and transports start.
//
// A training step allocates the same sizes every step, so a freed chunk of up to
// kMaxRecycledChunk bytes is kept whole, by size, for the next allocation of exactly that size
// (up to a bound of recycled bytes): the steady state then costs no splitting, coalescing or
// tree nodes, that is no heap allocation, per tensor. Recycled chunks go back to the free tree
// when an allocation would otherwise need a new region, and before regions are released.
//
// Regions are kept while free, since making one costs its page faults and its registration;
// but a pool that grew for a burst (a peer sending large tensors once) should not hold that
// memory for the life of the process. A region that has been wholly free for
// Options::release_after is returned to the OS, oldest first, while the wholly free regions
// add up to more than Options::keep_free_bytes. This is checked when the pool is next used
// (an allocation or ReleaseFreeRegions), so no thread wakes for it.
//
// A RegionSource replaces the OS as where regions come from, for memory the CPU must not touch
// (a GPU's): the pool then only keeps books, outside the memory, and Placement() is the
// source's. device::NewCudaPool builds the GPU pool this way.
//
// Thread-safe. A free does not take the pool's lock: it queues the pointer in a lock-free queue
// that the next holder of the lock (an allocation, GetStats, a release) applies, so the threads
// that drop received tensors never contend with the progress thread that allocates
// destinations (a full queue falls back to the lock). Visitors run under the pool's lock, on
// the thread that allocates (or adds the visitor, or releases); they must not call back into
// the same pool.
#ifndef TENSORVERBS_TENSOR_ALLOCATOR_H_
#define TENSORVERBS_TENSOR_ALLOCATOR_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "src/common/bounded_queue.h"
#include "src/common/mutex.h"
#include "src/common/shared_memory.h"
#include "tensorverbs/allocator.h"

namespace tensorverbs {

// A contiguous block of memory a PoolAllocator obtained from the OS.
struct MemoryRegion {
  void* base = nullptr;
  size_t size = 0;
};

// Where a pool's regions come from when they are not host memory. Called under the pool's
// lock; `allocate` returns nullptr when the memory is exhausted.
struct RegionSource {
  std::function<void*(size_t bytes)> allocate;
  std::function<void(void* base, size_t bytes)> release;
  MemoryPlacement placement;
};

class PoolAllocator final : public Allocator {
 public:
  struct Options {
    size_t region_bytes = size_t{64} << 20;  // minimum size of each region
    bool pretouch = true;                    // fault every page in when the region is created
    size_t max_recycled_bytes = size_t{32} << 20;  // freed chunks kept whole for reuse, at most
    // Regions come from SharedMemory (a memfd), so a peer on this host can map them and write
    // tensors with one memcpy (src/fabric/shmem). Falls back to private memory if refused.
    bool shareable = false;
    // Wholly free regions kept whatever their age, and how long one beyond that stays free
    // before it is returned (see above). The defaults keep everything.
    size_t keep_free_bytes = SIZE_MAX;
    absl::Duration release_after = absl::Seconds(30);
    // Regions from here instead of the OS (shareable and pretouch are then ignored).
    std::shared_ptr<const RegionSource> source = nullptr;
  };
  // Larger chunks always go back to the free tree: their transfer dwarfs the bookkeeping.
  static constexpr size_t kMaxRecycledChunk = size_t{4} << 20;
  struct Stats {
    size_t regions = 0;
    size_t region_bytes = 0;   // sum of region sizes
    size_t bytes_in_use = 0;   // sum of live allocation sizes (rounded)
    size_t allocations = 0;    // live allocations
    size_t regions_created = 0;  // over the pool's lifetime
    size_t recycled_bytes = 0;   // freed chunks kept whole for an allocation of their size
    size_t recycled_hits = 0;    // allocations served from them, over the pool's lifetime
    size_t idle_bytes = 0;       // regions wholly free, in bytes
    size_t regions_released = 0;  // returned to the OS while the pool lived
  };
  using RegionVisitor = std::function<void(const MemoryRegion&)>;

  PoolAllocator(std::string name, Options options);
  PoolAllocator(const PoolAllocator&) = delete;
  PoolAllocator& operator=(const PoolAllocator&) = delete;
  ~PoolAllocator() override;  // releases every region (calling on_release visitors)

  std::string Name() const override { return name_; }
  void* AllocateRaw(size_t bytes) override;
  void DeallocateRaw(void* ptr, size_t bytes) override;
  // Host, or pinned host once something page-locks every region (device::PinPoolRegions).
  MemoryPlacement Placement() const override {
    if (options_.source != nullptr) return options_.source->placement;
    return pinned_.load(std::memory_order_acquire) ? MemoryPlacement::PinnedHost()
                                                   : MemoryPlacement::Host();
  }
  void SetPinned(bool pinned) { pinned_.store(pinned, std::memory_order_release); }

  // Adds a visitor pair and calls `on_create` for every existing region before returning.
  // Returns an id for RemoveRegionVisitor.
  int AddRegionVisitor(RegionVisitor on_create, RegionVisitor on_release);
  void RemoveRegionVisitor(int id);

  // Returns regions with no live allocation to the OS. Returns how many were released.
  size_t ReleaseFreeRegions();

  // The region containing [ptr, ptr+len), if any.
  bool FindRegion(const void* ptr, size_t len, MemoryRegion* region) const;

  Stats GetStats() const;

 private:
  struct Chunk {
    size_t size = 0;
    uintptr_t region = 0;  // base address of the owning region
    bool free = true;
    bool recycled = false;  // freed, but kept whole (not free) for an allocation of its size
  };
  struct Visitor {
    RegionVisitor on_create;
    RegionVisitor on_release;
  };

  bool CreateRegion(size_t min_bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseRegion(uintptr_t base) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the chunk at `it` free and coalesces it with its free neighbours.
  void FreeChunk(std::map<uintptr_t, Chunk>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Returns every recycled chunk to the free tree.
  void FlushRecycled() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees the chunk that starts at `start` (recycling it when it qualifies).
  void FreeLocked(uintptr_t start) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies the frees queued without the lock.
  void ApplyDeferredFrees() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Returns regions idle past release_after while idle bytes exceed keep_free_bytes.
  void ReleaseIdleRegions() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string name_;
  const Options options_;
  mutable Mutex mu_;
  std::map<uintptr_t, size_t> regions_ ABSL_GUARDED_BY(mu_);  // base -> size
  // The regions that live in shared memory, by base.
  std::map<uintptr_t, std::unique_ptr<SharedMemory>> shared_ ABSL_GUARDED_BY(mu_);
  std::map<uintptr_t, Chunk> chunks_ ABSL_GUARDED_BY(mu_);    // start -> chunk
  std::set<std::pair<size_t, uintptr_t>> free_ ABSL_GUARDED_BY(mu_);  // (size, start)
  // Recycled chunks by size, most recently freed last.
  absl::flat_hash_map<size_t, std::vector<uintptr_t>> recycled_ ABSL_GUARDED_BY(mu_);
  // Wholly free regions, by base, with when they became so.
  std::map<uintptr_t, absl::Time> idle_ ABSL_GUARDED_BY(mu_);
  std::map<int, Visitor> visitors_ ABSL_GUARDED_BY(mu_);
  int next_visitor_id_ ABSL_GUARDED_BY(mu_) = 1;
  Stats stats_ ABSL_GUARDED_BY(mu_);
  // Pushed by DeallocateRaw from any thread; popped only under mu_ (one consumer at a time).
  BoundedQueue<uintptr_t> deferred_frees_{4096};
  std::atomic<bool> pinned_{false};
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_TENSOR_ALLOCATOR_H_
