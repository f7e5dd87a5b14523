#include "src/tensor/allocator.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include "absl/time/clock.h"

namespace tensorverbs {
namespace {

PoolAllocator::Options SmallRegions() {
  PoolAllocator::Options o;
  o.region_bytes = size_t{4} << 20;
  return o;
}

TEST(PoolAllocator, AlignsReusesAndGrows) {
  PoolAllocator pool("test", SmallRegions());
  void* a = pool.AllocateRaw(100);
  void* b = pool.AllocateRaw(1);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % Allocator::kAlignment, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % Allocator::kAlignment, 0u);
  EXPECT_EQ(pool.GetStats().regions, 1u);
  pool.DeallocateRaw(a, 100);
  void* c = pool.AllocateRaw(100);
  EXPECT_EQ(c, a) << "freed space is reused";
  // A request larger than a region gets a region of its own.
  void* big = pool.AllocateRaw(size_t{10} << 20);
  ASSERT_NE(big, nullptr);
  EXPECT_EQ(pool.GetStats().regions, 2u);
  std::memset(big, 1, size_t{10} << 20);
  pool.DeallocateRaw(big, 0);
  pool.DeallocateRaw(b, 0);
  pool.DeallocateRaw(c, 0);
  EXPECT_EQ(pool.GetStats().allocations, 0u);
  EXPECT_EQ(pool.GetStats().bytes_in_use, 0u);
}

// Frees from threads that never allocate (a recv's user, a callback thread) go through the
// lock-free queue, beyond its capacity too, while this thread allocates: every chunk comes back
// once, none is handed out while still live, and the stats see each free that returned.
TEST(PoolAllocator, FreesFromOtherThreadsComeBackWhileThisOneAllocates) {
  PoolAllocator pool("test", SmallRegions());
  constexpr int kRounds = 20, kPerRound = 6000;  // more than the free queue holds
  for (int round = 0; round < kRounds; ++round) {
    std::vector<void*> chunks;
    for (int i = 0; i < kPerRound; ++i) {
      void* p = pool.AllocateRaw(64 + 64 * (i % 4));
      ASSERT_NE(p, nullptr);
      *static_cast<int*>(p) = i;
      chunks.push_back(p);
    }
    std::thread freer([&] {
      for (size_t i = 0; i < chunks.size(); ++i) {
        ASSERT_EQ(*static_cast<int*>(chunks[i]), static_cast<int>(i)) << "overwritten while live";
        pool.DeallocateRaw(chunks[i], 0);
      }
    });
    // Allocations meanwhile must not get a chunk the other thread has not freed yet.
    std::vector<void*> mine;
    for (int i = 0; i < 500; ++i) {
      void* p = pool.AllocateRaw(64);
      ASSERT_NE(p, nullptr);
      *static_cast<int*>(p) = -1;
      mine.push_back(p);
    }
    freer.join();
    for (void* p : mine) pool.DeallocateRaw(p, 0);
    EXPECT_EQ(pool.GetStats().allocations, 0u) << "round " << round;
    EXPECT_EQ(pool.GetStats().bytes_in_use, 0u);
  }
  EXPECT_EQ(pool.GetStats().regions, 1u) << "freed chunks were reused, not leaked";
}

TEST(PoolAllocator, CoalescesFreedNeighbours) {
  PoolAllocator pool("test", SmallRegions());
  const size_t quarter = (size_t{4} << 20) / 4;
  std::vector<void*> parts;
  for (int i = 0; i < 4; ++i) parts.push_back(pool.AllocateRaw(quarter));
  EXPECT_EQ(pool.GetStats().regions, 1u);
  // Free in an order that needs merging on both sides.
  pool.DeallocateRaw(parts[1], 0);
  pool.DeallocateRaw(parts[3], 0);
  pool.DeallocateRaw(parts[2], 0);
  pool.DeallocateRaw(parts[0], 0);
  void* whole = pool.AllocateRaw(size_t{4} << 20);
  EXPECT_EQ(whole, parts[0]) << "the region coalesced back into one chunk";
  EXPECT_EQ(pool.GetStats().regions, 1u);
  pool.DeallocateRaw(whole, 0);
}

TEST(PoolAllocator, FreedChunksServeTheirSizeAgainAndGoBackWhenSpaceRunsOut) {
  PoolAllocator pool("test", SmallRegions());
  // A training step: the same sizes, freed and allocated again.
  std::vector<void*> step;
  for (size_t n : {4096, 640, 4096, 1 << 20}) step.push_back(pool.AllocateRaw(n));
  for (void* p : step) pool.DeallocateRaw(p, 0);
  EXPECT_EQ(pool.GetStats().recycled_bytes, 4096u + 640u + 4096u + (1u << 20));
  EXPECT_EQ(pool.GetStats().bytes_in_use, 0u);
  std::vector<void*> again;
  for (size_t n : {4096, 640, 4096, 1 << 20}) again.push_back(pool.AllocateRaw(n));
  EXPECT_EQ(pool.GetStats().recycled_hits, 4u);
  EXPECT_EQ(pool.GetStats().recycled_bytes, 0u);
  // The most recently freed chunk of a size comes back first.
  EXPECT_EQ(again[0], step[2]);
  EXPECT_EQ(again[2], step[0]);
  EXPECT_EQ(again[1], step[1]);
  EXPECT_EQ(again[3], step[3]);
  for (void* p : again) pool.DeallocateRaw(p, 0);
  // A size that only fits once the recycled chunks coalesce gets them back, not a new region.
  void* whole = pool.AllocateRaw(size_t{4} << 20);
  EXPECT_EQ(pool.GetStats().regions, 1u);
  EXPECT_EQ(pool.GetStats().recycled_bytes, 0u);
  pool.DeallocateRaw(whole, 0);
  // Chunks above kMaxRecycledChunk, and those past the bound, go straight back to the tree.
  PoolAllocator::Options small_bound = SmallRegions();
  small_bound.max_recycled_bytes = 8192;
  PoolAllocator bounded("bounded", small_bound);
  void* x = bounded.AllocateRaw(8192);
  void* y = bounded.AllocateRaw(64);
  void* z = bounded.AllocateRaw(PoolAllocator::kMaxRecycledChunk + 64);  // a region of its own
  bounded.DeallocateRaw(x, 0);
  bounded.DeallocateRaw(y, 0);
  bounded.DeallocateRaw(z, 0);
  EXPECT_EQ(bounded.GetStats().recycled_bytes, 8192u);
  // Releasing free regions takes the recycled chunks back first.
  EXPECT_EQ(bounded.ReleaseFreeRegions(), 2u);
  EXPECT_EQ(bounded.GetStats().regions, 0u);
}

// A pool that grew for a burst gives the memory back: regions wholly free for release_after,
// beyond keep_free_bytes of them, are returned (oldest first) when the pool is next used; a
// region freed and used again in between is kept.
TEST(PoolAllocator, RegionsIdleBeyondTheWatermarkAreReturnedToTheSystem) {
  PoolAllocator::Options options = SmallRegions();
  options.max_recycled_bytes = 0;  // frees go straight back to the free tree
  options.keep_free_bytes = options.region_bytes;
  options.release_after = absl::Milliseconds(50);
  PoolAllocator pool("test", options);
  int releases = 0;
  pool.AddRegionVisitor(nullptr, [&](const MemoryRegion&) { ++releases; });
  std::vector<void*> burst;
  for (int i = 0; i < 4; ++i) burst.push_back(pool.AllocateRaw(options.region_bytes));
  ASSERT_EQ(pool.GetStats().regions, 4u);
  for (void* p : burst) pool.DeallocateRaw(p, 0);
  EXPECT_EQ(pool.GetStats().idle_bytes, 4 * options.region_bytes);
  // Used again at once: nothing is old enough to go, and the region it takes is no longer idle.
  void* busy = pool.AllocateRaw(64);
  EXPECT_EQ(pool.GetStats().regions, 4u);
  EXPECT_EQ(pool.GetStats().idle_bytes, 3 * options.region_bytes);
  absl::SleepFor(absl::Milliseconds(80));
  void* next = pool.AllocateRaw(64);  // the next use returns the idle regions beyond one
  PoolAllocator::Stats stats = pool.GetStats();
  EXPECT_EQ(stats.regions, 2u);
  EXPECT_EQ(stats.regions_released, 2u);
  EXPECT_EQ(stats.idle_bytes, options.region_bytes);
  EXPECT_EQ(releases, 2) << "visitors (deregistration) hear of every release";
  EXPECT_TRUE(pool.FindRegion(busy, 64, nullptr)) << "the region in use stays";
  pool.DeallocateRaw(busy, 0);
  pool.DeallocateRaw(next, 0);
  // Default options keep every region however long it idles.
  PoolAllocator keeper("test", SmallRegions());
  void* once = keeper.AllocateRaw(64);
  keeper.DeallocateRaw(once, 0);
  absl::SleepFor(absl::Milliseconds(10));
  keeper.DeallocateRaw(keeper.AllocateRaw(64), 0);
  EXPECT_EQ(keeper.GetStats().regions, 1u);
}

TEST(PoolAllocator, VisitorsSeeEveryRegionOnceEvenWhenAddedLate) {
  PoolAllocator pool("test", SmallRegions());
  void* first = pool.AllocateRaw(1000);  // a region exists before the visitor
  std::map<void*, size_t> live;
  int creates = 0, releases = 0;
  int id = pool.AddRegionVisitor(
      [&](const MemoryRegion& r) {
        ++creates;
        EXPECT_TRUE(live.emplace(r.base, r.size).second);
      },
      [&](const MemoryRegion& r) {
        ++releases;
        EXPECT_EQ(live.erase(r.base), 1u);
      });
  EXPECT_EQ(creates, 1) << "existing region reported at once";
  void* second = pool.AllocateRaw(size_t{6} << 20);  // forces a new region
  EXPECT_EQ(creates, 2);
  MemoryRegion region;
  ASSERT_TRUE(pool.FindRegion(second, size_t{6} << 20, &region));
  EXPECT_TRUE(live.count(region.base));
  EXPECT_FALSE(pool.FindRegion(&live, 8, nullptr));
  pool.DeallocateRaw(second, 0);
  EXPECT_EQ(pool.ReleaseFreeRegions(), 1u);
  EXPECT_EQ(releases, 1);
  EXPECT_EQ(pool.GetStats().regions, 1u);
  pool.DeallocateRaw(first, 0);
  pool.RemoveRegionVisitor(id);
  EXPECT_EQ(pool.ReleaseFreeRegions(), 1u);
  EXPECT_EQ(releases, 1) << "removed visitor is not called";
}

TEST(PoolAllocator, ShareableRegionsLiveInSharedMemoryUntilReleased) {
  PoolAllocator::Options options = SmallRegions();
  options.shareable = true;
  PoolAllocator pool("test", options);
  auto* p = static_cast<char*>(pool.AllocateRaw(1000));
  ASSERT_NE(p, nullptr);
  SharedMemory::Location where;
  ASSERT_TRUE(SharedMemory::Find(p, 1000, &where)) << "a peer on this host can map it";
  close(where.fd);
  std::memset(p, 7, 1000);
  pool.DeallocateRaw(p, 1000);
  EXPECT_EQ(pool.ReleaseFreeRegions(), 1u);
  EXPECT_FALSE(SharedMemory::Find(p, 1000, &where)) << "released with its region";

  PoolAllocator private_pool("test", SmallRegions());
  void* q = private_pool.AllocateRaw(1000);
  EXPECT_FALSE(SharedMemory::Find(q, 1000, &where)) << "not shareable unless asked";
  private_pool.DeallocateRaw(q, 1000);
}

TEST(PoolAllocator, ARegionSourcesMemoryIsNeverTouchedAndGivesThePlacement) {
  // Memory no access is allowed to, standing in for a GPU's: the pool must keep its books
  // outside it (a touch would fault the test).
  struct Source {
    int allocated = 0, released = 0;
    bool exhausted = false;
  };
  auto counts = std::make_shared<Source>();
  auto source = std::make_shared<RegionSource>();
  source->placement = MemoryPlacement::CudaDevice(3);
  source->allocate = [counts](size_t bytes) -> void* {
    if (counts->exhausted) return nullptr;
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    ++counts->allocated;
    return p;
  };
  source->release = [counts](void* base, size_t bytes) {
    munmap(base, bytes);
    ++counts->released;
  };
  PoolAllocator::Options o = SmallRegions();
  o.source = source;
  o.pretouch = true;  // ignored for a source's regions
  {
    PoolAllocator pool("device", o);
    EXPECT_EQ(pool.Placement(), MemoryPlacement::CudaDevice(3));
    int visited = 0;
    pool.AddRegionVisitor([&](const MemoryRegion&) { ++visited; }, nullptr);
    std::vector<void*> live;
    for (int i = 0; i < 64; ++i) live.push_back(pool.AllocateRaw(size_t{100} << 10));
    for (void* p : live) ASSERT_NE(p, nullptr);
    void* big = pool.AllocateRaw(size_t{9} << 20);  // a region of its own
    ASSERT_NE(big, nullptr);
    EXPECT_EQ(visited, counts->allocated);
    const int regions = counts->allocated;
    for (void* p : live) pool.DeallocateRaw(p, size_t{100} << 10);
    for (int i = 0; i < 64; ++i) {
      void* p = pool.AllocateRaw(size_t{100} << 10);
      ASSERT_NE(p, nullptr);
      pool.DeallocateRaw(p, size_t{100} << 10);
    }
    EXPECT_EQ(counts->allocated, regions) << "freed space is reused, no new region";
    counts->exhausted = true;
    EXPECT_EQ(pool.AllocateRaw(size_t{64} << 20), nullptr) << "the source is out of memory";
    pool.DeallocateRaw(big, size_t{9} << 20);
  }
  EXPECT_EQ(counts->released, counts->allocated) << "every region goes back to its source";
}

TEST(PoolAllocator, RandomizedAllocationsNeverOverlap) {
  PoolAllocator pool("test", SmallRegions());
  std::mt19937 rng(7);
  std::map<uintptr_t, size_t> live;
  for (int i = 0; i < 5000; ++i) {
    if (!live.empty() && rng() % 2 == 0) {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      // The contents survived every other allocation.
      const auto* p = reinterpret_cast<const unsigned char*>(it->first);
      ASSERT_EQ(p[0], static_cast<unsigned char>(it->first >> 6));
      ASSERT_EQ(p[it->second - 1], static_cast<unsigned char>(it->first >> 6));
      pool.DeallocateRaw(reinterpret_cast<void*>(it->first), it->second);
      live.erase(it);
    } else {
      size_t n = 1 + rng() % 200000;
      auto* p = static_cast<unsigned char*>(pool.AllocateRaw(n));
      ASSERT_NE(p, nullptr);
      auto addr = reinterpret_cast<uintptr_t>(p);
      auto next = live.lower_bound(addr);
      if (next != live.end()) {
        ASSERT_LE(addr + n, next->first);
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second, addr);
      }
      std::memset(p, static_cast<unsigned char>(addr >> 6), n);
      live.emplace(addr, n);
    }
  }
  for (auto& [addr, n] : live) pool.DeallocateRaw(reinterpret_cast<void*>(addr), n);
  EXPECT_EQ(pool.GetStats().bytes_in_use, 0u);
}

}  // namespace
}  // namespace tensorverbs
