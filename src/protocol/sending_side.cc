#include "src/protocol/sending_side.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "src/common/logging.h"
#include "src/protocol/channel.h"
#include "src/protocol/spare_records.h"
#include "tensorverbs/parsed_key.h"

namespace tensorverbs::protocol {

SendingSide::SendingSide(Channel* channel) : channel_(channel), env_(channel->env()) {}

SendingSide::~SendingSide() = default;

bool SendingSide::closed() const { return channel_->state() == Channel::State::kClosed; }

const std::string& SendingSide::peer_task() const { return channel_->peer_task(); }

void SendingSide::OnRequest(Message& m) {
  const uint32_t index = m.request_index;
  // The receiver reuses an index only after it took the expired response's ERROR_STATUS, and
  // then its crossing RE_REQUEST (if any) came before this.
  expired_responses_.erase(index);
  if (auto pending = responses_.find(index);
      pending != responses_.end() && pending->second->StripedAndPosted()) {
    // Its segments all landed (the receiver counted them before taking the index again); the
    // completions of the other lanes are simply not polled yet. The source is kept for the
    // quarantine all the same: a peer that took the index too early must not make the fabric
    // read freed memory.
    std::vector<Tensor> in_flight;
    pending->second->GiveUpInFlightMemory(&in_flight);
    if (!in_flight.empty()) {
      env_->host->Quarantine(std::move(in_flight), absl::Now() + env_->quarantine());
    }
    if (pending->second->TakeLanded()) FinishResponse(index);
    if (closed()) return;
  }
  if (responses_.contains(index)) {
    channel_->Close(absl::DataLossError(absl::StrCat("task ", peer_task(), " reused request index ",
                                                     index, " while it was pending")));
    return;
  }
  absl::StatusOr<KeyRef> key = RequestedKey(m);
  if (closed()) return;  // the REQUEST broke the indexing rules
  absl::Status error = key.status();
  if (error.ok() && responses_.size() >= static_cast<size_t>(env_->transfer.max_responses)) {
    error = absl::ResourceExhaustedError(absl::StrCat(
        "this task already holds ", responses_.size(),
        " of this channel's requests (TENSORVERBS_MAX_RESPONSES=", env_->transfer.max_responses,
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
  auto response = RenewRecord(spares_, this, next_serial_++, std::move(m));
  RdmaTensorResponse* raw = response.get();
  responses_.emplace(index, std::move(response));
  if (!error.ok()) {
    raw->Resume(error, Tensor(), false);  // sends ERROR_STATUS and finishes
    return;
  }
  raw->Start(std::move(rendezvous), *std::move(key));
}

void SendingSide::OnReRequest(const Message& m) {
  auto it = responses_.find(m.request_index);
  if (it == responses_.end() && expired_responses_.erase(m.request_index) > 0) {
    // It crossed the ERROR_STATUS of an expired response, which the receiver acts on.
    env_->stats->dropped_imms.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (it == responses_.end()) {
    channel_->Close(absl::DataLossError(absl::StrCat("RE_REQUEST from task ", peer_task(),
                                                     " for unknown request ", m.request_index)));
    return;
  }
  it->second->RecvReRequest(m);
}

void SendingSide::OnWriteDone(uint32_t index, uint32_t serial_bits) {
  auto it = responses_.find(index);
  if (it == responses_.end()) return;
  // A late completion of a striped response finished when its index was taken again.
  if ((it->second->serial() & RdmaTensorResponse::kContentSerialMask) != serial_bits) return;
  if (it->second->OnWriteDone()) FinishResponse(index);
}

void SendingSide::OnWriteFailed(uint32_t index, uint32_t serial_bits, const absl::Status& status) {
  auto it = responses_.find(index);
  if (it == responses_.end()) return;
  if ((it->second->serial() & RdmaTensorResponse::kContentSerialMask) != serial_bits) return;
  if (it->second->OnWriteFailed(status)) FinishResponse(index);
}

void SendingSide::OnLentReleased(uint32_t tensor_key) {
  env_->host->ReleaseLent(peer_task(), tensor_key);
}

void SendingSide::OnLocalTensor(uint64_t serial, uint32_t index, const absl::Status& status,
                                const Tensor& tensor, bool is_dead) {
  channel_->AssertOwnerThread();
  auto it = responses_.find(index);
  if (it == responses_.end() || it->second->serial() != serial) return;  // cancelled
  it->second->Resume(status, tensor, is_dead);
}

void SendingSide::OnStaged(uint64_t serial, uint32_t index, const absl::Status& status,
                           uint64_t staged_bytes) {
  channel_->AssertOwnerThread();
  auto it = responses_.find(index);
  if (it == responses_.end() || it->second->serial() != serial) return;  // over already
  if (!status.ok() && it->second->state() == RdmaTensorResponse::State::kWaitReRequest) {
    // Its ERROR_STATUS may cross the receiver's RE_REQUEST.
    ExpectLateReRequest(index);
  }
  if (it->second->OnStaged(status, staged_bytes)) FinishResponse(index);
}

void SendingSide::ExpireResponses(absl::Time now) {
  channel_->AssertOwnerThread();
  if (env_->response_timeout() == absl::InfiniteDuration()) return;
  std::vector<uint32_t> expired;
  for (const auto& [index, response] : responses_) {
    if (response->state() == RdmaTensorResponse::State::kWaitReRequest &&
        response->meta_sent_at() + env_->response_timeout() <= now) {
      expired.push_back(index);
    }
  }
  for (uint32_t index : expired) {
    if (closed()) return;  // an ERROR_STATUS that failed to go closed it
    auto it = responses_.find(index);
    if (it == responses_.end()) continue;
    ExpectLateReRequest(index);
    it->second->Expire(absl::DeadlineExceededError(absl::StrCat(
        "task ", peer_task(), " did not ask for the content within ",
        absl::FormatDuration(env_->response_timeout()),
        " of its meta-data (TENSORVERBS_RECV_TIMEOUT_MS plus TENSORVERBS_PEER_TIMEOUT_MS); "
        "the sender dropped the tensor")));
  }
}

void SendingSide::ExpectLateReRequest(uint32_t index) {
  // An entry goes when its RE_REQUEST or the index's next REQUEST comes; a faulty peer that
  // sends neither cannot grow the set past max_responses (then a late RE_REQUEST of an entry
  // forgotten here closes the channel, as any unknown one does).
  if (expired_responses_.size() >= static_cast<size_t>(env_->transfer.max_responses)) {
    expired_responses_.clear();
  }
  expired_responses_.insert(index);
}

size_t SendingSide::responses_in_progress() const {
  size_t n = 0;
  for (const auto& [index, response] : responses_) n += response->in_progress();
  return n;
}

size_t SendingSide::CountResponses(RdmaTensorResponse::State state) const {
  size_t n = 0;
  for (const auto& [index, response] : responses_) n += response->state() == state;
  return n;
}

void SendingSide::FinishResponse(uint32_t index) {
  auto it = responses_.find(index);
  if (it == responses_.end()) return;
  finished_.push_back(std::move(it->second));
  responses_.erase(it);
  channel_->ScheduleReap();
}

void SendingSide::Reap() {
  // Swapped with a member, not a local: both vectors keep their capacity, so a steady channel
  // allocates nothing to finish its records.
  reaping_.swap(finished_);
  for (auto& r : reaping_) {
    RetireRecord(spares_, std::move(r), RdmaTensorResponse(this, 0, Message()));
  }
  reaping_.clear();
}

void SendingSide::Close() {
  // The memory writes in flight read is kept for the peer timeout, as the receiver keeps the
  // destinations the peer may write: freed at the end of the turn, a 64 MiB source still being
  // sent over a shared tcp;ofi_rxm endpoint was unmapped under the provider (EFAULT mid-message),
  // and the next channel to that peer, set up over the broken connection, lost its first
  // request (PartitionTest, about 1 run in 2).
  std::vector<Tensor> in_flight;
  for (auto& [index, response] : responses_) {
    response->Cancel();
    response->GiveUpInFlightMemory(&in_flight);
    finished_.push_back(std::move(response));
  }
  responses_.clear();
  if (!in_flight.empty()) {
    env_->host->Quarantine(std::move(in_flight), absl::Now() + env_->quarantine());
  }
  channel_->ScheduleReap();
}

absl::StatusOr<KeyRef> SendingSide::ValidKey(const std::string& name) {
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
  // inventing names cannot grow it without limit; names asked for once (numbered messages)
  // stay out of it.
  KeyRef ref = MakeKeyRef(*std::move(key));
  if (!seen_names_.SeenBefore(name)) return ref;
  if (valid_keys_.size() >= kMaxCachedKeys) valid_keys_.clear();
  valid_keys_.emplace(name, ref);
  return ref;
}

absl::StatusOr<KeyRef> SendingSide::RequestedKey(const Message& m) {
  if (m.name.empty()) {
    // By index: one the owner defined earlier on this channel.
    if (m.name_index >= indexed_keys_.size()) {
      channel_->Close(absl::DataLossError(
          absl::StrCat("task ", peer_task(), " asked for key index ", m.name_index,
                       ", which it never defined (", indexed_keys_.size(), " defined)")));
      return channel_->close_status();
    }
    return indexed_keys_[m.name_index];
  }
  absl::StatusOr<KeyRef> key = ValidKey(m.name);
  if (m.name_index != kNoNameIndex) {
    if (m.name_index != indexed_keys_.size()) {
      channel_->Close(absl::DataLossError(absl::StrCat("task ", peer_task(), " defined key index ",
                                                       m.name_index, " out of order (expected ",
                                                       indexed_keys_.size(), ")")));
      return channel_->close_status();
    }
    // An invalid key is remembered with its error: later REQUESTs by index get the same one.
    indexed_keys_.push_back(key);
  }
  return key;
}

}  // namespace tensorverbs::protocol
