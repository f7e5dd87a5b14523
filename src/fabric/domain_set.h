// DomainSet: several opened domains that one progress thread drives as one, so a task can reach
// each peer over the fabric that suits it (the same-host shmem fabric for tasks on its host,
// ibverbs or libfabric for the others) with one loop.
//
// The set is what the progress engine polls and sleeps on: Poll takes completions from every
// member (starting at the next member each call, so a busy one cannot starve the others), Wait
// sleeps on all of their wake-ups at once (Domain::PrepareToSleep), and Interrupt wakes it from
// any thread. Memory and endpoints belong to one member, which the caller picks per peer: the
// set's own RegisterMemory, CreateEndpoint and capabilities are its first member's. It does not
// own the members, which outlive it; same threading contract as any Domain.
#ifndef TENSORVERBS_FABRIC_DOMAIN_SET_H_
#define TENSORVERBS_FABRIC_DOMAIN_SET_H_

#include <memory>
#include <vector>

#include "src/fabric/fabric.h"

namespace tensorverbs::fabric {

class DomainSet final : public Domain {
 public:
  // `members`: at least one, none null.
  explicit DomainSet(std::vector<Domain*> members);

  const std::vector<Domain*>& members() const { return members_; }

  const Capabilities& capabilities() const override { return members_[0]->capabilities(); }
  absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemory(void* addr, size_t length,
                                                               uint32_t access) override {
    return members_[0]->RegisterMemory(addr, length, access);
  }
  absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemoryFor(Endpoint& endpoint, void* addr,
                                                                  size_t length,
                                                                  uint32_t access) override {
    return members_[0]->RegisterMemoryFor(endpoint, addr, length, access);
  }
  absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterDeviceMemory(void* addr, size_t length,
                                                                     int device,
                                                                     uint32_t access) override {
    return members_[0]->RegisterDeviceMemory(addr, length, device, access);
  }
  absl::StatusOr<std::unique_ptr<Endpoint>> CreateEndpoint() override {
    return members_[0]->CreateEndpoint();
  }

  absl::StatusOr<size_t> Poll(absl::Span<Completion> out) override;
  absl::Status Wait(absl::Duration timeout) override;
  void Interrupt() override;
  absl::StatusOr<bool> PrepareToSleep(std::vector<pollfd>* fds, absl::Duration* timeout) override;
  void FinishSleep(absl::Span<const pollfd> fds) override;

 private:
  const std::vector<Domain*> members_;
  size_t next_ = 0;  // the member Poll starts at
  // Where each member's fds end in the span PrepareToSleep filled (nested sets).
  std::vector<size_t> ends_;
  size_t first_fd_ = 0;
};

}  // namespace tensorverbs::fabric

#endif  // TENSORVERBS_FABRIC_DOMAIN_SET_H_
