// ShmemRegion: memory registered with a shmem domain (shmem.cc's RegisterMemory and
// RegisterDeviceMemory make them; endpoints read a local buffer's device from it). Its key
// names the domain, the region and whether it is shared memory or GPU memory; destroying it
// takes the region out of the domain's table (under DomainState::mu), so the descriptor server
// hands it out no more. Any thread.
#ifndef TENSORVERBS_FABRIC_SHMEM_REGION_H_
#define TENSORVERBS_FABRIC_SHMEM_REGION_H_

#include <unistd.h>

#include <cstdint>
#include <memory>
#include <utility>

#include "absl/strings/string_view.h"
#include "src/common/mutex.h"
#include "src/fabric/fabric.h"
#include "src/fabric/shmem/domain_state.h"
#include "src/fabric/shmem/wire.h"

namespace tensorverbs::fabric::shmem {

class ShmemRegion final : public MemoryRegion {
 public:
  ShmemRegion(std::shared_ptr<DomainState> d, uint64_t id, void* base, size_t length,
              uint32_t access, bool shared, uint64_t offset, int device = -1)
      : MemoryRegion(base, length),
        d_(std::move(d)),
        id_(id),
        access_(access),
        shared_(shared),
        offset_(offset),
        device_(device) {}
  ~ShmemRegion() override {
    MutexLock lock(&d_->mu);
    auto it = d_->regions.find(id_);
    if (it != d_->regions.end()) {
      if (it->second.fd >= 0) close(it->second.fd);
      d_->regions.erase(it);
    }
  }
  // The GPU the region is on, or -1 for host memory.
  int device() const { return device_; }
  bool shared() const { return shared_; }
  uint64_t id() const { return id_; }
  RemoteKey PackRemoteKey() const override {
    const PackedKey k = Key();
    return RemoteKey(absl::string_view(reinterpret_cast<const char*>(&k), sizeof(k)));
  }
  PackedKey Key() const {
    return PackedKey{kKeyMagic,
                     (shared_ ? kKeyShared : 0u) | (device_ >= 0 ? kKeyDevice : 0u),
                     d_->uid,
                     id_,
                     reinterpret_cast<uint64_t>(base()),
                     length(),
                     offset_,
                     access_,
                     device_ >= 0 ? static_cast<uint32_t>(device_) : 0u};
  }

 private:
  std::shared_ptr<DomainState> d_;
  const uint64_t id_;
  const uint32_t access_;
  const bool shared_;
  const uint64_t offset_;
  const int device_;
};

}  // namespace tensorverbs::fabric::shmem

#endif  // TENSORVERBS_FABRIC_SHMEM_REGION_H_
