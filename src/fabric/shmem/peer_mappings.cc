#include "src/fabric/shmem/peer_mappings.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"
#include "src/fabric/shmem/shmem.h"

namespace tensorverbs::fabric::shmem {

auto PeerMappings::Map(const PackedKey& key, uint64_t addr, uint64_t length, bool may_evict)
    -> absl::StatusOr<Mapping*> {
  if (auto it = mappings_.find(key.region); it != mappings_.end()) {
    Mapping& m = it->second;
    if (m.key.base != key.base || m.key.length != key.length || m.key.offset != key.offset) {
      return absl::DataLossError(
          "shmem: a remote key describes its region differently than when it was mapped");
    }
    Populate(m, addr, length, may_evict);
    return &m;
  }
  Reply reply{};
  int fd = -1;
  int nfds = 0;
  RETURN_IF_ERROR(conn_.Ask(kRegion, key.region, &reply, &fd, 1, &nfds));
  absl::Cleanup close_fd = [fd] { close(fd); };
  if (nfds != 1) return absl::DataLossError("shmem: the peer sent no descriptor for a region");
  if (key.offset > reply.size || key.length > reply.size - key.offset) {
    return absl::DataLossError("shmem: a remote key does not fit its region's memory");
  }
  RETURN_IF_ERROR(CheckPeerMemory(fd, key.offset + key.length, "region").status());
  const auto page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t start = key.offset / page * page;
  const size_t map_length = key.offset + key.length - start;
  const bool writable = (reply.access & kAccessRemoteWrite) != 0;
  // Populated by window as operations reach them (Populate), not whole: a peer's pool costs
  // what is written or read of it.
  void* mapped = mmap(nullptr, map_length, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd,
                      static_cast<off_t>(start));
  if (mapped == MAP_FAILED) {
    const int error = errno;
    if (error == ENOMEM || error == EAGAIN) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "shmem: mapping a peer's region of ", map_length, " bytes: ", std::strerror(error),
          " (this process is out of memory or address space; check ulimit -v)"));
    }
    return absl::UnavailableError(absl::StrCat("shmem: mapping a peer's region of ", map_length,
                                               " bytes: ", std::strerror(error)));
  }
  // Device copies may still be moving bytes through a mapping: none goes while they run.
  if (mappings_.size() >= kMaxMappingsPerEndpoint && may_evict) {
    auto oldest = std::min_element(
        mappings_.begin(), mappings_.end(),
        [](const auto& a, const auto& b) { return a.second.order < b.second.order; });
    Unmap(oldest->second);
    for (uint8_t w : oldest->second.windows) populated_windows_ -= w != kUnpopulated ? 1 : 0;
    mappings_.erase(oldest);
  }
  Counters().regions_mapped.fetch_add(1, std::memory_order_relaxed);
  const uint64_t local_base = reinterpret_cast<uint64_t>(mapped) + (key.offset - start);
  Mapping& m = mappings_[key.region];
  m = Mapping{mapped,
              map_length,
              local_base - key.base,
              key,
              writable,
              ++mapping_order_,
              false,
              start,
              std::vector<uint8_t>((map_length + kWindowBytes - 1) / kWindowBytes, kUnpopulated)};
  Populate(m, addr, length, may_evict);
  return &m;
}

void PeerMappings::Populate(Mapping& m, uint64_t addr, uint64_t length, bool may_release) {
  if (length == 0) return;
  // The range as offsets into the mapping (the caller checked it lies inside the key's).
  const uint64_t first = (addr - m.key.base + (m.key.offset - m.start)) / kWindowBytes;
  const uint64_t last = (addr + length - 1 - m.key.base + (m.key.offset - m.start)) / kWindowBytes;
  for (uint64_t w = first; w <= last && w < m.windows.size(); ++w) {
    if (m.windows[w] != kUnpopulated) {
      m.windows[w] = kTouched;
      continue;
    }
    while (may_release && populated_windows_ >= max_windows_ && ReleaseOne(m, first, last)) {
    }
    m.windows[w] = kTouched;
    ++populated_windows_;
    const uint64_t begin = w * kWindowBytes;
    const uint64_t bytes = std::min<uint64_t>(kWindowBytes, m.map_length - begin);
    // The page tables now, so the copy that follows, and every later one into this window,
    // takes no fault. A kernel without MADV_POPULATE_* (before 5.14) faults them in during the
    // copy instead.
    madvise(static_cast<char*>(m.addr) + begin, bytes,
            m.writable ? MADV_POPULATE_WRITE : MADV_POPULATE_READ);
    Counters().windows_populated.fetch_add(1, std::memory_order_relaxed);
    Counters().bytes_populated.fetch_add(bytes, std::memory_order_relaxed);
  }
}

bool PeerMappings::ReleaseOne(const Mapping& current, uint64_t first, uint64_t last) {
  uint64_t total = 0;
  for (const auto& [id, m] : mappings_) total += m.windows.size() + 1;
  auto it = mappings_.lower_bound(hand_region_);
  uint64_t w = it != mappings_.end() && it->first == hand_region_ ? hand_window_ : 0;
  // Two passes at most: the first may only clear the marks of windows touched since the last.
  for (uint64_t step = 0; step < 2 * total + 1; ++step) {
    if (it == mappings_.end()) {
      if (mappings_.empty()) return false;
      it = mappings_.begin();
      w = 0;
    }
    Mapping& m = it->second;
    // Page-locked for device copies: their DMA relies on these pages staying mapped.
    if (w >= m.windows.size() || m.pinned) {
      ++it;
      w = 0;
      continue;
    }
    const uint64_t at = w++;
    if (m.windows[at] == kUnpopulated || (&m == &current && at >= first && at <= last)) continue;
    if (m.windows[at] == kTouched) {
      m.windows[at] = kPopulated;
      continue;
    }
    const uint64_t begin = at * kWindowBytes;
    madvise(static_cast<char*>(m.addr) + begin,
            std::min<uint64_t>(kWindowBytes, m.map_length - begin), MADV_DONTNEED);
    m.windows[at] = kUnpopulated;
    --populated_windows_;
    Counters().windows_released.fetch_add(1, std::memory_order_relaxed);
    hand_region_ = it->first;
    hand_window_ = w;
    return true;
  }
  return false;
}

void PeerMappings::PinForDevice(Mapping& m) {
  if (m.pinned) return;
  absl::Status pinned = device_->RegisterHost(m.addr, m.map_length);
  if (pinned.ok()) {
    m.pinned = true;
  } else {
    VLOG(1) << "shmem: a peer's region stays pageable for device copies: " << pinned;
  }
}

auto PeerMappings::MapDevice(const PackedKey& key, int device, bool may_evict)
    -> absl::StatusOr<const DeviceMapping*> {
  if (auto it = device_mappings_.find({key.region, device}); it != device_mappings_.end()) {
    const DeviceMapping& m = it->second;
    if (m.key.base != key.base || m.key.length != key.length) {
      return absl::DataLossError(
          "shmem: a remote key describes its device region differently than when it was "
          "imported");
    }
    return &m;
  }
  DeviceRegionReply reply{};
  int fd = -1;
  int nfds = 0;
  RETURN_IF_ERROR(conn_.Ask(kDeviceRegion, key.region, &reply.reply, &fd, 1, &nfds, sizeof(reply)));
  for (int i = 0; i < nfds; ++i) close(fd);
  if (reply.handle_size == 0 || reply.handle_size > kMaxDeviceHandle) {
    return absl::DataLossError("shmem: the peer sent a malformed device handle");
  }
  if (key.length > reply.reply.size) {
    return absl::DataLossError("shmem: a remote key does not fit its device region");
  }
  absl::StatusOr<void*> base =
      device_->Import(device, absl::string_view(reply.handle, reply.handle_size));
  if (!base.ok()) {
    return absl::Status(
        base.status().code(),
        absl::StrCat("shmem: importing the GPU memory of pid ", conn_.peer_pid(),
                     " (its cuda:", reply.device, ") failed: ", base.status().message()));
  }
  if (device_mappings_.size() >= kMaxMappingsPerEndpoint && may_evict) {
    auto first = device_mappings_.begin();
    device_->Close(first->second.device, first->second.base);
    device_mappings_.erase(first);
  }
  Counters().device_regions_imported.fetch_add(1, std::memory_order_relaxed);
  DeviceMapping& m = device_mappings_[{key.region, device}];
  m = DeviceMapping{*base, key, device};
  return &m;
}

void PeerMappings::ReleaseAll() {
  for (auto& [id, m] : mappings_) Unmap(m);
  mappings_.clear();
  populated_windows_ = 0;
  for (auto& [id, m] : device_mappings_) device_->Close(m.device, m.base);
  device_mappings_.clear();
}

void PeerMappings::Abandon() {
  mappings_.clear();
  populated_windows_ = 0;
  device_mappings_.clear();
}

void PeerMappings::Unmap(const Mapping& m) {
  if (m.pinned) device_->UnregisterHost(m.addr);
  munmap(m.addr, m.map_length);
}

}  // namespace tensorverbs::fabric::shmem
