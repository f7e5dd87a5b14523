#include "src/transport/verbs/lent_tensors.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"

namespace tensorverbs::verbs {

absl::StatusOr<protocol::RemoteTensorRef> LentTensors::Lend(const std::string& requester,
                                                            const Tensor& tensor,
                                                            absl::Time expires) {
  if (lent_.size() >= static_cast<size_t>(env_->max_responses)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        lent_.size(), " tensors are lent already (TENSORVERBS_MAX_RESPONSES=", env_->max_responses,
        "); this one goes inline"));
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
  ++per_task_[requester];
  env_->stats->content_writes.fetch_add(1, std::memory_order_relaxed);
  return ref;
}

void LentTensors::Release(const std::string& task, uint32_t tensor_key) {
  auto it = lent_.find(tensor_key);
  if (it == lent_.end() || it->second.requester != task) {
    env_->stats->dropped_imms.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  Forget(it);
}

void LentTensors::EndLeasesOf(const std::string& task) {
  std::vector<Tensor> memory;
  for (auto it = lent_.begin(); it != lent_.end();) {
    if (it->second.requester == task) {
      memory.push_back(std::move(it->second.tensor));
      it = Forget(it);
    } else {
      ++it;
    }
  }
  if (!memory.empty() && env_->quarantine_memory) {
    env_->quarantine_memory(std::move(memory), absl::Now() + env_->quarantine);
  }
}

bool LentTensors::LendsTo(const std::string& task) const { return per_task_.contains(task); }

absl::flat_hash_map<uint32_t, LentTensors::Lent>::iterator LentTensors::Forget(
    absl::flat_hash_map<uint32_t, Lent>::iterator it) {
  auto count = per_task_.find(it->second.requester);
  if (count != per_task_.end() && --count->second == 0) per_task_.erase(count);
  auto next = std::next(it);
  lent_.erase(it);
  return next;
}

void LentTensors::Expire(absl::Time now) {
  for (auto it = lent_.begin(); it != lent_.end();) {
    if (it->second.expires <= now) {
      it = Forget(it);
    } else {
      ++it;
    }
  }
}

}  // namespace tensorverbs::verbs
