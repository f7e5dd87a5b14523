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
  if (it != table_.end()) {
    peer_steps_.erase(step_id);  // taken up: this task runs it now
    return it->second;
  }
  if (cleaned_.contains(step_id)) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step_id, " was already cleaned up on this task"));
  }
  // Made under the lock (the factories only construct), so that two threads asking for a new
  // step at once (a local Send and a peer's request made ahead) build one rendezvous, not two
  // of which one is thrown away.
  return table_.emplace(step_id, factory_(step_id)).first->second;
}

absl::StatusOr<std::shared_ptr<RemoteRendezvous>> RendezvousMgr::FindForPeer(int64_t step_id) {
  std::vector<std::shared_ptr<RemoteRendezvous>> expired;
  absl::StatusOr<std::shared_ptr<RemoteRendezvous>> result;
  absl::Duration expiry;
  {
    MutexLock lock(&mu_);
    auto it = table_.find(step_id);
    if (it != table_.end()) return it->second;
    if (cleaned_.contains(step_id)) {
      return absl::FailedPreconditionError(
          absl::StrCat("step ", step_id, " was already cleaned up on this task"));
    }
    // Expire, oldest first, the peer-made steps this task never took up.
    const absl::Time now = absl::Now();
    expiry = peer_limits_.expiry;
    while (!peer_order_.empty()) {
      const auto [old_step, made] = peer_order_.front();
      auto p = peer_steps_.find(old_step);
      if (p != peer_steps_.end() && p->second == made) {
        if (now - made < expiry) break;
        peer_steps_.erase(p);
        if (auto t = table_.find(old_step); t != table_.end()) {
          expired.push_back(std::move(t->second));
          table_.erase(t);
        }
      }
      peer_order_.pop_front();
    }
    if (peer_steps_.size() >= peer_limits_.max_steps) {
      result = absl::ResourceExhaustedError(
          absl::StrCat("this task has ", peer_steps_.size(),
                       " steps that only peers' requests started (TENSORVERBS_MAX_PEER_STEPS=",
                       peer_limits_.max_steps, "), so a request for step ", step_id,
                       " is refused: a peer runs that far ahead of this task, or is faulty"));
    } else {
      result = table_.emplace(step_id, factory_(step_id)).first->second;
      peer_steps_.emplace(step_id, now);
      peer_order_.emplace_back(step_id, now);
      if (peer_order_.size() > 2 * peer_steps_.size() + 1024) {
        // Entries of steps taken up since, held behind an older live one: drop them.
        std::deque<std::pair<int64_t, absl::Time>> live;
        for (const auto& entry : peer_order_) {
          auto p = peer_steps_.find(entry.first);
          if (p != peer_steps_.end() && p->second == entry.second) live.push_back(entry);
        }
        peer_order_ = std::move(live);
      }
    }
  }
  for (auto& r : expired) {
    r->StartAbort(absl::DeadlineExceededError(
        absl::StrCat("step ", r->step_id(),
                     " was started by peers' requests and this task did not run it within ",
                     absl::FormatDuration(expiry))));
  }
  return result;
}

void RendezvousMgr::SetPeerStepLimits(PeerStepLimits limits) {
  MutexLock lock(&mu_);
  peer_limits_ = limits;
}

size_t RendezvousMgr::NumPeerSteps() const {
  MutexLock lock(&mu_);
  return peer_steps_.size();
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
    peer_steps_.erase(step_id);
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
    peer_steps_.clear();
    peer_order_.clear();
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
