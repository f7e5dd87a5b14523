#include "src/transport/verbs/lent_tensors.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"

namespace tensorverbs::verbs {

absl::StatusOr<protocol::RemoteTensorRef> LentTensors::Lend(const std::string& requester,
                                                            const Tensor& tensor,
                                                            absl::Time expires) {
  if (lent_.size() >= static_cast<size_t>(env_->transfer.max_responses)) {
    return absl::ResourceExhaustedError(
        absl::StrCat(lent_.size(), " tensors are lent already (TENSORVERBS_MAX_RESPONSES=",
                     env_->transfer.max_responses, "); this one goes inline"));
  }
  const size_t bytes = tensor.TotalBytes();
  Tensor source = tensor;
  ASSIGN_OR_RETURN(const fabric::MemoryRegion* region,
                   env_->memory->FindRegistered(tensor.data(), bytes));
  if (region == nullptr) {
    // Not pool memory: lend a registered copy.
    ASSIGN_OR_RETURN(source, env_->memory->StageCopyOf(tensor.data(), bytes, &region));
    env_->CountCopy(bytes);
  }
  // The space holds billions of keys and at most max_responses are live: a free one is found
  // in a draw or two.
  uint32_t key = absl::Uniform<uint32_t>(absl::IntervalClosed, random_, 0, protocol::kMaxTensorKey);
  while (lent_.contains(key)) {
    key = absl::Uniform<uint32_t>(absl::IntervalClosed, random_, 0, protocol::kMaxTensorKey);
  }
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
}

void LentTensors::EndLeasesOf(const std::string& task) {
  std::vector<Tensor> memory;
  absl::erase_if(lent_, [&](auto& entry) {
    if (entry.second.requester != task) return false;
    memory.push_back(std::move(entry.second.tensor));
    return true;
  });
  if (!memory.empty() && env_->host != nullptr) {
    env_->host->Quarantine(std::move(memory), absl::Now() + env_->quarantine());
  }
}

absl::flat_hash_set<std::string> LentTensors::Borrowers() const {
  absl::flat_hash_set<std::string> tasks;
  for (const auto& [key, lent] : lent_) tasks.insert(lent.requester);
  return tasks;
}

void LentTensors::Expire(absl::Time now) {
  absl::erase_if(lent_, [now](const auto& entry) { return entry.second.expires <= now; });
}

}  // namespace tensorverbs::verbs
