#include "src/protocol/channel_table.h"

#include <algorithm>
#include <tuple>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "src/common/logging.h"

namespace tensorverbs::protocol {

ChannelTable::ChannelTable(std::function<bool()> on_owner_thread)
    : on_owner_thread_(std::move(on_owner_thread)) {}

void ChannelTable::AssertOnLoop() const {
  DCHECK(on_owner_thread_ == nullptr || on_owner_thread_())
      << "grpc+verbs channel table used off the progress thread";
}

Channel* ChannelTable::Add(std::unique_ptr<Channel> channel) {
  AssertOnLoop();
  Channel* raw = channel.get();
  by_endpoint_[raw->endpoint()] = raw;
  for (fabric::Endpoint* lane : raw->FurtherLaneEndpoints()) by_endpoint_[lane] = raw;
  if (raw->role() == Channel::Role::kOwner) owner_by_task_[raw->peer_task()] = raw->id();
  MutexLock lock(&probe_mu_);
  channels_.emplace(raw->id(), std::move(channel));
  return raw;
}

ChannelTable::ProbeAnswer ChannelTable::ProbeOwned(const std::string& task, uint64_t id) const {
  MutexLock lock(&probe_mu_);
  auto it = channels_.find(id);
  if (it != channels_.end() && it->second->role() == Channel::Role::kOwner &&
      it->second->peer_task() == task) {
    const Channel& owned = *it->second;
    if (!owned.ClosedForProbes()) return {true, "", false, owned.MessagesReceivedForProbes()};
    return {false, std::string(owned.close_status().message()),
            owned.close_status().code() == absl::StatusCode::kCancelled};
  }
  return {false, "no such channel (it was closed and replaced, or this task restarted)"};
}

ChannelTable::ProbeAnswer ChannelTable::ProbeAccepted(const std::string& task,
                                                      uint64_t peer_channel_id) const {
  MutexLock lock(&probe_mu_);
  if (const Channel* c = FindAccepted(task, peer_channel_id)) {
    if (!c->ClosedForProbes()) return {true, "", false, c->MessagesReceivedForProbes()};
    return {false, std::string(c->close_status().message())};
  }
  if (const absl::Status* why = WhyAcceptedClosed(task, peer_channel_id)) {
    return {false, std::string(why->message())};
  }
  return {false, "no such channel (this task restarted?)"};
}

Channel* ChannelTable::Find(uint64_t id) const {
  AssertOnLoop();
  auto it = channels_.find(id);
  return it == channels_.end() ? nullptr : it->second.get();
}

ReceivingSide* ChannelTable::FindReceiving(uint64_t id) const {
  Channel* c = Find(id);
  return c != nullptr ? c->receiving() : nullptr;
}

SendingSide* ChannelTable::FindSending(uint64_t id) const {
  Channel* c = Find(id);
  return c != nullptr ? c->sending() : nullptr;
}

Channel* ChannelTable::OwnerFor(const std::string& task) const {
  auto it = owner_by_task_.find(task);
  if (it == owner_by_task_.end()) return nullptr;
  Channel* c = Find(it->second);
  return c != nullptr && c->state() != Channel::State::kClosed ? c : nullptr;
}

Channel* ChannelTable::AcceptedFrom(const std::string& task, uint64_t peer_channel_id) const {
  AssertOnLoop();
  return FindAccepted(task, peer_channel_id);
}

Channel* ChannelTable::FindAccepted(const std::string& task, uint64_t peer_channel_id) const {
  for (const auto& [id, c] : channels_) {
    if (c->role() == Channel::Role::kAcceptor && c->peer_task() == task &&
        c->peer_channel_id() == peer_channel_id) {
      return c.get();
    }
  }
  return nullptr;
}

const absl::Status* ChannelTable::WhyAcceptedClosed(const std::string& task,
                                                    uint64_t peer_channel_id) const {
  auto it = closed_accepted_.find({task, peer_channel_id});
  return it == closed_accepted_.end() ? nullptr : &it->second;
}

void ChannelTable::CloseAcceptedFrom(const std::string& task, uint64_t incarnation,
                                     const Channel* keep) {
  AssertOnLoop();
  for (auto& [id, other] : channels_) {
    if (other.get() == keep || other->role() != Channel::Role::kAcceptor ||
        other->peer_task() != task) {
      continue;
    }
    if (other->peer_incarnation() != incarnation) {
      other->Close(absl::AbortedError(absl::StrCat("task ", task, " restarted")));
    } else {
      other->Close(absl::CancelledError(absl::StrCat("task ", task, " replaced the channel")));
    }
  }
}

void ChannelTable::NoteLaneFailed(const std::string& task, size_t lane, absl::Time now,
                                  absl::Duration base) {
  AssertOnLoop();
  if (lane == 0) return;
  LaneLimit& limit = lane_limits_[task];
  // A failure while the last back-off still ran (or just after it) doubles it; a lane that
  // stayed up long after starts over.
  const bool repeat = limit.backoff > absl::ZeroDuration() && now < limit.until + limit.backoff;
  limit.backoff = repeat ? std::min(limit.backoff * 2, kLaneBackoffLimit)
                         : std::min(base * 2, kLaneBackoffLimit);
  limit.further_lanes = now < limit.until ? std::min(limit.further_lanes, lane - 1) : lane - 1;
  limit.until = now + limit.backoff;
  LOG(WARNING) << "lane " << lane << " of the channels with task " << task
               << " failed; they keep to " << limit.further_lanes + 1 << " lane"
               << (limit.further_lanes == 0 ? "" : "s") << " for "
               << absl::FormatDuration(limit.backoff) << ", then probe every lane again";
}

size_t ChannelTable::FurtherLanesFor(const std::string& task, size_t lanes, absl::Time now) const {
  auto it = lane_limits_.find(task);
  if (it == lane_limits_.end() || now >= it->second.until) return lanes;
  return std::min(lanes, it->second.further_lanes);
}

void ChannelTable::Dispatch(const fabric::Completion& c) {
  AssertOnLoop();
  auto it = by_endpoint_.find(c.endpoint);
  if (it != by_endpoint_.end()) it->second->OnCompletion(c);
}

void ChannelTable::Housekeeping(absl::Time now, const std::function<bool(uint64_t)>& pinned) {
  AssertOnLoop();
  std::vector<uint64_t> closed;
  std::vector<Channel*> idle;
  std::vector<Channel*> lanes_back;
  for (auto& [id, channel] : channels_) {
    if (channel->state() == Channel::State::kClosed) {
      closed.push_back(id);
      continue;
    }
    if (ReceivingSide* r = channel->receiving()) {
      r->ExpireRequests(now);
      channel->CheckLanes(now);
      if (channel->state() == Channel::State::kClosed) continue;
    } else {
      channel->sending()->ExpireResponses(now);
    }
    // An idle channel's owner gives it back; its acceptor waits for a probe to find the
    // owner's end gone (PeerChannels::PendingPeers), so that it never drops a channel its
    // owner is about to use.
    if (channel->NoteIdle(now) && channel->role() == Channel::Role::kOwner) {
      idle.push_back(channel.get());
    } else if (channel->WantsLanesBack(
                   now, FurtherLanesFor(channel->peer_task(), channel->env()->lanes.size(), now))) {
      lanes_back.push_back(channel.get());
    }
  }
  for (Channel* channel : idle) {
    VLOG(1) << channel->Describe() << " idle: given back";
    channel->Close(absl::CancelledError(absl::StrCat(
        "idle for ", absl::FormatDuration(channel->env()->options.idle_close),
        " (TENSORVERBS_CHANNEL_IDLE_MS) and given back; the next recv sets it up again")));
  }
  for (Channel* channel : lanes_back) {
    // Given back as an idle one is: a lane comes back only with a channel whose two ends make
    // their endpoints afresh and probe it (a link that came back must not deliver into memory
    // the taken-out endpoint's writes once aimed at).
    LOG(INFO) << channel->Describe() << ": the back-off after its lane " << channel->lanes()
              << " failed ran out; given back so that the next recv sets "
              << "it up again with every lane, each probed first";
    channel->env()->stats->channels_renewed_for_lanes.fetch_add(1, std::memory_order_relaxed);
    channel->Close(
        absl::CancelledError(absl::StrCat("given back while quiet so that lane ", channel->lanes(),
                                          " comes back; the next recv sets the channel up again")));
  }
  for (uint64_t id : closed) {
    Channel* c = channels_.find(id)->second.get();
    if (c->role() == Channel::Role::kAcceptor) {
      MutexLock lock(&probe_mu_);
      if (closed_accepted_.size() >= kMaxClosedAccepted) closed_accepted_.clear();
      closed_accepted_[{c->peer_task(), c->peer_channel_id()}] = c->close_status();
    }
    absl::erase_if(by_endpoint_, [c](const auto& entry) { return entry.second == c; });
    auto owner = owner_by_task_.find(c->peer_task());
    if (owner != owner_by_task_.end() && owner->second == id) owner_by_task_.erase(owner);
    if (pinned != nullptr && pinned(id)) continue;
    std::unique_ptr<Channel> dropped;
    {
      MutexLock lock(&probe_mu_);
      auto it = channels_.find(id);
      dropped = std::move(it->second);
      channels_.erase(it);
    }
    // Destroyed outside the lock: a channel's destructor may take time (its endpoint, its
    // memory), and a probe waits for nothing but the table.
  }
}

void ChannelTable::AbortStep(int64_t step_id, const absl::Status& status) {
  AssertOnLoop();
  for (auto& [id, channel] : channels_) {
    if (ReceivingSide* r = channel->receiving()) r->AbortStep(step_id, status);
  }
}

void ChannelTable::CloseAll(const absl::Status& status) {
  AssertOnLoop();
  for (auto& [id, c] : channels_) c->Close(status);
}

void ChannelTable::Clear() {
  absl::flat_hash_map<uint64_t, std::unique_ptr<Channel>> dropped;
  {
    MutexLock lock(&probe_mu_);
    dropped.swap(channels_);
  }
  dropped.clear();
  by_endpoint_.clear();
  owner_by_task_.clear();
}

bool ChannelTable::OperationsInFlight() const {
  // By channel: a closed channel's endpoint is gone while by_endpoint_ still names it.
  for (const auto& [id, channel] : channels_) {
    for (size_t lane = 0; lane < channel->lanes(); ++lane) {
      fabric::Endpoint* endpoint = channel->lane_endpoint(lane);
      if (endpoint != nullptr && endpoint->Outstanding() > 0) return true;
    }
  }
  return false;
}

bool ChannelTable::AwaitingPeers() const {
  for (const auto& [id, c] : channels_) {
    if (c->state() == Channel::State::kReady && c->receiving() != nullptr &&
        c->receiving()->awaiting_peer()) {
      return true;
    }
  }
  return false;
}

bool ChannelTable::ResponsesInProgress() const {
  for (const auto& [id, c] : channels_) {
    if (c->sending() != nullptr && c->sending()->responses_in_progress() > 0) return true;
  }
  return false;
}

size_t ChannelTable::NumReady() const {
  AssertOnLoop();
  size_t n = 0;
  for (const auto& [id, c] : channels_) n += c->state() == Channel::State::kReady;
  return n;
}

bool ChannelTable::HasOpenChannelWith(const std::string& task) const {
  AssertOnLoop();
  for (const auto& [id, c] : channels_) {
    if (c->peer_task() == task && c->state() != Channel::State::kClosed) return true;
  }
  return false;
}

std::vector<ChannelSnapshot> ChannelTable::Snapshot() const {
  AssertOnLoop();
  std::vector<ChannelSnapshot> out;
  out.reserve(channels_.size());
  for (const auto& [id, channel] : channels_) out.push_back(channel->Snapshot());
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return std::tie(a.peer_task, a.receives) < std::tie(b.peer_task, b.receives);
  });
  return out;
}

}  // namespace tensorverbs::protocol
