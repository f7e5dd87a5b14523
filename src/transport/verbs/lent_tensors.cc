#include "src/transport/verbs/lent_tensors.h"

#include <utility>

#include "src/common/status_macros.h"

namespace tensorverbs::verbs {

absl::StatusOr<protocol::RemoteTensorRef> LentTensors::Lend(const std::string& requester,
                                                            const Tensor& tensor,
                                                            absl::Time expires) {
  const size_t bytes = tensor.TotalBytes();
  Tensor source = tensor;
  ASSIGN_OR_RETURN(const fabric::MemoryRegion* region,
                   env_->memory->FindRegistered(tensor.data(), bytes));
  if (region == nullptr) {
    // Not pool memory: lend a registered copy.
    ASSIGN_OR_RETURN(source, env_->memory->StageCopyOf(tensor.data(), bytes, &region));
    env_->CountCopy(bytes);
  }
  ASSIGN_OR_RETURN(uint32_t key, keys_.Allocate());
  protocol::RemoteTensorRef ref;
  ref.addr = reinterpret_cast<uint64_t>(source.data());
  ref.key = region->PackRemoteKey().ToString();
  ref.tensor_key = key;
  ref.bytes = bytes;
  lent_[key] = Lent{std::move(source), requester, expires};
  env_->stats->content_writes.fetch_add(1, std::memory_order_relaxed);
  return ref;
}

void LentTensors::Release(const std::string& task, uint32_t tensor_key) {
  auto it = lent_.find(tensor_key);
  if (it == lent_.end() || it->second.requester != task) {
    env_->stats->dropped_imms.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  lent_.erase(it);
  keys_.Release(tensor_key);
}

void LentTensors::Expire(absl::Time now) {
  for (auto it = lent_.begin(); it != lent_.end();) {
    if (it->second.expires <= now) {
      keys_.Release(it->first);
      lent_.erase(it++);
    } else {
      ++it;
    }
  }
}

}  // namespace tensorverbs::verbs
