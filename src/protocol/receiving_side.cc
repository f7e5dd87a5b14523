#include "src/protocol/receiving_side.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "src/common/coarse_clock.h"
#include "src/common/logging.h"
#include "src/protocol/channel.h"
#include "src/protocol/spare_records.h"

namespace tensorverbs::protocol {

ReceivingSide::ReceivingSide(Channel* channel)
    : channel_(channel),
      env_(channel->env()),
      push_({env_->options.push_max_destinations, env_->options.push_max_bytes}) {}

ReceivingSide::~ReceivingSide() = default;

bool ReceivingSide::closed() const { return channel_->state() == Channel::State::kClosed; }

const std::string& ReceivingSide::peer_task() const { return channel_->peer_task(); }

void ReceivingSide::StartRecv(int64_t step_id, KeyRef key, Allocator* allocator,
                              RecvLanding landing, absl::Time deadline, RecvDoneCallback done) {
  channel_->AssertOwnerThread();
  auto fail = [&](const absl::Status& s) { env_->FailRecv(std::move(done), s); };
  if (closed()) {
    fail(absl::UnavailableError(absl::StrCat("channel to task ", peer_task(), " is closed")));
    return;
  }
  if (key->key.full_key.size() > kMaxNameLength) {
    fail(absl::InvalidArgumentError(
        absl::StrCat("recv of a ", key->key.full_key.size(),
                     "-byte rendezvous key over grpc+verbs: the protocol's "
                     "limit is ",
                     kMaxNameLength, " bytes; use shorter tensor names")));
    return;
  }
  PushAhead::KeyState* state = push_.StateOf(key);
  if (state != nullptr && state->pushed != PushAhead::kNoPush &&
      AdoptPushed(state, step_id, done, landing.quick_callback, deadline, allocator)) {
    return;  // no REQUEST: it went out when the key's previous step completed
  }
  if (absl::Status s = CheckPendingBound("recv"); !s.ok()) {
    fail(s);
    return;
  }
  absl::StatusOr<uint32_t> index = indexes_.Allocate();
  if (!index.ok()) {
    fail(absl::ResourceExhaustedError(
        absl::StrCat("too many pending recvs from task ", peer_task())));
    return;
  }
  if (state != nullptr) ++state->active;
  auto request = RenewRecord(spare_requests_, this, *index, step_id, std::move(key), allocator,
                             deadline, std::move(done));
  // Memory of the caller's that this fabric would never write is given back at once: its owner
  // learns from the release that the recv will not land there. The same-host fabric reaches
  // memory it does not share only by the kernel's cross-memory copy, which a hardened ptrace
  // scope forbids: there the tensor lands in the shared pool.
  if (!env_->domain->capabilities().shared_memory) request->set_into(std::move(landing.into));
  request->set_progress(landing.progress_bytes, std::move(landing.on_landed));
  request->set_quick_callback(landing.quick_callback);
  RdmaTensorRequest* raw = request.get();
  requests_.emplace(*index, std::move(request));
  if (channel_->state() == Channel::State::kReady) {
    raw->Start();
  } else {
    queued_.push_back(*index);
  }
}

void ReceivingSide::StartPull(const RemoteTensorRef& ref, Tensor dest, absl::Time deadline,
                              GdrPull::Done done) {
  channel_->AssertOwnerThread();
  if (closed()) {
    std::move(done)(
        absl::UnavailableError(absl::StrCat("channel to task ", peer_task(), " is closed")));
    return;
  }
  // Beyond the bound on pending reads the read is refused, but the sender holds the tensor for
  // it: the pull goes on without a destination, which only releases it.
  if (absl::Status s = CheckPendingBound("read"); !s.ok() && dest.IsInitialized()) {
    std::move(done)(s);
    dest = Tensor();
    done = [](const absl::Status&) {};
  }
  absl::StatusOr<uint32_t> index = indexes_.Allocate();
  if (!index.ok()) {
    std::move(done)(absl::ResourceExhaustedError(
        absl::StrCat("too many pending reads from task ", peer_task())));
    return;
  }
  pulls_.emplace(*index, std::make_unique<GdrPull>(this, *index, ref, std::move(dest), deadline,
                                                   std::move(done)));
  if (channel_->state() == Channel::State::kReady) {
    IssuePull(*index);
  } else {
    queued_pulls_.push_back(*index);
  }
}

void ReceivingSide::OnReady() {
  std::vector<uint32_t> queued;
  queued.swap(queued_);
  for (uint32_t index : queued) {
    if (closed()) return;  // a REQUEST that failed to go closed the channel
    auto it = requests_.find(index);
    if (it == requests_.end()) continue;
    if (it->second->finished()) {
      FinishRequest(index, RdmaTensorRequest::Event::kAbort);  // never sent: nothing can land
      continue;
    }
    it->second->Start();
  }
  std::vector<uint32_t> pulls;
  pulls.swap(queued_pulls_);
  for (uint32_t index : pulls) {
    if (closed()) return;
    IssuePull(index);
  }
}

absl::Status ReceivingSide::CheckPendingBound(absl::string_view what) const {
  const size_t pending = requests_.size() + pulls_.size();
  if (pending < static_cast<size_t>(env_->options.max_pending_recvs)) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "no ", what, " from task ", peer_task(), ": its channel already has ", pending,
      " recvs and reads pending (TENSORVERBS_MAX_PENDING_RECVS=", env_->options.max_pending_recvs,
      "); wait for earlier recvs, or raise the limit"));
}

void ReceivingSide::IssuePull(uint32_t index) {
  auto it = pulls_.find(index);
  if (it != pulls_.end()) it->second->Issue();
}

void ReceivingSide::OnReadDone(uint32_t index) {
  auto it = pulls_.find(index);
  if (it != pulls_.end()) it->second->OnReadDone();
}

void ReceivingSide::AbortStep(int64_t step_id, const absl::Status& status) {
  channel_->AssertOwnerThread();
  std::vector<uint32_t> unsent, release;
  for (auto& [index, request] : requests_) {
    if (request->step_id() != step_id) continue;
    request->Fail(status);  // a pushed request no recv took is declined
    // Never sent, or pushed content no recv will take: nothing more can land.
    if (request->state() == RdmaTensorRequest::State::kQueued || request->landed()) {
      unsent.push_back(index);
    }
    // Declined while holding the sender's META_DATA_RESPONSE: the sender keeps the tensor
    // until told.
    if (request->needs_release()) release.push_back(index);
  }
  // Never sent: no late content can come, so the record goes now. Sent ones stay until the
  // sender answers (content or ERROR_STATUS) so their memory is not reused under a write.
  for (uint32_t index : unsent) {
    queued_.erase(std::remove(queued_.begin(), queued_.end(), index), queued_.end());
    FinishRequest(index, RdmaTensorRequest::Event::kAbort);
  }
  // One at a time, by index: a failed send closes the channel, which empties the table.
  for (uint32_t index : release) {
    if (closed()) return;
    auto it = requests_.find(index);
    if (it != requests_.end() && it->second->needs_release()) it->second->Release();
  }
  // Aborted recvs waiting for a large destination release the sender's tensor now.
  if (!closed()) GrantWaiting();
}

void ReceivingSide::ExpireRequests(absl::Time now) {
  channel_->AssertOwnerThread();
  const bool connecting = channel_->state() == Channel::State::kConnecting;
  for (auto& [index, request] : requests_) {
    if (request->finished()) continue;
    if (request->deadline() > now) {
      WarnIfSlow(*request, now);
      continue;
    }
    if (connecting) {
      request->Fail(absl::UnavailableError(
          absl::StrCat("recv of '", request->key(), "': the grpc+verbs channel to task ",
                       peer_task(), " at ", channel_->peer_address(),
                       " was not set up before the recv's deadline (is the task running?)")));
      continue;
    }
    request->Fail(absl::DeadlineExceededError(
        absl::StrCat("recv of '", request->key(), "' from task ", peer_task(),
                     " timed out; raise TENSORVERBS_RECV_TIMEOUT_MS if the producer is slow")));
  }
  for (auto& [index, pull] : pulls_) {
    if (pull->finished() || pull->deadline() > now) continue;
    // The record (and its memory) stays until the read completes or the channel closes.
    pull->End(absl::DeadlineExceededError(
        absl::StrCat("reading a tensor from task ", peer_task(),
                     " timed out; raise TENSORVERBS_RECV_TIMEOUT_MS if the network is slow")));
  }
  GrantWaiting();  // expired recvs waiting for a large destination release the sender's tensor
}

void ReceivingSide::WarnIfSlow(RdmaTensorRequest& request, absl::Time now) {
  const absl::Duration slow = env_->transfer.slow_recv_warning;
  if (slow <= absl::ZeroDuration() || request.slow_warned()) return;
  // A recv started at its deadline less the recv timeout (both the transport's).
  const absl::Duration waited = now - (request.deadline() - env_->transfer.recv_timeout);
  if (waited < slow) return;
  request.set_slow_warned();
  LOG(WARNING) << SlowRecvWarning(request.key(), request.step_id(), peer_task(), waited, slow);
}

size_t ReceivingSide::CountRequests(RdmaTensorRequest::State state,
                                    std::optional<RdmaTensorRequest::Owner> owner) const {
  size_t n = 0;
  for (const auto& [index, request] : requests_) {
    n += request->state() == state && (!owner.has_value() || request->owner() == *owner);
  }
  return n;
}

size_t ReceivingSide::CountPulls(GdrPull::State state) const {
  size_t n = 0;
  for (const auto& [index, pull] : pulls_) n += pull->state() == state;
  return n;
}

size_t ReceivingSide::pending_requests() const {
  size_t n = 0;
  for (const auto& [index, request] : requests_) n += !request->finished();
  for (const auto& [index, pull] : pulls_) n += !pull->finished();
  return n;
}

bool ReceivingSide::idle() const {
  if (!pulls_.empty()) return false;
  for (const auto& [index, request] : requests_) {
    if (!request->adoptable()) return false;
  }
  return true;
}

bool ReceivingSide::MayNameLargeDestination(RdmaTensorRequest& r, uint64_t bytes) {
  if (env_->options.large_in_flight == 0 || bytes < env_->options.large_bytes) return true;
  if (large_in_request_ > 0) return false;
  ++large_in_request_;
  r.set_large_slot(RdmaTensorRequest::LargeSlot::kInRequest);
  return true;
}

bool ReceivingSide::GrantLargeDestination(RdmaTensorRequest& r) {
  if (env_->options.large_in_flight == 0 || r.tensor_bytes() < env_->options.large_bytes)
    return true;
  if (large_waiting_.empty() && large_granted_ < env_->options.large_in_flight) {
    ++large_granted_;
    r.set_large_slot(RdmaTensorRequest::LargeSlot::kGranted);
    return true;
  }
  large_waiting_.push_back(r.index());
  return false;
}

void ReceivingSide::ReleaseLargeSlot(RdmaTensorRequest& r) {
  switch (r.large_slot()) {
    case RdmaTensorRequest::LargeSlot::kNone:
      return;
    case RdmaTensorRequest::LargeSlot::kInRequest:
      --large_in_request_;
      break;
    case RdmaTensorRequest::LargeSlot::kGranted:
      --large_granted_;
      break;
  }
  r.set_large_slot(RdmaTensorRequest::LargeSlot::kNone);
}

void ReceivingSide::GrantWaiting() {
  if (large_waiting_.empty()) return;
  // Requests whose recv ended first, wherever they are in the queue: they only release the
  // sender's tensor. One send at a time, each request looked up again: a failed send closes
  // the channel, which empties the table.
  std::vector<uint32_t> ended;
  for (uint32_t index : large_waiting_) {
    auto it = requests_.find(index);
    if (it != requests_.end() && it->second->awaiting_grant() && it->second->finished()) {
      ended.push_back(index);
    }
  }
  for (uint32_t index : ended) {
    if (closed()) return;
    auto it = requests_.find(index);
    if (it != requests_.end() && it->second->awaiting_grant()) it->second->Grant();
  }
  while (!large_waiting_.empty() && !closed()) {
    auto it = requests_.find(large_waiting_.front());
    if (it == requests_.end() || !it->second->awaiting_grant()) {
      large_waiting_.pop_front();  // answered above, or gone
      continue;
    }
    RdmaTensorRequest& r = *it->second;
    if (!r.finished()) {
      if (large_granted_ >= env_->options.large_in_flight) return;
      ++large_granted_;
      r.set_large_slot(RdmaTensorRequest::LargeSlot::kGranted);
    }
    large_waiting_.pop_front();
    r.Grant();
  }
}

void ReceivingSide::FinishRequest(uint32_t index, RdmaTensorRequest::Event why) {
  auto it = requests_.find(index);
  if (it != requests_.end()) {
    RdmaTensorRequest& r = *it->second;
    r.End(why);
    ReleaseLargeSlot(r);
    if (r.pushed_unadopted()) {
      Unpush(r);
      env_->stats->push_unused.fetch_add(1, std::memory_order_relaxed);
    } else if (PushAhead::KeyState* k = push_.Find(r.key_ref())) {
      --k->active;
    }
    finished_requests_.push_back(std::move(it->second));
    requests_.erase(it);
    channel_->ScheduleReap();
  }
  indexes_.Release(index);
}

void ReceivingSide::FinishPull(uint32_t index) {
  auto it = pulls_.find(index);
  if (it != pulls_.end()) {
    finished_pulls_.push_back(std::move(it->second));
    pulls_.erase(it);
    channel_->ScheduleReap();
  }
  indexes_.Release(index);
}

void ReceivingSide::Retire(std::unique_ptr<RdmaTensorRequest> r) {
  r->DropRegistration();  // assignment would give the memory back first
  RetireRecord(spare_requests_, std::move(r),
               RdmaTensorRequest(this, 0, 0, nullptr, nullptr, absl::InfiniteFuture(), nullptr));
}

void ReceivingSide::Reap() {
  // Swapped with a member, not a local: both vectors keep their capacity, so a steady channel
  // allocates nothing to finish its records.
  reaping_.swap(finished_requests_);
  for (auto& r : reaping_) Retire(std::move(r));
  reaping_.clear();
  finished_pulls_.clear();
}

void ReceivingSide::NameKey(const KeyRef& key, Message* m) {
  PushAhead::KeyState* state = push_.StateOf(key);
  if (state != nullptr && state->name_index != kNoNameIndex) {
    m->name_index = state->name_index;
    env_->stats->indexed_requests.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  m->name = key->key.full_key;
  if (state != nullptr) m->name_index = state->name_index = next_name_index_++;
}

void ReceivingSide::Unpush(RdmaTensorRequest& r) {
  push_.Unmade(r.key_ref(), r.index(), r.tensor_bytes());
}

bool ReceivingSide::AdoptPushed(PushAhead::KeyState* state, int64_t step, RecvDoneCallback& done,
                                bool quick_callback, absl::Time deadline, Allocator* allocator) {
  auto it = requests_.find(state->pushed);
  if (it == requests_.end()) {
    state->pushed = PushAhead::kNoPush;
    return false;
  }
  RdmaTensorRequest& r = *it->second;
  if (r.step_id() == step && r.adoptable()) {
    Unpush(r);
    ++state->active;
    env_->stats->push_hits.fetch_add(1, std::memory_order_relaxed);
    // If it had landed, this recv is complete.
    r.set_quick_callback(quick_callback);
    if (r.Adopt(std::move(done), deadline, allocator)) FinishDelivered(r.index());
    return true;
  }
  // Another step's (the recvs of this key are out of order, or skip steps): it stays for its
  // own recv, or until its step ends.
  return false;
}

void ReceivingSide::Push(const KeyRef& key, int64_t step, Allocator* allocator) {
  if (channel_->state() != Channel::State::kReady) return;
  PushAhead::KeyState* state = push_.StateOf(key);
  if (state == nullptr) return;
  const std::optional<uint64_t> bytes = push_.Plan(*state, key, allocator, *env_->memory);
  if (!bytes.has_value()) return;
  absl::StatusOr<uint32_t> index = indexes_.Allocate();
  if (!index.ok()) return;
  auto request = RenewRecord(spare_requests_, this, *index, step, key, allocator,
                             absl::InfiniteFuture(), RecvDoneCallback());
  RdmaTensorRequest* raw = request.get();
  requests_.emplace(*index, std::move(request));
  push_.Made(state, *index, *bytes);
  env_->stats->pushed.fetch_add(1, std::memory_order_relaxed);
  raw->Start();  // may finish the record on a local failure
}

void ReceivingSide::OnContent(uint32_t index, size_t lane) {
  auto it = requests_.find(index);
  // Content comes only after REQUEST or RE_REQUEST. In any other state it is a duplicated
  // immediate (kDone, kLandedAhead: the content is already in) or one the sender had no
  // destination for yet (kQueued, kAwaitingGrant, kMetaParked).
  using RequestState = RdmaTensorRequest::State;
  if (it == requests_.end() || (it->second->state() != RequestState::kRequested &&
                                it->second->state() != RequestState::kReRequested)) {
    env_->stats->dropped_imms.fetch_add(1, std::memory_order_relaxed);
    VLOG(1) << "dropped immediate " << index << " from task " << peer_task()
            << ": no request with that index is waiting for content";
    return;
  }
  if (channel_->lanes() > 1) {
    // The precise clock: the lanes' rates are measured between segments milliseconds apart.
    it->second->CountLane(lane, absl::Now());
    if (it->second->awaits_more_segments()) {
      striping_.insert(index);
    } else if (it->second->striped()) {
      channel_->NoteLaneRates(it->second->LaneRates());
    }
  }
  if (it->second->awaits_more_segments()) {
    it->second->RecvSegment();  // the content lands in segments, and more are to come
    return;
  }
  striping_.erase(index);
  it->second->RecvTensorContent();
  if (it->second->landed()) return;  // pushed: it waits for the recv that takes it
  FinishDelivered(index);
  if (!closed()) GrantWaiting();
}

size_t ReceivingSide::StalledLane(absl::Time now, absl::Duration limit) {
  for (auto it = striping_.begin(); it != striping_.end();) {
    auto request = requests_.find(*it);
    absl::Time began;
    const size_t lane = request == requests_.end() ? 0 : request->second->LaneOwingSegments(&began);
    if (lane == 0) {
      striping_.erase(it++);  // landed whole, ended, or the record went
      continue;
    }
    if (lane >= channel_->lanes()) {
      // Taken out already: the recv ended then, and its sender's answer ends the record.
      striping_.erase(it++);
      continue;
    }
    if (now - std::max(began, channel_->LaneHeard(lane)) > limit) return lane;
    ++it;
  }
  return 0;
}

void ReceivingSide::EndStripedOver(size_t lane, const absl::Status& status,
                                   std::vector<Tensor>* memory) {
  using RequestState = RdmaTensorRequest::State;
  std::vector<uint32_t> ended;
  for (auto& [index, r] : requests_) {
    if (!r->StripedOver(lane) ||
        (r->state() != RequestState::kRequested && r->state() != RequestState::kReRequested)) {
      continue;
    }
    if (r->LandingOver(lane)) {
      ended.push_back(index);
    } else {
      // Nothing landed yet: the sender may write it over the lanes that stay much later (its
      // tensor is not ready), so the destination stays with the record until the sender
      // answers: the content, or ERROR_STATUS once its write over this lane failed.
      r->Fail(status);
    }
  }
  for (uint32_t index : ended) {
    striping_.erase(index);
    RdmaTensorRequest& r = *requests_.at(index);
    r.Fail(status);
    for (Tensor& t : r.TakeMemory()) memory->push_back(std::move(t));
    // Its index goes free: a late segment over a lane that stays names no request (the
    // allocator hands the index out again only after the whole index space went round).
    FinishRequest(index, RdmaTensorRequest::Event::kLaneLost);
  }
  if (!ended.empty() && !closed()) GrantWaiting();
}

void ReceivingSide::FinishDelivered(uint32_t index) {
  RdmaTensorRequest& r = *requests_.at(index);
  const bool push = env_->options.pushes_ahead() && r.delivered_in_place();
  const KeyRef key = r.key_ref();
  const int64_t step = r.step_id();
  Allocator* allocator = r.allocator();
  FinishRequest(index, RdmaTensorRequest::Event::kContent);
  if (push) Push(key, step + 1, allocator);
}

void ReceivingSide::OnAnswer(const Message& m) {
  auto it = requests_.find(m.request_index);
  if (it == requests_.end()) {
    env_->stats->dropped_imms.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (m.type == MessageType::kMetaDataResponse) {
    it->second->RecvTensorMetaData(m);
    return;
  }
  it->second->Fail(
      absl::Status(m.error.code(), absl::StrCat("task ", peer_task(), " could not send '",
                                                it->second->key(), "': ", m.error.message())));
  if (it->second->striped()) {
    // Its segments over the other lanes may still be on their way: ERROR_STATUS, on lane 0,
    // can overtake them.
    std::vector<Tensor> memory = it->second->TakeMemory();
    if (!memory.empty()) {
      env_->host->Quarantine(std::move(memory), absl::Now() + env_->quarantine());
    }
  }
  striping_.erase(m.request_index);
  FinishRequest(m.request_index, RdmaTensorRequest::Event::kErrorStatus);
  GrantWaiting();
}

void ReceivingSide::Close(const absl::Status& status, std::vector<Tensor>* memory) {
  for (auto& [index, request] : requests_) {
    if (request->adoptable() && request->landed() && env_->landed != nullptr) {
      // Whole, and the sender is done with it: a peer that stopped after its sends were taken
      // (by these requests) still delivers them.
      env_->landed->Keep(peer_task(), request->key(), request->step_id(), request->TakeLanded(),
                         absl::Now() + env_->transfer.recv_timeout);
    } else {
      request->Fail(status);
      for (Tensor& t : request->TakeMemory()) memory->push_back(std::move(t));
    }
    request->End(RdmaTensorRequest::Event::kClose);
    finished_requests_.push_back(std::move(request));
  }
  requests_.clear();
  queued_.clear();
  large_in_request_ = 0;
  large_granted_ = 0;
  large_waiting_.clear();
  for (auto& [index, pull] : pulls_) {
    pull->End(status);
    pull->Closed();
    for (Tensor& t : pull->TakeMemory()) memory->push_back(std::move(t));
    finished_pulls_.push_back(std::move(pull));
  }
  pulls_.clear();
  queued_pulls_.clear();
  channel_->ScheduleReap();
}

}  // namespace tensorverbs::protocol
