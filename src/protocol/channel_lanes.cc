// The Channel's lanes (channel.h, "Lanes"): their endpoints and agreement at set-up, the keys
// and registrations they offer, their probes, and taking a failed one out. Split from
// channel.cc, which keeps the channel's life and its completions; same object, same thread.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "src/common/coarse_clock.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"
#include "src/protocol/channel.h"
#include "src/protocol/channel_table.h"
#include "src/protocol/stripes.h"

namespace tensorverbs::protocol {

size_t Channel::LaneOf(const fabric::Endpoint* endpoint) const {
  for (size_t i = 0; i < lanes_.size(); ++i) {
    if (lanes_[i].get() == endpoint) return i + 1;
  }
  return 0;
}

std::vector<fabric::Endpoint*> Channel::FurtherLaneEndpoints() const {
  std::vector<fabric::Endpoint*> out;
  for (const auto& ep : lanes_) {
    if (ep != nullptr) out.push_back(ep.get());
  }
  return out;
}

absl::Status Channel::ConnectLanes(const std::vector<std::string>& peer_addresses) {
  AssertOwnerThread();
  size_t n = std::min(peer_addresses.size(), lanes_.size());
  for (size_t i = 0; i < n; ++i) {
    if (lanes_[i] == nullptr) return absl::FailedPreconditionError("the channel is closed");
    if (absl::Status s = lanes_[i]->Connect(peer_addresses[i]); !s.ok()) {
      // The lanes before it serve: the acceptor lists only the lanes it connected, and the
      // owner offers keys only on its own, so both ends use the lanes both connected.
      LaneFailed(i + 1, s);
      n = i;
      break;
    }
  }
  lanes_connected_ = n;
  lanes_agreed_ = n;
  if (peer_addresses.size() != lanes_.size()) {
    LOG(INFO) << Describe() << ": task " << peer_task_ << " has " << peer_addresses.size() + 1
              << " lanes and this task " << lanes_.size() + 1 << "; the channel uses " << n + 1;
  }
  return absl::OkStatus();
}

void Channel::LaneFailed(size_t lane, const absl::Status& status) {
  LOG(WARNING) << "task " << peer_task_ << ": lane " << lane << " (" << env_->lanes[lane - 1].source
               << ") cannot serve a channel: " << status.message()
               << "; the channel goes on with the lanes before it";
  if (env_->channels != nullptr) {
    env_->channels->NoteLaneFailed(peer_task_, lane, absl::Now(), env_->transfer.peer_timeout);
  }
}

std::vector<fabric::Endpoint*> Channel::AgreedLaneEndpoints() const {
  std::vector<fabric::Endpoint*> out;
  for (size_t i = 0; i < lanes_connected_ && i < lanes_.size(); ++i) out.push_back(lanes_[i].get());
  return out;
}

absl::StatusOr<fabric::RemoteKey> Channel::OfferLaneKey(size_t lane, const void* addr,
                                                        uint64_t bytes) {
  if (lane == 0 || lane > lanes_connected_ || lanes_[lane - 1] == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(Describe(), " has no lane ", lane));
  }
  const fabric::MemoryRegion* region = LaneRegion(lane, addr, bytes);
  if (region == nullptr) {
    return absl::NotFoundError(absl::StrCat("lane ", lane, " has no registration of the memory"));
  }
  return env_->lanes[lane - 1].memory->RemoteKeyFor(*lanes_[lane - 1], *region);
}

const fabric::MemoryRegion* Channel::LaneRegion(size_t lane, const void* addr,
                                                uint64_t bytes) const {
  RdmaMemoryMgr* memory = env_->lanes[lane - 1].memory;
  if (memory == nullptr) return nullptr;
  absl::StatusOr<const fabric::MemoryRegion*> region = memory->FindRegistered(addr, bytes);
  return region.ok() ? *region : nullptr;
}

absl::StatusOr<Channel::LaneProbe> Channel::LaneProbeTarget(size_t lane) {
  if (!probe_words_.IsInitialized()) {
    return absl::NotFoundError("the channel has no probe word in the pool");
  }
  // Before the lanes are connected too: an owner lists its probe words in its first message.
  if (lane == 0 || lane > lanes_.size() || lanes_[lane - 1] == nullptr) {
    return absl::NotFoundError(absl::StrCat(Describe(), " has no lane ", lane));
  }
  const fabric::MemoryRegion* region = LaneRegion(lane, probe_words_.data(), sizeof(uint64_t));
  if (region == nullptr) {
    return absl::NotFoundError(absl::StrCat("lane ", lane, " has no registration of the pool"));
  }
  ASSIGN_OR_RETURN(fabric::RemoteKey key,
                   env_->lanes[lane - 1].memory->RemoteKeyFor(*lanes_[lane - 1], *region));
  return LaneProbe{reinterpret_cast<uint64_t>(probe_words_.data()), std::move(key)};
}

void Channel::ProbeLanes() {
  AssertOwnerThread();
  for (size_t lane = 1; lane <= lanes_connected_; ++lane) PostLaneProbe(lane);
}

void Channel::PostLaneProbe(size_t lane) {
  if (state_ == State::kClosed || lane > lanes_connected_ || lanes_[lane - 1] == nullptr) return;
  const absl::Status s = [&]() -> absl::Status {
    if (lane > peer_probes_.size() || peer_probes_[lane - 1].key.empty()) {
      return absl::NotFoundError("the peer gave no probe word for it");
    }
    if (!probe_words_.IsInitialized()) return absl::NotFoundError("no probe word here");
    auto* source = static_cast<uint8_t*>(probe_words_.data()) + sizeof(uint64_t);
    const fabric::MemoryRegion* region = LaneRegion(lane, source, sizeof(uint64_t));
    if (region == nullptr) return absl::NotFoundError("the lane has no registration of the pool");
    const LaneProbe& to = peer_probes_[lane - 1];
    return lanes_[lane - 1]->PostWriteWithImm({region, source, sizeof(uint64_t)},
                                              {to.key, to.addr, sizeof(uint64_t)}, kImmLaneProbe,
                                              MakeContext(OpTag::kAck, lane));
  }();
  if (s.ok()) return;
  TakeLanesOut(
      lane, absl::UnavailableError(absl::StrCat("lane ", lane, " (", env_->lanes[lane - 1].source,
                                                ") of the channel with task ", peer_task_,
                                                " cannot be probed: ", s.message())));
}

void Channel::OnLaneProbe(size_t lane) {
  if (lane == 0 || lane > lanes_connected_) return;
  lane_heard_[lane] = CoarseNow();
  if (role_ == Role::kAcceptor) {
    PostLaneProbe(lane);  // the echo
  } else if (!lane_probed_[lane]) {
    lane_probed_[lane] = true;
    VLOG(1) << Describe() << ": lane " << lane << " (" << env_->lanes[lane - 1].source
            << ") answered its probe";
  }
}

size_t Channel::striping_lanes() const {
  size_t n = 1;
  while (n <= lanes_connected_ && lane_probed_[n]) ++n;
  return n;
}

void Channel::NoteLaneRates(const std::array<double, kMaxLanes>& rates) {
  for (size_t k = 0; k < kMaxLanes; ++k) {
    if (!(rates[k] > 0)) continue;
    // A quarter from the latest tensor: a lane whose link slowed (or sped up) loses (or wins
    // back) its share within a few tensors, while one odd measurement (a tensor that queued
    // behind another on one lane) moves it little. Averaged as time per byte, so that a lane
    // whose segments were seen in one batch (a time near zero, a rate near boundless) moves
    // its figure by a quarter at most, not by orders of magnitude.
    lane_rate_[k] = lane_rate_[k] > 0 ? 4 / (3 / lane_rate_[k] + 1 / rates[k]) : rates[k];
  }
  VLOG(2) << Describe() << ": lanes measured at " << rates[0] / 1e6 << ", " << rates[1] / 1e6
          << ", " << rates[2] / 1e6 << ", " << rates[3] / 1e6 << " MB/s; now "
          << lane_rate_[0] / 1e6 << ", " << lane_rate_[1] / 1e6 << ", " << lane_rate_[2] / 1e6
          << ", " << lane_rate_[3] / 1e6;
}

LaneShares Channel::StripeShares(size_t lanes) {
  if (!env_->options.stripe_by_rate || lanes > kMaxLanes) return LaneShares{};
  const LaneShares wanted = SharesFromRates(absl::MakeConstSpan(lane_rate_.data(), lanes));
  // Shares one apart from those in use are kept: lanes alike, measured a little apart by
  // chance, would otherwise swap a segment back and forth, and one lane's queue grows while
  // the shares catch up with it.
  bool near = wanted[0] != 0 && stripe_shares_[lanes - 1] != 0 &&
              (lanes == kMaxLanes || stripe_shares_[lanes] == 0);
  for (size_t k = 0; k < lanes && near; ++k) {
    near = std::abs(int{wanted[k]} - int{stripe_shares_[k]}) <= 1;
  }
  if (!near) stripe_shares_ = wanted;
  return stripe_shares_;
}

void Channel::CheckLanes(absl::Time now) {
  if (receiving_ == nullptr || lanes_connected_ == 0 || state_ != State::kReady) return;
  const absl::Duration limit = env_->transfer.peer_timeout;
  const size_t lane = receiving_->StalledLane(now, limit);
  if (lane == 0) return;
  TakeLanesOut(lane,
               absl::UnavailableError(absl::StrCat(
                   "lane ", lane, " (", env_->lanes[lane - 1].source, ") of the channel from task ",
                   peer_task_, " brought nothing for ", absl::FormatDuration(limit),
                   " while a tensor's segments were due on it: its link is down or lost "
                   "them")));
}

void Channel::TakeLanesOut(size_t lane, const absl::Status& why) {
  AssertOwnerThread();
  if (state_ == State::kClosed || !closing_.ok() || lane == 0 || lane > lanes_connected_) return;
  const size_t had = lanes_connected_;
  lanes_connected_ = lane - 1;
  env_->stats->lanes_taken_out.fetch_add(1, std::memory_order_relaxed);
  if (env_->channels != nullptr) {
    env_->channels->NoteLaneFailed(peer_task_, lane, absl::Now(), env_->transfer.peer_timeout);
  }
  LOG(WARNING) << Describe() << ": " << why.message() << "; lane " << lane
               << (had > lane ? " and the lanes after it are" : " is") << " taken out and the "
               << "channel goes on over "
               << (lane == 1 ? "lane 0 alone" : absl::StrCat("lanes 0 to ", lane - 1));
  if (receiving_ == nullptr) {
    // The receiver hears it over lane 0, so that it stops offering the lane (its keys would
    // go unused) and its stall check stops counting on it.
    absl::Status s = endpoint_->PostWriteWithImm(mb_->EmptyLocalSource(), mb_->EmptyRemoteTarget(),
                                                 LaneDownImm(lane), MakeContext(OpTag::kAck, 0));
    if (!s.ok()) {
      CloseAfterThisTurn(absl::UnavailableError(absl::StrCat(
          "telling task ", peer_task_, " that lane ", lane, " failed did not go: ", s.message())));
    }
    return;
  }
  // Nothing lands over these lanes any more: a link that comes back must not deliver a write
  // into memory that moved on. The owner's only posts on them are its probes, long done.
  for (size_t i = lane - 1; i < lanes_.size(); ++i) {
    if (lanes_[i] == nullptr) continue;
    if (env_->channels != nullptr) env_->channels->ForgetEndpoint(lanes_[i].get());
    if (env_->lanes[i].memory != nullptr) env_->lanes[i].memory->DropEndpoint(lanes_[i].get());
    lanes_[i].reset();
  }
  std::vector<Tensor> memory;
  receiving_->EndStripedOver(lane, why, &memory);
  if (!memory.empty()) {
    // The lanes that stay may still bring those tensors' other segments.
    env_->host->Quarantine(std::move(memory), absl::Now() + env_->quarantine());
  }
}

bool Channel::WantsLanesBack(absl::Time now, size_t further_lanes_allowed) const {
  return role_ == Role::kOwner && state_ == State::kReady && lanes_connected_ < lanes_agreed_ &&
         further_lanes_allowed > lanes_connected_ && quiet_ && now - idle_since_ >= kLanesBackQuiet;
}

absl::StatusOr<std::unique_ptr<fabric::MemoryRegion>> Channel::RegisterLaneSource(size_t lane,
                                                                                  const void* addr,
                                                                                  uint64_t bytes) {
  RdmaMemoryMgr* memory = env_->lanes[lane - 1].memory;
  if (memory == nullptr) return absl::FailedPreconditionError("the lane's registrations are gone");
  return memory->RegisterSource(addr, bytes);
}

}  // namespace tensorverbs::protocol
