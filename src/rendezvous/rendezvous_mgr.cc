#include "src/rendezvous/rendezvous_mgr.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace tensorverbs {

RendezvousMgr::RendezvousMgr(Factory factory, size_t remembered_cleanups, StepEnded step_ended)
    : factory_(std::move(factory)),
      remembered_cleanups_(remembered_cleanups),
      step_ended_(std::move(step_ended)) {}

RendezvousMgr::~RendezvousMgr() { CleanupAll(); }

absl::StatusOr<std::shared_ptr<RemoteRendezvous>> RendezvousMgr::Find(int64_t step_id) {
  MutexLock lock(&mu_);
  auto it = table_.find(step_id);
  if (it != table_.end()) return it->second;
  if (cleaned_.contains(step_id)) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step_id, " was already cleaned up on this task"));
  }
  // Made under the lock (the factories only construct), so that two threads asking for a new
  // step at once (a local Send and a peer's request made ahead) build one rendezvous, not two
  // of which one is thrown away.
  return table_.emplace(step_id, factory_(step_id)).first->second;
}

void RendezvousMgr::Cleanup(int64_t step_id) {
  std::shared_ptr<RemoteRendezvous> r;
  {
    MutexLock lock(&mu_);
    auto it = table_.find(step_id);
    if (it != table_.end()) {
      r = std::move(it->second);
      table_.erase(it);
    }
    if (cleaned_.insert(step_id).second) {
      cleaned_order_.push_back(step_id);
      if (cleaned_order_.size() > remembered_cleanups_) {
        cleaned_.erase(cleaned_order_.front());
        cleaned_order_.pop_front();
      }
    }
  }
  if (r) {
    r->StartAbort(absl::CancelledError(absl::StrCat("step ", step_id, " was cleaned up")));
  } else if (step_ended_) {
    step_ended_(step_id);
  }
}

void RendezvousMgr::CleanupAll() {
  std::vector<std::shared_ptr<RemoteRendezvous>> all;
  {
    MutexLock lock(&mu_);
    for (auto& [id, r] : table_) all.push_back(std::move(r));
    table_.clear();
  }
  for (auto& r : all) {
    r->StartAbort(absl::CancelledError(absl::StrCat("step ", r->step_id(), " was cleaned up")));
  }
}

size_t RendezvousMgr::NumActiveSteps() const {
  MutexLock lock(&mu_);
  return table_.size();
}

}  // namespace tensorverbs
