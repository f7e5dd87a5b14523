#include "src/protocol/channel.h"

#include <algorithm>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "src/common/logging.h"
#include "src/common/sanitizers.h"
#include "src/common/status_macros.h"

namespace tensorverbs::protocol {

namespace {

// Finished request and response records are kept (up to this many of each) and reassigned to
// the next ones, so a steady channel makes no heap allocation for them. Sanitizer builds free
// them instead, so that a use after finish stays a use after free that ASan reports.
constexpr size_t kMaxSpareRecords = kUnderAddressSanitizer ? 0 : 256;

// A record built from `args`: a spare one reassigned, or a new one.
template <typename T, typename... Args>
std::unique_ptr<T> Renew(std::vector<std::unique_ptr<T>>& spares, Args&&... args) {
  if (spares.empty()) return std::make_unique<T>(std::forward<Args>(args)...);
  std::unique_ptr<T> r = std::move(spares.back());
  spares.pop_back();
  *r = T(std::forward<Args>(args)...);
  return r;
}

// Keeps a finished record as a spare, after `blank` replaced everything it held (tensors,
// callbacks, its rendezvous): nothing outlives the record's use.
template <typename T>
void Retire(std::vector<std::unique_ptr<T>>& spares, std::unique_ptr<T> r, T blank) {
  if (spares.size() >= kMaxSpareRecords) return;  // `r` is deleted here
  *r = std::move(blank);
  spares.push_back(std::move(r));
}

}  // namespace

void Channel::AssertOwnerThread() const {
  DCHECK(env_->on_owner_thread == nullptr || env_->on_owner_thread())
      << Describe() << " used off the progress thread";
}

Channel::Channel(ChannelEnv* env, Role role, uint64_t id, std::string peer_task)
    : env_(env), role_(role), id_(id), peer_task_(std::move(peer_task)) {}

Channel::~Channel() {
  Close(absl::CancelledError(absl::StrCat("channel to task ", peer_task_, " destroyed")));
}

absl::Status Channel::Init() {
  ASSIGN_OR_RETURN(endpoint_, env_->domain->CreateEndpoint());
  // With channel keys the peer's slots are registered for this endpoint alone, so no other
  // peer can write control messages into this channel.
  ASSIGN_OR_RETURN(
      mb_,
      MessageBuffer::Create(
          env_->domain, env_->message_slots, env_->message_batch,
          {&env_->stats->control_slots, &env_->stats->control_messages},
          env_->memory != nullptr && env_->memory->channel_keys() ? endpoint_.get() : nullptr));
  return absl::OkStatus();
}

absl::StatusOr<fabric::RemoteKey> Channel::OfferKey(const fabric::MemoryRegion& region) {
  if (endpoint_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(Describe(), " is closed"));
  }
  return env_->memory->RemoteKeyFor(*endpoint_, region);
}

absl::Status Channel::Connect(const std::string& peer_address, uint64_t rx_addr, std::string rx_key,
                              int rx_slots, uint64_t peer_incarnation) {
  AssertOwnerThread();
  RETURN_IF_ERROR(endpoint_->Connect(peer_address));
  RETURN_IF_ERROR(mb_->Connect(endpoint_.get(), rx_addr, std::move(rx_key), rx_slots));
  peer_incarnation_ = peer_incarnation;
  state_ = State::kReady;
  std::vector<uint32_t> queued;
  queued.swap(queued_);
  for (uint32_t index : queued) {
    auto it = requests_.find(index);
    if (it == requests_.end()) continue;
    if (it->second->finished()) {
      FinishRequest(index);  // aborted while queued: never sent, nothing can land
      continue;
    }
    it->second->Start();
  }
  std::vector<uint32_t> pulls;
  pulls.swap(queued_pulls_);
  for (uint32_t index : pulls) IssuePull(index);
  return absl::OkStatus();
}

std::string Channel::Describe() const {
  const fabric::Capabilities& caps = env_->domain->capabilities();
  return absl::StrCat(
      role_ == Role::kOwner ? "recv channel from task " : "send channel to task ", peer_task_,
      " over ", caps.backend, " (", caps.provider, "), endpoint ",
      absl::BytesToHexString(endpoint_ ? endpoint_->LocalAddress() : "").substr(0, 32), ", ",
      mb_ ? mb_->rx_slots() : 0, " message slots");
}

void Channel::StartRecv(int64_t step_id, KeyRef key, Allocator* allocator, absl::Time deadline,
                        RecvDoneCallback done) {
  AssertOwnerThread();
  auto fail = [&](const absl::Status& s) { env_->FailRecv(std::move(done), s); };
  if (state_ == State::kClosed) {
    fail(absl::UnavailableError(absl::StrCat("channel to task ", peer_task_, " is closed")));
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
  KeyState* state = StateOf(key);
  if (state != nullptr && state->pushed != kNoPush &&
      AdoptPushed(state, step_id, done, deadline, allocator)) {
    return;  // no REQUEST: it went out when the key's previous step completed
  }
  if (absl::Status s = CheckPendingBound("recv"); !s.ok()) {
    fail(s);
    return;
  }
  absl::StatusOr<uint32_t> index = indexes_.Allocate();
  if (!index.ok()) {
    fail(absl::ResourceExhaustedError(
        absl::StrCat("too many pending recvs from task ", peer_task_)));
    return;
  }
  if (state != nullptr) ++state->active;
  auto request = Renew(spare_requests_, this, *index, step_id, std::move(key), allocator, deadline,
                       std::move(done));
  RdmaTensorRequest* raw = request.get();
  requests_.emplace(*index, std::move(request));
  if (state_ == State::kReady) {
    raw->Start();
  } else {
    queued_.push_back(*index);
  }
}

void Channel::StartPull(const RemoteTensorRef& ref, Tensor dest, absl::Time deadline,
                        GdrPull::Done done) {
  AssertOwnerThread();
  if (state_ == State::kClosed) {
    std::move(done)(
        absl::UnavailableError(absl::StrCat("channel to task ", peer_task_, " is closed")));
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
        absl::StrCat("too many pending reads from task ", peer_task_)));
    return;
  }
  pulls_.emplace(*index, std::make_unique<GdrPull>(this, *index, ref, std::move(dest), deadline,
                                                   std::move(done)));
  if (state_ == State::kReady) {
    IssuePull(*index);
  } else {
    queued_pulls_.push_back(*index);
  }
}

absl::Status Channel::CheckPendingBound(absl::string_view what) const {
  const size_t pending = requests_.size() + pulls_.size();
  if (pending < static_cast<size_t>(env_->max_pending_recvs)) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "no ", what, " from task ", peer_task_, ": its channel already has ", pending,
      " recvs and reads pending (TENSORVERBS_MAX_PENDING_RECVS=", env_->max_pending_recvs,
      "); wait for earlier recvs, or raise the limit"));
}

void Channel::IssuePull(uint32_t index) {
  auto it = pulls_.find(index);
  if (it != pulls_.end()) it->second->Issue();
}

void Channel::AbortStep(int64_t step_id, const absl::Status& status) {
  AssertOwnerThread();
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
    FinishRequest(index);
  }
  // One at a time, by index: a failed send closes the channel, which deletes every request.
  for (uint32_t index : release) {
    if (state_ == State::kClosed) return;
    auto it = requests_.find(index);
    if (it != requests_.end() && it->second->needs_release()) it->second->Release();
  }
  // Aborted recvs waiting for a large destination release the sender's tensor now.
  if (state_ != State::kClosed) GrantWaiting();
}

void Channel::ExpireRequests(absl::Time now) {
  AssertOwnerThread();
  for (auto& [index, request] : requests_) {
    if (request->finished()) continue;
    if (request->deadline() > now) {
      WarnIfSlow(*request, now);
      continue;
    }
    if (state_ == State::kConnecting) {
      request->Fail(absl::UnavailableError(absl::StrCat(
          "recv of '", request->key(), "': the grpc+verbs channel to task ", peer_task_, " at ",
          peer_address_, " was not set up before the recv's deadline (is the task running?)")));
      continue;
    }
    request->Fail(absl::DeadlineExceededError(
        absl::StrCat("recv of '", request->key(), "' from task ", peer_task_,
                     " timed out; raise TENSORVERBS_RECV_TIMEOUT_MS if the producer is slow")));
  }
  for (auto& [index, pull] : pulls_) {
    if (pull->finished() || pull->deadline() > now) continue;
    // The record (and its memory) stays until the read completes or the channel closes.
    pull->End(absl::DeadlineExceededError(
        absl::StrCat("reading a tensor from task ", peer_task_,
                     " timed out; raise TENSORVERBS_RECV_TIMEOUT_MS if the network is slow")));
  }
  GrantWaiting();  // expired recvs waiting for a large destination release the sender's tensor
}

void Channel::WarnIfSlow(RdmaTensorRequest& request, absl::Time now) {
  const absl::Duration slow = env_->slow_recv_warning;
  if (slow <= absl::ZeroDuration() || request.slow_warned()) return;
  // A recv started at its deadline less the recv timeout (both the transport's).
  const absl::Duration waited = now - (request.deadline() - env_->recv_timeout);
  if (waited < slow) return;
  request.set_slow_warned();
  LOG(WARNING) << SlowRecvWarning(request.key(), request.step_id(), peer_task_, waited, slow);
}

void Channel::ExpireResponses(absl::Time now) {
  AssertOwnerThread();
  if (env_->response_timeout == absl::InfiniteDuration()) return;
  std::vector<uint32_t> expired;
  for (const auto& [index, response] : responses_) {
    if (response->state() == RdmaTensorResponse::State::kWaitReRequest &&
        response->meta_sent_at() + env_->response_timeout <= now) {
      expired.push_back(index);
    }
  }
  for (uint32_t index : expired) {
    if (state_ == State::kClosed) return;  // an ERROR_STATUS that failed to go closed it
    auto it = responses_.find(index);
    if (it == responses_.end()) continue;
    // An entry goes when its RE_REQUEST or the index's next REQUEST comes; a faulty peer that
    // sends neither cannot grow the set past max_responses (then a late RE_REQUEST of an
    // entry forgotten here closes the channel, as any unknown one does).
    if (expired_responses_.size() >= static_cast<size_t>(env_->max_responses)) {
      expired_responses_.clear();
    }
    expired_responses_.insert(index);
    it->second->Expire(absl::DeadlineExceededError(absl::StrCat(
        "task ", peer_task_, " did not ask for the content within ",
        absl::FormatDuration(env_->response_timeout),
        " of its meta-data (TENSORVERBS_RECV_TIMEOUT_MS plus TENSORVERBS_PEER_TIMEOUT_MS); "
        "the sender dropped the tensor")));
  }
}

size_t Channel::responses_in_progress() const {
  AssertOwnerThread();
  size_t n = 0;
  for (const auto& [index, response] : responses_) n += response->in_progress();
  return n;
}

size_t Channel::CountRequests(RdmaTensorRequest::State state,
                              std::optional<RdmaTensorRequest::Owner> owner) const {
  AssertOwnerThread();
  size_t n = 0;
  for (const auto& [index, request] : requests_) {
    n += request->state() == state && (!owner.has_value() || request->owner() == *owner);
  }
  return n;
}

size_t Channel::pending_requests() const {
  AssertOwnerThread();
  size_t n = 0;
  for (const auto& [index, request] : requests_) n += !request->finished();
  for (const auto& [index, pull] : pulls_) n += !pull->finished();
  return n;
}

void Channel::SendMessage(Message m) {
  if (state_ == State::kClosed) return;
  absl::Status s = mb_->Send(std::move(m));
  if (!s.ok()) {
    Close(absl::UnavailableError(
        absl::StrCat("sending a control message to task ", peer_task_, " failed: ", s.message())));
  }
}

bool Channel::MayNameLargeDestination(RdmaTensorRequest& r, uint64_t bytes) {
  if (env_->large_in_flight == 0 || bytes < env_->large_bytes) return true;
  if (large_in_request_ > 0) return false;
  ++large_in_request_;
  r.set_large_slot(RdmaTensorRequest::LargeSlot::kInRequest);
  return true;
}

bool Channel::GrantLargeDestination(RdmaTensorRequest& r) {
  if (env_->large_in_flight == 0 || r.tensor_bytes() < env_->large_bytes) return true;
  if (large_waiting_.empty() && large_granted_ < env_->large_in_flight) {
    ++large_granted_;
    r.set_large_slot(RdmaTensorRequest::LargeSlot::kGranted);
    return true;
  }
  large_waiting_.push_back(r.index());
  return false;
}

void Channel::ReleaseLargeSlot(RdmaTensorRequest& r) {
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

void Channel::GrantWaiting() {
  if (large_waiting_.empty()) return;
  // Requests whose recv ended first, wherever they are in the queue: they only release the
  // sender's tensor. One send at a time, each request looked up again: a failed send closes
  // the channel, which deletes every request.
  std::vector<uint32_t> ended;
  for (uint32_t index : large_waiting_) {
    auto it = requests_.find(index);
    if (it != requests_.end() && it->second->awaiting_grant() && it->second->finished()) {
      ended.push_back(index);
    }
  }
  for (uint32_t index : ended) {
    if (state_ == State::kClosed) return;
    auto it = requests_.find(index);
    if (it != requests_.end() && it->second->awaiting_grant()) it->second->Grant();
  }
  while (!large_waiting_.empty() && state_ != State::kClosed) {
    auto it = requests_.find(large_waiting_.front());
    if (it == requests_.end() || !it->second->awaiting_grant()) {
      large_waiting_.pop_front();  // answered above, or gone
      continue;
    }
    RdmaTensorRequest& r = *it->second;
    if (!r.finished()) {
      if (large_granted_ >= env_->large_in_flight) return;
      ++large_granted_;
      r.set_large_slot(RdmaTensorRequest::LargeSlot::kGranted);
    }
    large_waiting_.pop_front();
    r.Grant();
  }
}

void Channel::FinishRequest(uint32_t index) {
  auto it = requests_.find(index);
  if (it != requests_.end()) {
    RdmaTensorRequest& r = *it->second;
    ReleaseLargeSlot(r);
    if (r.pushed_unadopted()) {
      Unpush(r);
      env_->stats->push_unused.fetch_add(1, std::memory_order_relaxed);
    } else if (auto k = keys_.find(r.key_ref()); k != keys_.end()) {
      --k->second.active;
    }
    RetireRequest(std::move(it->second));
    requests_.erase(it);
  }
  indexes_.Release(index);
}

void Channel::FinishResponse(uint32_t index) {
  auto it = responses_.find(index);
  if (it == responses_.end()) return;
  RetireResponse(std::move(it->second));
  responses_.erase(it);
}

void Channel::RetireRequest(std::unique_ptr<RdmaTensorRequest> r) {
  Retire(spare_requests_, std::move(r),
         RdmaTensorRequest(this, 0, 0, nullptr, nullptr, absl::InfiniteFuture(), nullptr));
}

void Channel::RetireResponse(std::unique_ptr<RdmaTensorResponse> r) {
  Retire(spare_responses_, std::move(r), RdmaTensorResponse(this, 0, Message()));
}

void Channel::FinishPull(uint32_t index) {
  pulls_.erase(index);
  indexes_.Release(index);
}

void Channel::OnLocalTensor(uint64_t serial, uint32_t index, const absl::Status& status,
                            const Tensor& tensor, bool is_dead) {
  AssertOwnerThread();
  auto it = responses_.find(index);
  if (it == responses_.end() || it->second->serial() != serial) return;  // cancelled
  it->second->Resume(status, tensor, is_dead);
}

void Channel::OnCompletion(const fabric::Completion& c) {
  AssertOwnerThread();
  if (state_ == State::kClosed) return;
  if (!c.status.ok()) {
    // Running out of memory here (a fabric mapping the peer's memory) is this task's trouble,
    // not the peer's, and keeps its code; anything else means the link is gone.
    const absl::StatusCode code = absl::IsResourceExhausted(c.status)
                                      ? absl::StatusCode::kResourceExhausted
                                      : absl::StatusCode::kUnavailable;
    Close(absl::Status(code, absl::StrCat("RDMA operation with task ", peer_task_,
                                          " failed: ", c.status.message())));
    return;
  }
  if (c.kind == fabric::CompletionKind::kRemoteWriteImm) {
    switch (ClassifyImm(c.imm)) {
      case ImmKind::kControlMessage: {
        OnControlMessage();
        // The ACK goes out after whatever the messages set off (a content write the peer is
        // waiting for is deferred to the end of this completion batch too), so it never
        // delays an answer; one ACK covers every slot that arrived in the meantime. An ACK task
        // is queued exactly while slots are unacknowledged (it acknowledges all of them), so
        // only the first slot since the last ACK queues one.
        if (state_ == State::kClosed || mb_->unacknowledged() != 1) return;
        // Two words, stored inside the task with no allocation; the env outlives the loop.
        ChannelEnv* const env = env_;
        const uint64_t id = id_;
        env_->post([env, id]() {
          if (Channel* c = env->find_channel(id)) c->AcknowledgeMessages();
        });
        return;
      }
      case ImmKind::kAck:
        if (absl::Status s = mb_->OnAck(AckCount(c.imm)); !s.ok()) Close(s);
        return;
      case ImmKind::kRequest:
        OnContent(c.imm);
        return;
    }
    return;
  }
  const uint64_t value = ContextValue(c.context);
  switch (ContextTag(c.context)) {
    case OpTag::kMessage:
      if (absl::Status s = mb_->OnMessageWritten(value); !s.ok()) Close(s);
      return;
    case OpTag::kAck:
      return;
    case OpTag::kRead: {
      auto it = pulls_.find(static_cast<uint32_t>(value));
      if (it != pulls_.end()) it->second->OnReadDone();
      return;
    }
    case OpTag::kContent: {
      auto it = responses_.find(static_cast<uint32_t>(value));
      if (it != responses_.end() && it->second->OnWriteDone()) {
        RetireResponse(std::move(it->second));
        responses_.erase(it);
      }
      return;
    }
  }
}

absl::StatusOr<KeyRef> Channel::ValidKey(const std::string& name) {
  if (auto it = valid_keys_.find(name); it != valid_keys_.end()) return it->second;
  const WorkerEnv* worker = env_->worker;
  absl::StatusOr<ParsedKey> key = ParsedKey::Parse(name);
  if (!key.ok()) return absl::InvalidArgumentError(std::string(key.status().message()));
  if (!key->src.IsOnTask(worker->task_name)) {
    return absl::InvalidArgumentError(absl::StrCat("key '", key->full_key, "' names source task ",
                                                   key->src.TaskName(), ", not ",
                                                   worker->task_name));
  }
  if (key->src_incarnation != worker->incarnation) {
    return absl::AbortedError(absl::StrFormat(
        "key '%s' was made for incarnation %016x of task %s, which now runs incarnation "
        "%016x: the task was probably restarted; rebuild keys from its new incarnation",
        key->full_key, key->src_incarnation, worker->task_name, worker->incarnation));
  }
  // A training loop asks for the same keys every step: parse each once. Bounded, so a peer
  // inventing names cannot grow it without limit.
  if (valid_keys_.size() >= kMaxCachedKeys) valid_keys_.clear();
  KeyRef ref = MakeKeyRef(*std::move(key));
  valid_keys_.emplace(name, ref);
  return ref;
}

Channel::KeyState* Channel::StateOf(const KeyRef& key) {
  if (auto it = keys_.find(key); it != keys_.end()) return &it->second;
  if (keys_.size() >= kMaxNameIndexes) return nullptr;
  return &keys_[key];
}

void Channel::NameKey(const KeyRef& key, Message* m) {
  KeyState* state = StateOf(key);
  if (state != nullptr && state->name_index != kNoNameIndex) {
    m->name_index = state->name_index;
    env_->stats->indexed_requests.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  m->name = key->key.full_key;
  if (state != nullptr) m->name_index = state->name_index = next_name_index_++;
}

void Channel::Unpush(RdmaTensorRequest& r) {
  if (auto it = keys_.find(r.key_ref()); it != keys_.end() && it->second.pushed == r.index()) {
    it->second.pushed = kNoPush;
  }
  --pushed_requests_;
  pushed_bytes_ -= r.tensor_bytes();
}

bool Channel::AdoptPushed(KeyState* state, int64_t step, RecvDoneCallback& done,
                          absl::Time deadline, Allocator* allocator) {
  auto it = requests_.find(state->pushed);
  if (it == requests_.end()) {
    state->pushed = kNoPush;
    return false;
  }
  RdmaTensorRequest& r = *it->second;
  if (r.step_id() == step && r.adoptable()) {
    Unpush(r);
    ++state->active;
    env_->stats->push_hits.fetch_add(1, std::memory_order_relaxed);
    // If it had landed, this recv is complete.
    if (r.Adopt(std::move(done), deadline, allocator)) FinishDelivered(r.index());
    return true;
  }
  // Another step's (the recvs of this key are out of order, or skip steps): it stays for its
  // own recv, or until its step ends.
  return false;
}

void Channel::Push(const KeyRef& key, int64_t step, Allocator* allocator) {
  if (state_ != State::kReady) return;
  KeyState* state = StateOf(key);
  if (state == nullptr || state->active > 0 || state->pushed != kNoPush) return;
  // Destinations pushed ahead are host memory only: a recv that adopts one gets a host tensor,
  // which the rendezvous moves to the device if the recv wanted it there.
  if (allocator != nullptr && !allocator->Placement().host_accessible()) return;
  const TensorMetaData* meta = env_->memory->CachedMeta(key->key.full_key);
  if (meta == nullptr || meta->is_dead || meta->dtype == DataType::kString ||
      meta->tensor_bytes > kMaxPushedTensorBytes) {
    return;
  }
  if (pushed_requests_ >= env_->push_max_destinations ||
      pushed_bytes_ + meta->tensor_bytes > env_->push_max_bytes) {
    return;
  }
  absl::StatusOr<uint32_t> index = indexes_.Allocate();
  if (!index.ok()) return;
  auto request = Renew(spare_requests_, this, *index, step, key, allocator, absl::InfiniteFuture(),
                       RecvDoneCallback());
  RdmaTensorRequest* raw = request.get();
  requests_.emplace(*index, std::move(request));
  state->pushed = *index;
  ++pushed_requests_;
  pushed_bytes_ += meta->tensor_bytes;
  env_->stats->pushed.fetch_add(1, std::memory_order_relaxed);
  raw->Start();  // may finish (delete) the record on a local failure
}

absl::StatusOr<KeyRef> Channel::RequestedKey(const Message& m) {
  if (m.name.empty()) {
    // By index: one the owner defined earlier on this channel.
    if (m.name_index >= indexed_keys_.size()) {
      Close(absl::DataLossError(absl::StrCat("task ", peer_task_, " asked for key index ",
                                             m.name_index, ", which it never defined (",
                                             indexed_keys_.size(), " defined)")));
      return close_status_;
    }
    return indexed_keys_[m.name_index];
  }
  absl::StatusOr<KeyRef> key = ValidKey(m.name);
  if (m.name_index != kNoNameIndex) {
    if (m.name_index != indexed_keys_.size()) {
      Close(
          absl::DataLossError(absl::StrCat("task ", peer_task_, " defined key index ", m.name_index,
                                           " out of order (expected ", indexed_keys_.size(), ")")));
      return close_status_;
    }
    // An invalid key is remembered with its error: later REQUESTs by index get the same one.
    indexed_keys_.push_back(key);
  }
  return key;
}

void Channel::AcknowledgeMessages() {
  AssertOwnerThread();
  if (state_ == State::kClosed) return;
  if (absl::Status s = mb_->Acknowledge(); !s.ok()) {
    Close(absl::UnavailableError(absl::StrCat("acknowledging a control message of task ",
                                              peer_task_, " failed: ", s.message())));
  }
}

void Channel::OnContent(uint32_t index) {
  if (role_ == Role::kAcceptor && env_->mode == VerbsMode::kGdr) {
    if (env_->release_lent) env_->release_lent(peer_task_, index);
    return;
  }
  auto it = role_ == Role::kOwner ? requests_.find(index) : requests_.end();
  // Content comes only after REQUEST or RE_REQUEST. In any other state it is a duplicated
  // immediate (kDone, kLandedAhead: the content is already in) or one the sender had no
  // destination for yet (kQueued, kAwaitingGrant, kMetaParked).
  using RequestState = RdmaTensorRequest::State;
  if (it == requests_.end() || (it->second->state() != RequestState::kRequested &&
                                it->second->state() != RequestState::kReRequested)) {
    env_->stats->dropped_imms.fetch_add(1, std::memory_order_relaxed);
    VLOG(1) << "dropped immediate " << index << " from task " << peer_task_
            << ": no request with that index is waiting for content";
    return;
  }
  it->second->RecvTensorContent();
  if (it->second->landed()) return;  // pushed: it waits for the recv that takes it
  FinishDelivered(index);
  if (state_ != State::kClosed) GrantWaiting();
}

void Channel::FinishDelivered(uint32_t index) {
  RdmaTensorRequest& r = *requests_.at(index);
  const bool push = env_->push && r.delivered_in_place();
  const KeyRef key = r.key_ref();
  const int64_t step = r.step_id();
  Allocator* allocator = r.allocator();
  FinishRequest(index);
  if (push) Push(key, step + 1, allocator);
}

void Channel::OnControlMessage() {
  // The batch decodes into the channel's vector, whose capacity a steady channel reuses; it is
  // taken out while in use, so a nested call (none today) would simply start its own.
  std::vector<Message> batch = std::move(batch_);
  if (absl::Status s = mb_->OnControlMessage(&batch); !s.ok()) {
    Close(absl::DataLossError(
        absl::StrCat("control message from task ", peer_task_, ": ", s.message())));
  } else {
    for (Message& m : batch) {
      if (state_ == State::kClosed) break;
      HandleMessage(m);
    }
  }
  batch.clear();
  batch_ = std::move(batch);
}

void Channel::HandleMessage(Message& m) {
  const bool owner = role_ == Role::kOwner;
  switch (m.type) {
    case MessageType::kMetaDataResponse:
    case MessageType::kErrorStatus:
      if (owner) return HandleAnswer(m);
      break;
    case MessageType::kTensorRequest:
      if (!owner) return HandleRequest(m);
      break;
    case MessageType::kTensorReRequest: {
      if (owner) break;
      auto it = responses_.find(m.request_index);
      if (it == responses_.end() && expired_responses_.erase(m.request_index) > 0) {
        // It crossed the ERROR_STATUS of an expired response, which the receiver acts on.
        env_->stats->dropped_imms.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      if (it == responses_.end()) {
        Close(absl::DataLossError(absl::StrCat("RE_REQUEST from task ", peer_task_,
                                               " for unknown request ", m.request_index)));
        return;
      }
      it->second->RecvReRequest(m);
      return;
    }
  }
  Close(absl::DataLossError(absl::StrCat("task ", peer_task_, " sent ", MessageTypeName(m.type),
                                         " on a channel where ",
                                         owner ? "it sends tensors" : "it receives them")));
}

void Channel::HandleAnswer(const Message& m) {
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
      absl::Status(m.error.code(), absl::StrCat("task ", peer_task_, " could not send '",
                                                it->second->key(), "': ", m.error.message())));
  FinishRequest(m.request_index);
  GrantWaiting();
}

void Channel::HandleRequest(Message& m) {
  const uint32_t index = m.request_index;
  // The receiver reuses an index only after it took the expired response's ERROR_STATUS, and
  // then its crossing RE_REQUEST (if any) came before this.
  expired_responses_.erase(index);
  if (responses_.contains(index)) {
    Close(absl::DataLossError(absl::StrCat("task ", peer_task_, " reused request index ", index,
                                           " while it was pending")));
    return;
  }
  absl::StatusOr<KeyRef> key = RequestedKey(m);
  if (state_ == State::kClosed) return;  // the REQUEST broke the indexing rules
  absl::Status error = key.status();
  if (error.ok() && responses_.size() >= static_cast<size_t>(env_->max_responses)) {
    error = absl::ResourceExhaustedError(
        absl::StrCat("this task already holds ", responses_.size(),
                     " of this channel's requests (TENSORVERBS_MAX_RESPONSES=", env_->max_responses,
                     "); the receiver asks for more tensors at once than the sender allows"));
  }
  std::shared_ptr<RemoteRendezvous> rendezvous;
  if (error.ok()) {
    absl::StatusOr<std::shared_ptr<RemoteRendezvous>> r =
        env_->rendezvous_mgr->FindForPeer(m.step_id);
    if (r.ok()) {
      rendezvous = *std::move(r);
    } else {
      error = r.status();
    }
  }
  auto response = Renew(spare_responses_, this, next_serial_++, std::move(m));
  RdmaTensorResponse* raw = response.get();
  responses_.emplace(index, std::move(response));
  if (!error.ok()) {
    raw->Resume(error, Tensor(), false);  // sends ERROR_STATUS and finishes
    return;
  }
  raw->Start(std::move(rendezvous), *std::move(key));
}

void Channel::Close(const absl::Status& status) {
  AssertOwnerThread();
  if (state_ == State::kClosed) return;
  state_ = State::kClosed;
  close_status_ = status.ok() ? absl::CancelledError("closed") : status;
  if (status.code() != absl::StatusCode::kCancelled) {
    env_->stats->channel_errors.fetch_add(1, std::memory_order_relaxed);
    // Nothing a caller waits for goes with a channel that only had requests made ahead (a
    // peer that stopped after its last step, as every task does at the end of training):
    // that is news, not a warning.
    bool idle = pulls_.empty() && responses_.empty();
    for (const auto& [index, request] : requests_) idle = idle && request->adoptable();
    if (idle) {
      LOG(INFO) << Describe() << " closed with nothing pending: " << status.message();
    } else {
      LOG(WARNING) << Describe() << " closed: " << status.message();
    }
  }
  std::vector<Tensor> memory;
  for (auto& [index, request] : requests_) {
    if (request->adoptable() && request->landed() && env_->keep_landed) {
      // Whole, and the sender is done with it: a peer that stopped after its sends were taken
      // (by these requests) still delivers them.
      env_->keep_landed(peer_task_, request->key(), request->step_id(), request->TakeLanded(),
                        absl::Now() + env_->recv_timeout);
      continue;
    }
    request->Fail(status);
    for (Tensor& t : request->TakeMemory()) memory.push_back(std::move(t));
  }
  requests_.clear();
  queued_.clear();
  large_in_request_ = 0;
  large_granted_ = 0;
  large_waiting_.clear();
  for (auto& [index, pull] : pulls_) {
    pull->End(close_status_);
    for (Tensor& t : pull->TakeMemory()) memory.push_back(std::move(t));
  }
  pulls_.clear();
  queued_pulls_.clear();
  for (auto& [index, response] : responses_) response->Cancel();
  // No more operations from this side. The endpoint goes first: on a NIC, writes in flight read
  // the responses' tensors and the message buffers until its queue pair is gone. The keys
  // offered to the peer go with it: a write the peer still makes with them is refused.
  if (endpoint_ != nullptr && env_->memory != nullptr) env_->memory->DropEndpoint(endpoint_.get());
  endpoint_.reset();
  mb_.reset();
  responses_.clear();
  copy_buffers_.Clear();
  if (!memory.empty() && env_->quarantine_memory) {
    // The peer may still be alive and writing into these destinations.
    env_->quarantine_memory(std::move(memory), absl::Now() + env_->quarantine);
  }
}

}  // namespace tensorverbs::protocol
