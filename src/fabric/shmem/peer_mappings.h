// PeerMappings: a ShmemEndpoint's cache of its peer's memory in this process: the peer's
// shareable regions mapped (Map), page-locked once device copies reach them (PinForDevice), and
// the peer's GPU allocations imported (MapDevice). Each is asked of the peer's descriptor server
// through the endpoint's PeerConnection on first use and kept until ReleaseAll.
//
// A region is mapped whole but populated by range: each Map names the bytes the operation
// touches, and only the aligned windows of kWindowBytes they fall in get their page tables made
// (MADV_POPULATE_*), each once. So a peer's 64 MiB pool costs this process (its page tables, its
// share of the memory, the first step's time) what it writes or reads of it, not its size, and
// no page fault lands in the middle of a later copy into a window already touched. The windows
// populated are bounded (`window_budget` bytes): beyond it, one not touched since the last
// sweep gives its page tables back (MADV_DONTNEED, a clock sweep over the populated windows).
// The mapping is shared, so nothing is lost: a copy still running through it (a copy thread's
// part of a write) faults the pages back in. Windows of page-locked mappings stay.
//
// Owned by ShmemEndpoint; called by it, DeviceCopyQueue and SharedWrites on the progress thread.
// No lock, no callbacks. A device copy may still move bytes through any entry, so the caller
// says whether one may be evicted (`may_evict`: no device copy runs); the destructor releases
// nothing, so an endpoint whose copies never finished can leave them mapped (Abandon).
#ifndef TENSORVERBS_FABRIC_SHMEM_PEER_MAPPINGS_H_
#define TENSORVERBS_FABRIC_SHMEM_PEER_MAPPINGS_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/fabric/device_memory.h"
#include "src/fabric/shmem/peer_connection.h"
#include "src/fabric/shmem/wire.h"

namespace tensorverbs::fabric::shmem {

// Mappings of a peer's regions kept per endpoint; the oldest goes first beyond.
inline constexpr size_t kMaxMappingsPerEndpoint = 256;
// The unit a mapping is populated in: a huge page's size, so that a window is one fault's worth
// where the kernel can, and a 64 MiB pool is 32 of them.
inline constexpr uint64_t kWindowBytes = uint64_t{2} << 20;

class PeerMappings {
 public:
  struct Mapping {
    void* addr;
    size_t map_length;
    uint64_t delta;  // remote address + delta = local address
    PackedKey key;   // the key it was mapped for: base, length and offset must match
    bool writable;
    uint64_t order;               // for eviction: the oldest mapping goes first
    bool pinned;                  // page-locked for device copies
    uint64_t start;               // the file offset addr maps
    // By window of kWindowBytes from `start`: kUnpopulated, or populated and whether it was
    // touched since the sweep last passed it.
    std::vector<uint8_t> windows;
  };
  static constexpr uint8_t kUnpopulated = 0;
  static constexpr uint8_t kPopulated = 1;
  static constexpr uint8_t kTouched = 2;
  // A peer's GPU allocation, imported into this process.
  struct DeviceMapping {
    void* base;
    PackedKey key;  // the key it was imported for: base and length must match
    int device;     // the ordinal it was imported on
  };

  // `conn` is the endpoint's; `device` the domain's GPU runtime (null: host memory only). Both
  // outlive this.
  PeerMappings(PeerConnection& conn, DeviceMemory* device,
               uint64_t window_budget = uint64_t{128} << 20)
      : conn_(conn),
        device_(device),
        max_windows_(std::max<uint64_t>(window_budget / kWindowBytes, 1)) {}
  PeerMappings(const PeerMappings&) = delete;
  PeerMappings& operator=(const PeerMappings&) = delete;

  // Where region `key` is mapped here, mapping it on first use and populating the windows that
  // the `length` bytes at the peer's address `addr` fall in; beyond kMaxMappingsPerEndpoint the
  // oldest goes first if `may_evict`. The range must lie inside the key's.
  absl::StatusOr<Mapping*> Map(const PackedKey& key, uint64_t addr, uint64_t length,
                               bool may_evict);

  // Page-locks `m` once, so device copies reach it by DMA and never block this thread; if the
  // runtime refuses, they still work, synchronously.
  void PinForDevice(Mapping& m);

  // Where the peer's GPU region `key` is in this process, importing it on `device` on first
  // use; beyond kMaxMappingsPerEndpoint one goes first if `may_evict`.
  absl::StatusOr<const DeviceMapping*> MapDevice(const PackedKey& key, int device, bool may_evict);

  // Unmaps every region, then closes every import.
  void ReleaseAll();

  // Forgets every region and import without releasing them: a device copy that never finished
  // may still touch them.
  void Abandon();

 private:
  void Unmap(const Mapping& m);
  // Makes the page tables of the windows of `m` that [addr, addr + length) touches, first
  // giving back others' beyond the budget when `may_release`.
  void Populate(Mapping& m, uint64_t addr, uint64_t length, bool may_release);
  // Gives back one populated window that is neither `m`'s windows [first, last] nor touched
  // since the sweep last passed it (clearing the marks it passes); false if none qualifies.
  bool ReleaseOne(const Mapping& m, uint64_t first, uint64_t last);

  PeerConnection& conn_;
  DeviceMemory* const device_;
  std::map<uint64_t, Mapping> mappings_;
  uint64_t mapping_order_ = 0;
  const uint64_t max_windows_;
  uint64_t populated_windows_ = 0;
  // The sweep's position: the region it is in and the window it looks at next.
  uint64_t hand_region_ = 0;
  uint64_t hand_window_ = 0;
  // By (region, the local device it was imported on).
  std::map<std::pair<uint64_t, int>, DeviceMapping> device_mappings_;
};

}  // namespace tensorverbs::fabric::shmem

#endif  // TENSORVERBS_FABRIC_SHMEM_PEER_MAPPINGS_H_
