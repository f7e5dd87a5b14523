// RdmaMemoryMgr: what the grpc+verbs transport knows about memory (seed 000, "RdmaMemoryMgr").
//
// - The registry of registered regions. The server's PoolAllocator regions are registered with
//   the fabric once each, lazily on first use (seed remedy 3: register the pool, not each
//   tensor), and deregistered after the pool releases them. A pointer outside every pool region
//   is not registrable here: the transport then uses a registered proxy (staging) tensor or,
//   with TENSORVERBS_REGISTRATION=per-transfer, registers that buffer for one transfer.
// - The keys offered to peers. With channel keys (the fabric's Capabilities::channel_keys and
//   TENSORVERBS_REMOTE_KEYS=per-channel), each peer's endpoint gets registrations of the pool
//   regions of its own, made on first use and dropped when the channel closes (DropEndpoint)
//   or the pool releases the region: a key offered to one peer is not the key offered to
//   another, and it dies with its channel. Local operations use the shared registration, which
//   then takes no remote access at all (grpc+gdr's, which it lends through, excepted).
// - The meta-data cache: rendezvous key (no step id) -> the tensor meta-data last received, so
//   a steady-state recv allocates its result before asking and the sender writes at once.
//
// Threading: everything but the pool's release visitor runs on the transport's progress thread,
// which owns the fabric domain (domains are single-threaded). The visitor runs on whichever
// thread releases a pool region, under the pool's lock, so it only records the region; the
// progress thread deregisters it before the next lookup. A region with a live allocation is
// never released, so a lookup can never race with the release of its own region.
#ifndef TENSORVERBS_PROTOCOL_MEMORY_MGR_H_
#define TENSORVERBS_PROTOCOL_MEMORY_MGR_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "src/common/mutex.h"
#include "src/fabric/fabric.h"
#include "src/protocol/message.h"
#include "src/tensor/allocator.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::protocol {

// TENSORVERBS_REGISTRATION: the seed's three memory strategies.
enum class Registration { kPool, kPerTransfer, kCopy };

// Under kPool, a source outside the pool of at least this many bytes (host memory a task
// adopted from its caller, say) is registered for its one write instead of staged: a
// registration costs about as much as copying 64 KiB here, and above that the copy costs more.
inline constexpr uint64_t kRegisterSourcesFrom = uint64_t{64} << 10;
absl::StatusOr<Registration> ParseRegistration(absl::string_view name);
const char* RegistrationName(Registration r);

class RdmaMemoryMgr {
 public:
  // Registers pool regions and transient ranges with `remote_access` (fabric::Access bits).
  // With `channel_keys`, RemoteKeyFor offers each endpoint registrations of its own (the domain
  // must offer Capabilities::channel_keys).
  RdmaMemoryMgr(fabric::Domain* domain, PoolAllocator* pool, uint32_t remote_access,
                bool channel_keys = false);
  RdmaMemoryMgr(const RdmaMemoryMgr&) = delete;
  RdmaMemoryMgr& operator=(const RdmaMemoryMgr&) = delete;
  ~RdmaMemoryMgr();  // deregisters everything; call on the progress thread or after it ended

  PoolAllocator* pool() const { return pool_; }

  // Adds a pool of GPU memory (its Placement() a CUDA device) whose regions FindRegistered
  // registers as device memory, where the fabric offers Capabilities::device_memory. Any
  // thread; `pool` outlives this manager. Idempotent.
  void AddDevicePool(PoolAllocator* pool);
  // Whether `pool` was added (any thread).
  bool HasDevicePool(const Allocator* pool) const;

  // The registered region holding [p, p+len), registering its pool region on first use (a
  // device pool's as device memory); null if the range is not pool memory. An error if the
  // fabric refused the registration.
  absl::StatusOr<const fabric::MemoryRegion*> FindRegistered(const void* p, size_t len);

  // A uint8 tensor of `bytes` from the pool, and its registered region: the staging buffer of a
  // copy (copy mode, proxies, unregistered sources). Internal if the pool is not registrable.
  absl::StatusOr<Tensor> AllocateStaging(uint64_t bytes, const fabric::MemoryRegion** region);
  // As AllocateStaging, filled with a copy of `bytes` at `data`.
  absl::StatusOr<Tensor> StageCopyOf(const void* data, uint64_t bytes,
                                     const fabric::MemoryRegion** region);

  // Registers [p, p+len) for one transfer, with the same remote access as the pool's regions.
  absl::StatusOr<std::unique_ptr<fabric::MemoryRegion>> RegisterTransient(void* p, size_t len);
  // Registers [p, p+len) for one write from it, with local access only: no peer is given a key
  // to it, and none could use one it guessed.
  absl::StatusOr<std::unique_ptr<fabric::MemoryRegion>> RegisterSource(const void* p, size_t len);

  // The key to offer the peer of `endpoint` for memory in `region` (one this manager returned,
  // or a transient registration). With channel keys, that of the endpoint's own registration of
  // the region's pool region (registered on first use); otherwise `region`'s own key. An error
  // if the fabric refused the registration.
  absl::StatusOr<fabric::RemoteKey> RemoteKeyFor(fabric::Endpoint& endpoint,
                                                 const fabric::MemoryRegion& region);
  // Drops the registrations made for `endpoint`: its peer's keys stop working. Call when its
  // channel closes, before the endpoint is destroyed.
  void DropEndpoint(const fabric::Endpoint* endpoint);
  bool channel_keys() const { return channel_keys_; }
  // Registrations made for endpoints, over every region.
  size_t endpoint_registrations() const;

  // Meta-data cache, keyed by rendezvous key.
  const TensorMetaData* CachedMeta(const std::string& key) const;
  void CacheMeta(const std::string& key, const TensorMetaData& meta);
  size_t cached() const { return cache_.size(); }
  size_t registered_regions() const { return registered_.size(); }

  // Gauges for `tensorverbs stats`, readable from any thread: pool regions registered (shared
  // registrations) and their bytes, and registrations made for endpoints and their bytes.
  struct RegistrationGauges {
    int64_t regions = 0;
    int64_t bytes = 0;
    int64_t endpoint_registrations = 0;
    int64_t endpoint_bytes = 0;
  };
  RegistrationGauges gauges() const;
  // Registrations made for `endpoint` alone (channel keys) and their bytes; progress thread.
  std::pair<int64_t, int64_t> EndpointRegistrations(const fabric::Endpoint* endpoint) const;

 private:
  struct Registered {
    size_t size = 0;
    int device = -1;  // a device pool's region: its GPU
    std::unique_ptr<fabric::MemoryRegion> region;
    // Channel keys: the same memory registered for one endpoint's peer each.
    absl::flat_hash_map<const fabric::Endpoint*, std::unique_ptr<fabric::MemoryRegion>>
        for_endpoint;
  };
  void DropReleased();
  // The device pool region holding [p, p+len), if any (progress thread).
  bool FindDeviceRegion(const void* p, size_t len, MemoryRegion* region, int* device);
  // Stores the gauges of registered_ (progress thread, after each change of it).
  void Recount();

  fabric::Domain* const domain_;
  PoolAllocator* const pool_;
  const uint32_t remote_access_;
  const bool channel_keys_;
  const uint32_t shared_access_;  // of the pool regions' shared registrations
  int visitor_id_ = 0;

  mutable Mutex mu_;
  std::vector<uintptr_t> released_ ABSL_GUARDED_BY(mu_);  // pool region bases, to deregister
  // Device pools with their visitor ids; the progress thread copies the list when it grew.
  std::vector<std::pair<PoolAllocator*, int>> device_pools_ ABSL_GUARDED_BY(mu_);
  std::atomic<size_t> device_pool_count_{0};
  std::vector<PoolAllocator*> device_pools_seen_;  // progress thread

  std::map<uintptr_t, Registered> registered_;  // pool region base -> registration
  absl::flat_hash_map<std::string, TensorMetaData> cache_;
  std::atomic<int64_t> regions_{0};
  std::atomic<int64_t> region_bytes_{0};
  std::atomic<int64_t> endpoint_regions_{0};
  std::atomic<int64_t> endpoint_bytes_{0};
};

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_MEMORY_MGR_H_
