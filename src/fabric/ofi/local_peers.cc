#include "src/fabric/ofi/local_peers.h"

#include <mutex>

namespace tensorverbs::fabric::ofi {

LocalPeers& LocalPeers::Get() {
  static auto* const peers = new LocalPeers();
  return *peers;
}

std::shared_ptr<LocalPeers::Gate> LocalPeers::Open(const std::string& address) {
  auto gate = std::make_shared<Gate>();
  MutexLock lock(&mu_);
  by_address_[address] = gate;
  return gate;
}

void LocalPeers::Close(const std::string& address, const std::shared_ptr<Gate>& gate) {
  if (gate == nullptr) return;
  {
    std::unique_lock<std::shared_mutex> closing(gate->mu);
    gate->open = false;
  }
  MutexLock lock(&mu_);
  auto it = by_address_.find(address);
  if (it != by_address_.end() && it->second == gate) by_address_.erase(it);
}

std::shared_ptr<LocalPeers::Gate> LocalPeers::Find(absl::string_view address) {
  MutexLock lock(&mu_);
  auto it = by_address_.find(address);
  return it == by_address_.end() ? nullptr : it->second;
}

}  // namespace tensorverbs::fabric::ofi
