#include "src/tensor/allocator.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/common/logging.h"

namespace tensorverbs {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

size_t RoundUp(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

class HeapAllocator final : public Allocator {
 public:
  std::string Name() const override { return "cpu"; }
  void* AllocateRaw(size_t bytes) override {
    return ::operator new(RoundUp(bytes, kAlignment), std::align_val_t(kAlignment),
                          std::nothrow);
  }
  void DeallocateRaw(void* ptr, size_t bytes) override {
    ::operator delete(ptr, std::align_val_t(kAlignment));
  }
};

}  // namespace

std::string MemoryPlacement::ToString() const {
  switch (kind) {
    case Kind::kHost:
      return "host";
    case Kind::kPinnedHost:
      return "pinned host";
    case Kind::kCudaDevice:
      return absl::StrCat("cuda:", device);
  }
  return "unknown";
}

Allocator* CpuAllocator() {
  static HeapAllocator* allocator = new HeapAllocator;
  return allocator;
}

PoolAllocator::PoolAllocator(std::string name, Options options)
    : name_(std::move(name)), options_(options) {}

PoolAllocator::~PoolAllocator() {
  MutexLock lock(&mu_);
  ApplyDeferredFrees();
  if (stats_.allocations != 0) {
    LOG(WARNING) << "pool " << name_ << " destroyed with " << stats_.allocations
                 << " live allocations (" << stats_.bytes_in_use << " bytes)";
  }
  recycled_.clear();
  while (!regions_.empty()) ReleaseRegion(regions_.begin()->first);
}

bool PoolAllocator::CreateRegion(size_t min_bytes) {
  size_t size = RoundUp(std::max(min_bytes, options_.region_bytes), kHugePage);
  std::unique_ptr<SharedMemory> shared;
  void* base = MAP_FAILED;
  if (options_.source != nullptr) {
    base = options_.source->allocate(size);
    if (base == nullptr) {
      LOG(WARNING) << "pool " << name_ << ": no region of " << size << " bytes in "
                   << options_.source->placement.ToString() << " memory";
      return false;
    }
  } else if (options_.shareable) {
    absl::StatusOr<std::unique_ptr<SharedMemory>> s = SharedMemory::Create(size, "tensorverbs-pool");
    if (s.ok()) {
      shared = *std::move(s);
    } else {
      LOG(WARNING) << "pool " << name_ << ": " << s.status() << "; using private memory";
    }
  }
  if (options_.source == nullptr) {
    base = shared != nullptr
               ? shared->data()
               : mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
      LOG(WARNING) << "pool " << name_ << ": mmap of " << size
                   << " bytes failed: " << std::strerror(errno);
      return false;
    }
    madvise(base, size, MADV_HUGEPAGE);
    if (options_.pretouch) std::memset(base, 0, size);
  }
  auto b = reinterpret_cast<uintptr_t>(base);
  regions_.emplace(b, size);
  if (shared != nullptr) shared_.emplace(b, std::move(shared));
  chunks_.emplace(b, Chunk{size, b, true});
  free_.emplace(size, b);
  stats_.regions++;
  stats_.regions_created++;
  stats_.region_bytes += size;
  VLOG(1) << "pool " << name_ << ": new region of " << size << " bytes at " << base;
  for (auto& [id, v] : visitors_) {
    if (v.on_create) v.on_create(MemoryRegion{base, size});
  }
  return true;
}

void PoolAllocator::ReleaseRegion(uintptr_t base) {
  auto it = regions_.find(base);
  size_t size = it->second;
  for (auto& [id, v] : visitors_) {
    if (v.on_release) v.on_release(MemoryRegion{reinterpret_cast<void*>(base), size});
  }
  // Drop every chunk of the region.
  auto c = chunks_.lower_bound(base);
  while (c != chunks_.end() && c->first < base + size) {
    if (c->second.free) free_.erase({c->second.size, c->first});
    c = chunks_.erase(c);
  }
  if (options_.source != nullptr) {
    options_.source->release(reinterpret_cast<void*>(base), size);
  } else if (auto s = shared_.find(base); s != shared_.end()) {
    shared_.erase(s);  // unmaps
  } else {
    munmap(reinterpret_cast<void*>(base), size);
  }
  if (idle_.erase(base) > 0) stats_.idle_bytes -= size;
  regions_.erase(it);
  stats_.regions--;
  stats_.region_bytes -= size;
}

void PoolAllocator::ReleaseIdleRegions() {
  if (stats_.idle_bytes <= options_.keep_free_bytes) return;
  const absl::Time now = absl::Now();
  std::vector<std::pair<absl::Time, uintptr_t>> oldest_first;
  for (const auto& [base, since] : idle_) {
    if (now - since >= options_.release_after) oldest_first.emplace_back(since, base);
  }
  std::sort(oldest_first.begin(), oldest_first.end());
  for (const auto& [since, base] : oldest_first) {
    if (stats_.idle_bytes <= options_.keep_free_bytes) break;
    VLOG(1) << "pool " << name_ << ": returning a region idle for "
            << absl::FormatDuration(now - since);
    ReleaseRegion(base);
    stats_.regions_released++;
  }
}

void* PoolAllocator::AllocateRaw(size_t bytes) {
  size_t need = RoundUp(std::max<size_t>(bytes, 1), kAlignment);
  if (need < bytes) return nullptr;  // overflow
  MutexLock lock(&mu_);
  ApplyDeferredFrees();  // first: a steady step reuses the chunks its last step freed
  if (!idle_.empty()) ReleaseIdleRegions();
  if (auto r = recycled_.find(need); r != recycled_.end() && !r->second.empty()) {
    const uintptr_t start = r->second.back();
    r->second.pop_back();
    Chunk& chunk = chunks_[start];
    chunk.recycled = false;
    stats_.recycled_bytes -= chunk.size;
    stats_.recycled_hits++;
    stats_.bytes_in_use += chunk.size;
    stats_.allocations++;
    return reinterpret_cast<void*>(start);
  }
  auto it = free_.lower_bound({need, 0});
  if (it == free_.end() && stats_.recycled_bytes > 0) {
    FlushRecycled();
    it = free_.lower_bound({need, 0});
  }
  if (it == free_.end()) {
    if (!CreateRegion(need)) return nullptr;
    it = free_.lower_bound({need, 0});
    CHECK(it != free_.end());
  }
  auto [size, start] = *it;
  free_.erase(it);
  if (!idle_.empty()) {
    if (auto i = idle_.find(start); i != idle_.end()) {  // a wholly free region is used again
      idle_.erase(i);
      stats_.idle_bytes -= size;
    }
  }
  Chunk& chunk = chunks_[start];
  if (size - need >= kAlignment) {
    uintptr_t rest = start + need;
    chunks_.emplace(rest, Chunk{size - need, chunk.region, true});
    free_.emplace(size - need, rest);
    chunk.size = need;
  }
  chunk.free = false;
  stats_.bytes_in_use += chunk.size;
  stats_.allocations++;
  return reinterpret_cast<void*>(start);
}

void PoolAllocator::DeallocateRaw(void* ptr, size_t bytes) {
  if (ptr == nullptr) return;
  if (deferred_frees_.TryPush(reinterpret_cast<uintptr_t>(ptr))) return;
  MutexLock lock(&mu_);
  ApplyDeferredFrees();
  FreeLocked(reinterpret_cast<uintptr_t>(ptr));
}

void PoolAllocator::ApplyDeferredFrees() {
  uintptr_t start;
  while (deferred_frees_.TryPop(&start)) FreeLocked(start);
}

void PoolAllocator::FreeLocked(uintptr_t start) {
  auto it = chunks_.find(start);
  CHECK(it != chunks_.end() && !it->second.free && !it->second.recycled)
      << "pool " << name_ << ": free of unknown pointer " << reinterpret_cast<void*>(start);
  Chunk& chunk = it->second;
  stats_.bytes_in_use -= chunk.size;
  stats_.allocations--;
  if (chunk.size <= kMaxRecycledChunk &&
      stats_.recycled_bytes + chunk.size <= options_.max_recycled_bytes) {
    chunk.recycled = true;
    stats_.recycled_bytes += chunk.size;
    recycled_[chunk.size].push_back(it->first);
    return;
  }
  FreeChunk(it);
}

void PoolAllocator::FreeChunk(std::map<uintptr_t, Chunk>::iterator it) {
  it->second.free = true;
  it->second.recycled = false;
  // Coalesce with the next chunk, then with the previous one, within the same region.
  auto next = std::next(it);
  if (next != chunks_.end() && next->second.free && next->second.region == it->second.region) {
    free_.erase({next->second.size, next->first});
    it->second.size += next->second.size;
    chunks_.erase(next);
  }
  if (it != chunks_.begin()) {
    auto prev = std::prev(it);
    if (prev->second.free && prev->second.region == it->second.region) {
      free_.erase({prev->second.size, prev->first});
      prev->second.size += it->second.size;
      chunks_.erase(it);
      it = prev;
    }
  }
  free_.emplace(it->second.size, it->first);
  if (it->first == it->second.region) {
    auto r = regions_.find(it->first);
    if (r != regions_.end() && r->second == it->second.size &&
        idle_.emplace(r->first, absl::Now()).second) {
      stats_.idle_bytes += r->second;
    }
  }
}

void PoolAllocator::FlushRecycled() {
  for (auto& [size, starts] : recycled_) {
    for (uintptr_t start : starts) FreeChunk(chunks_.find(start));
    starts.clear();
  }
  stats_.recycled_bytes = 0;
}

int PoolAllocator::AddRegionVisitor(RegionVisitor on_create, RegionVisitor on_release) {
  MutexLock lock(&mu_);
  int id = next_visitor_id_++;
  for (const auto& [base, size] : regions_) {
    if (on_create) on_create(MemoryRegion{reinterpret_cast<void*>(base), size});
  }
  visitors_.emplace(id, Visitor{std::move(on_create), std::move(on_release)});
  return id;
}

void PoolAllocator::RemoveRegionVisitor(int id) {
  MutexLock lock(&mu_);
  visitors_.erase(id);
}

size_t PoolAllocator::ReleaseFreeRegions() {
  MutexLock lock(&mu_);
  ApplyDeferredFrees();
  FlushRecycled();
  size_t released = 0;
  for (auto it = regions_.begin(); it != regions_.end();) {
    uintptr_t base = it->first;
    size_t size = it->second;
    ++it;
    auto c = chunks_.find(base);
    if (c != chunks_.end() && c->second.free && c->second.size == size) {
      ReleaseRegion(base);
      ++released;
    }
  }
  return released;
}

bool PoolAllocator::FindRegion(const void* ptr, size_t len, MemoryRegion* region) const {
  auto p = reinterpret_cast<uintptr_t>(ptr);
  MutexLock lock(&mu_);
  auto it = regions_.upper_bound(p);
  if (it == regions_.begin()) return false;
  --it;
  if (p + len > it->first + it->second || p + len < p) return false;
  if (region) *region = MemoryRegion{reinterpret_cast<void*>(it->first), it->second};
  return true;
}

PoolAllocator::Stats PoolAllocator::GetStats() const {
  MutexLock lock(&mu_);
  // Applying the queued frees changes no allocation the caller can see, only when the pool
  // accounts for them: the stats then include every free that returned before this call.
  const_cast<PoolAllocator*>(this)->ApplyDeferredFrees();
  return stats_;
}

}  // namespace tensorverbs
