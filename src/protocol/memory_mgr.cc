#include "src/protocol/memory_mgr.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"

namespace tensorverbs::protocol {
namespace {

// Keys are usually a fixed set per model; a workload that makes new keys every step would grow
// the cache forever, so it is bounded (and simply cleared when full: misses cost one round trip).
constexpr size_t kMaxCachedKeys = 1 << 16;

}  // namespace

absl::StatusOr<Registration> ParseRegistration(absl::string_view name) {
  if (name == "pool") return Registration::kPool;
  if (name == "per-transfer") return Registration::kPerTransfer;
  if (name == "copy") return Registration::kCopy;
  return absl::InvalidArgumentError(absl::StrCat("unknown registration strategy '", name,
                                                 "'; expected pool, per-transfer or copy"));
}

const char* RegistrationName(Registration r) {
  switch (r) {
    case Registration::kPool:
      return "pool";
    case Registration::kPerTransfer:
      return "per-transfer";
    case Registration::kCopy:
      return "copy";
  }
  return "?";
}

RdmaMemoryMgr::RdmaMemoryMgr(fabric::Domain* domain, PoolAllocator* pool, uint32_t remote_access,
                             bool channel_keys)
    : domain_(domain),
      pool_(pool),
      remote_access_(remote_access),
      channel_keys_(channel_keys && domain->capabilities().channel_keys),
      // With channel keys a receiver's peers get keys only from the channels' registrations, so
      // the shared one needs no remote access: no key of it is offered, and none guessed works.
      // grpc+gdr lends through the shared registration (read access) and keeps it.
      shared_access_(channel_keys_ && remote_access == fabric::kAccessRemoteWrite
                         ? static_cast<uint32_t>(fabric::kAccessLocal)
                         : remote_access) {
  visitor_id_ = pool_->AddRegionVisitor(
      [](const MemoryRegion&) {},  // registered lazily on the progress thread
      [this](const MemoryRegion& r) {
        MutexLock lock(&mu_);
        released_.push_back(reinterpret_cast<uintptr_t>(r.base));
      });
}

RdmaMemoryMgr::~RdmaMemoryMgr() {
  pool_->RemoveRegionVisitor(visitor_id_);
  // The release visitors take mu_ under each pool's lock: never the other way round.
  std::vector<std::pair<PoolAllocator*, int>> device_pools;
  {
    MutexLock lock(&mu_);
    device_pools.swap(device_pools_);
  }
  for (auto& [pool, id] : device_pools) pool->RemoveRegionVisitor(id);
  registered_.clear();
}

void RdmaMemoryMgr::AddDevicePool(PoolAllocator* pool) {
  if (HasDevicePool(pool)) return;
  // Added outside mu_: the release visitor takes mu_ under the pool's lock.
  const int id = pool->AddRegionVisitor([](const MemoryRegion&) {},
                                        [this](const MemoryRegion& r) {
                                          MutexLock lock(&mu_);
                                          released_.push_back(reinterpret_cast<uintptr_t>(r.base));
                                        });
  bool duplicate = false;
  {
    MutexLock lock(&mu_);
    for (const auto& [known, known_id] : device_pools_) duplicate |= known == pool;
    if (!duplicate) {
      device_pools_.emplace_back(pool, id);
      device_pool_count_.store(device_pools_.size(), std::memory_order_release);
    }
  }
  if (duplicate) pool->RemoveRegionVisitor(id);  // another thread added it meanwhile
}

bool RdmaMemoryMgr::HasDevicePool(const Allocator* pool) const {
  MutexLock lock(&mu_);
  for (const auto& [known, id] : device_pools_) {
    if (known == pool) return true;
  }
  return false;
}

bool RdmaMemoryMgr::FindDeviceRegion(const void* p, size_t len, MemoryRegion* region, int* device) {
  if (device_pools_seen_.size() != device_pool_count_.load(std::memory_order_acquire)) {
    MutexLock lock(&mu_);
    device_pools_seen_.clear();
    for (const auto& [pool, id] : device_pools_) device_pools_seen_.push_back(pool);
  }
  for (PoolAllocator* pool : device_pools_seen_) {
    if (pool->FindRegion(p, len, region)) {
      *device = pool->Placement().device;
      return true;
    }
  }
  return false;
}

void RdmaMemoryMgr::DropReleased() {
  std::vector<uintptr_t> released;
  {
    MutexLock lock(&mu_);
    if (released_.empty()) return;
    released.swap(released_);
  }
  for (uintptr_t base : released) registered_.erase(base);
  Recount();
}

void RdmaMemoryMgr::Recount() {
  int64_t regions = 0, bytes = 0, endpoint_regions = 0, endpoint_bytes = 0;
  for (const auto& [base, entry] : registered_) {
    ++regions;
    bytes += static_cast<int64_t>(entry.size);
    endpoint_regions += static_cast<int64_t>(entry.for_endpoint.size());
    endpoint_bytes += static_cast<int64_t>(entry.size * entry.for_endpoint.size());
  }
  regions_.store(regions, std::memory_order_relaxed);
  region_bytes_.store(bytes, std::memory_order_relaxed);
  endpoint_regions_.store(endpoint_regions, std::memory_order_relaxed);
  endpoint_bytes_.store(endpoint_bytes, std::memory_order_relaxed);
}

RdmaMemoryMgr::RegistrationGauges RdmaMemoryMgr::gauges() const {
  RegistrationGauges g;
  g.regions = regions_.load(std::memory_order_relaxed);
  g.bytes = region_bytes_.load(std::memory_order_relaxed);
  g.endpoint_registrations = endpoint_regions_.load(std::memory_order_relaxed);
  g.endpoint_bytes = endpoint_bytes_.load(std::memory_order_relaxed);
  return g;
}

std::pair<int64_t, int64_t> RdmaMemoryMgr::EndpointRegistrations(
    const fabric::Endpoint* endpoint) const {
  int64_t n = 0, bytes = 0;
  for (const auto& [base, entry] : registered_) {
    if (entry.for_endpoint.contains(endpoint)) {
      ++n;
      bytes += static_cast<int64_t>(entry.size);
    }
  }
  return {n, bytes};
}

absl::StatusOr<const fabric::MemoryRegion*> RdmaMemoryMgr::FindRegistered(const void* p,
                                                                          size_t len) {
  DropReleased();
  MemoryRegion region;
  int device = -1;
  if (p == nullptr) return nullptr;
  if (!pool_->FindRegion(p, std::max<size_t>(len, 1), &region) &&
      !FindDeviceRegion(p, std::max<size_t>(len, 1), &region, &device)) {
    return nullptr;
  }
  const auto base = reinterpret_cast<uintptr_t>(region.base);
  auto it = registered_.find(base);
  if (it != registered_.end() && it->second.size == region.size) return it->second.region.get();
  ASSIGN_OR_RETURN(
      std::unique_ptr<fabric::MemoryRegion> mr,
      device >= 0 ? domain_->RegisterDeviceMemory(region.base, region.size, device, shared_access_)
                  : domain_->RegisterMemory(region.base, region.size, shared_access_));
  Registered& entry = registered_[base];
  entry.for_endpoint.clear();  // registrations of the memory the region held before
  entry.size = region.size;
  entry.device = device;
  entry.region = std::move(mr);
  Recount();
  return entry.region.get();
}

absl::StatusOr<fabric::RemoteKey> RdmaMemoryMgr::RemoteKeyFor(fabric::Endpoint& endpoint,
                                                              const fabric::MemoryRegion& region) {
  if (!channel_keys_) return region.PackRemoteKey();
  auto it = registered_.find(reinterpret_cast<uintptr_t>(region.base()));
  // A transient registration is made for one transfer to one peer already; device memory has
  // no per-endpoint registrations (no fabric offers both).
  if (it == registered_.end() || it->second.region.get() != &region || it->second.device >= 0) {
    return region.PackRemoteKey();
  }
  Registered& entry = it->second;
  auto own = entry.for_endpoint.find(&endpoint);
  if (own == entry.for_endpoint.end()) {
    ASSIGN_OR_RETURN(
        std::unique_ptr<fabric::MemoryRegion> mr,
        domain_->RegisterMemoryFor(endpoint, region.base(), entry.size, remote_access_));
    own = entry.for_endpoint.emplace(&endpoint, std::move(mr)).first;
    Recount();
  }
  return own->second->PackRemoteKey();
}

void RdmaMemoryMgr::DropEndpoint(const fabric::Endpoint* endpoint) {
  for (auto& [base, entry] : registered_) entry.for_endpoint.erase(endpoint);
  Recount();
}

size_t RdmaMemoryMgr::endpoint_registrations() const {
  size_t n = 0;
  for (const auto& [base, entry] : registered_) n += entry.for_endpoint.size();
  return n;
}

absl::StatusOr<Tensor> RdmaMemoryMgr::AllocateStaging(uint64_t bytes,
                                                      const fabric::MemoryRegion** region) {
  ASSIGN_OR_RETURN(TensorShape shape, TensorShape::Create({static_cast<int64_t>(bytes)}));
  ASSIGN_OR_RETURN(Tensor staging, Tensor::Allocate(pool_, DataType::kUInt8, shape));
  ASSIGN_OR_RETURN(*region, FindRegistered(staging.data(), bytes));
  if (*region == nullptr)
    return absl::InternalError("the transport's pool memory is not registrable");
  return staging;
}

absl::StatusOr<Tensor> RdmaMemoryMgr::StageCopyOf(const void* data, uint64_t bytes,
                                                  const fabric::MemoryRegion** region) {
  ASSIGN_OR_RETURN(Tensor staging, AllocateStaging(bytes, region));
  if (bytes > 0) std::memcpy(staging.data(), data, bytes);
  return staging;
}

absl::StatusOr<std::unique_ptr<fabric::MemoryRegion>> RdmaMemoryMgr::RegisterTransient(void* p,
                                                                                       size_t len) {
  return domain_->RegisterMemory(p, len, remote_access_);
}

absl::StatusOr<std::unique_ptr<fabric::MemoryRegion>> RdmaMemoryMgr::RegisterSource(const void* p,
                                                                                    size_t len) {
  return domain_->RegisterMemory(const_cast<void*>(p), len, fabric::kAccessLocal);
}

const TensorMetaData* RdmaMemoryMgr::CachedMeta(const std::string& key) const {
  auto it = cache_.find(key);
  return it == cache_.end() ? nullptr : &it->second;
}

void RdmaMemoryMgr::CacheMeta(const std::string& key, const TensorMetaData& meta) {
  if (cache_.size() >= kMaxCachedKeys && !cache_.contains(key)) cache_.clear();
  cache_[key] = meta;
}

}  // namespace tensorverbs::protocol
