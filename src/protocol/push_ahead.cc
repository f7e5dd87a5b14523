#include "src/protocol/push_ahead.h"

#include "src/protocol/memory_mgr.h"

namespace tensorverbs::protocol {

PushAhead::KeyState* PushAhead::StateOf(const KeyRef& key) {
  if (auto it = keys_.find(key); it != keys_.end()) return &it->second;
  if (keys_.size() >= kMaxKeys) return nullptr;
  return &keys_[key];
}

PushAhead::KeyState* PushAhead::Find(const KeyRef& key) {
  auto it = keys_.find(key);
  return it == keys_.end() ? nullptr : &it->second;
}

std::optional<uint64_t> PushAhead::Plan(const KeyState& state, const KeyRef& key,
                                        Allocator* allocator, const RdmaMemoryMgr& memory) const {
  if (state.active > 0 || state.pushed != kNoPush) return std::nullopt;
  // Destinations pushed ahead are host memory only: a recv that adopts one gets a host tensor,
  // which the rendezvous moves to the device if the recv wanted it there.
  if (allocator != nullptr && !allocator->Placement().host_accessible()) return std::nullopt;
  const TensorMetaData* meta = memory.CachedMeta(key->key.full_key);
  if (meta == nullptr || meta->is_dead || meta->dtype == DataType::kString ||
      meta->tensor_bytes > kMaxPushedTensorBytes) {
    return std::nullopt;
  }
  if (requests_ >= budget_.max_requests || bytes_ + meta->tensor_bytes > budget_.max_bytes) {
    return std::nullopt;
  }
  return meta->tensor_bytes;
}

void PushAhead::Made(KeyState* state, uint32_t index, uint64_t bytes) {
  state->pushed = index;
  ++requests_;
  bytes_ += bytes;
}

void PushAhead::Unmade(const KeyRef& key, uint32_t index, uint64_t bytes) {
  if (auto it = keys_.find(key); it != keys_.end() && it->second.pushed == index) {
    it->second.pushed = kNoPush;
  }
  --requests_;
  bytes_ -= bytes;
}

void LandedStore::Keep(const std::string& peer_task, const std::string& key, int64_t step,
                       Tensor tensor, absl::Time until) {
  landed_.insert_or_assign({peer_task, key, step}, std::pair{std::move(tensor), until});
}

std::optional<Tensor> LandedStore::Take(const std::string& peer_task, const std::string& key,
                                        int64_t step) {
  if (landed_.empty()) return std::nullopt;
  auto it = landed_.find({peer_task, key, step});
  if (it == landed_.end()) return std::nullopt;
  Tensor tensor = std::move(it->second.first);
  landed_.erase(it);
  return tensor;
}

void LandedStore::DropStep(int64_t step) {
  std::erase_if(landed_, [step](const auto& e) { return std::get<2>(e.first) == step; });
}

void LandedStore::Expire(absl::Time now) {
  std::erase_if(landed_, [now](const auto& e) { return e.second.second <= now; });
}

}  // namespace tensorverbs::protocol
