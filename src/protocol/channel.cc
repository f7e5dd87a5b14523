#include "src/protocol/channel.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "src/common/coarse_clock.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"
#include "src/protocol/channel_table.h"

namespace tensorverbs::protocol {
namespace {

constexpr const char* kChannelStateNames[] = {"connecting", "ready", "closed"};
constexpr const char* kChannelEventNames[] = {"Connected", "Close"};
static_assert(std::size(kChannelStateNames) == Channel::kStates);
static_assert(std::size(kChannelEventNames) == Channel::kEvents);

// The channel's machine, row by row (state_table.h).
constexpr StateRow<Channel::State, Channel::Event> kChannelRows[] = {
    {Channel::State::kConnecting, Channel::Event::kConnected, "", Channel::State::kReady,
     "start the requests queued meanwhile"},
    {Channel::State::kConnecting, Channel::Event::kClose, "", Channel::State::kClosed,
     "end every recv, keep memory the peer may write"},
    {Channel::State::kReady, Channel::Event::kClose, "", Channel::State::kClosed,
     "end every recv and response, keep memory the peer may write"},
};

constexpr StateTable kChannelTable("Channel", kChannelStateNames, kChannelEventNames,
                                   Channel::State::kConnecting, kChannelRows);

}  // namespace

StateTableView ChannelStateTable() { return kChannelTable.View(); }

void Channel::TransitionTo(State next, Event event) {
  kChannelTable.Move(&state_, event, next, [&] { return Describe(); });
}

void Channel::AssertOwnerThread() const {
  DCHECK(env_->OnOwnerThread()) << Describe() << " used off the progress thread";
}

Channel::Channel(ChannelEnv* env, Role role, uint64_t id, std::string peer_task)
    : env_(env), role_(role), id_(id), peer_task_(std::move(peer_task)) {
  if (role_ == Role::kOwner) {
    receiving_ = std::make_unique<ReceivingSide>(this);
  } else {
    sending_ = std::make_unique<SendingSide>(this);
  }
}

Channel::~Channel() {
  Close(absl::CancelledError(absl::StrCat("channel to task ", peer_task_, " destroyed")));
  Reap();
}

absl::Status Channel::Init() {
  ASSIGN_OR_RETURN(endpoint_, env_->domain->CreateEndpoint());
  // Lanes that failed lately with this peer are left out (ChannelTable::NoteLaneFailed), by
  // the owner: the two ends agree on as many as both list, and an owner notes every failure of
  // its channel's lanes (its own, or the one its acceptor tells it of). An acceptor that
  // applied its own back-off too, begun when its write failed (over tcp, once the link came
  // back and the receiver's reset reached it, seconds after the owner's), would keep a lane
  // out of the channel its owner set up to bring the lane back.
  const size_t further =
      env_->channels != nullptr && role_ == Role::kOwner
          ? env_->channels->FurtherLanesFor(peer_task_, env_->lanes.size(), absl::Now())
          : env_->lanes.size();
  for (size_t i = 0; i < further; ++i) {
    const LaneEnv& lane = env_->lanes[i];
    absl::StatusOr<std::unique_ptr<fabric::Endpoint>> ep = lane.domain->CreateEndpoint();
    if (!ep.ok()) {
      // The channel goes on with the lanes before it (lane 0 is what must stand).
      LaneFailed(i + 1, ep.status());
      break;
    }
    lanes_.push_back(*std::move(ep));
  }
  if (!lanes_.empty() && env_->worker != nullptr && env_->worker->recv_allocator != nullptr) {
    absl::StatusOr<Tensor> words =
        Tensor::Allocate(env_->worker->recv_allocator, DataType::kUInt64, TensorShape::Of({2}));
    if (words.ok()) {
      probe_words_ = *std::move(words);
      std::memset(probe_words_.data(), 0, probe_words_.TotalBytes());
    }
  }
  // With channel keys the peer's slots are registered for this endpoint alone, so no other
  // peer can write control messages into this channel.
  ASSIGN_OR_RETURN(
      mb_,
      MessageBuffer::Create(
          env_->domain, env_->options.message_slots, env_->options.message_batch,
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
  TransitionTo(State::kReady, Event::kConnected);
  if (receiving_ != nullptr) receiving_->OnReady();
  return absl::OkStatus();
}

std::string Channel::Describe() const {
  const fabric::Capabilities& caps = env_->domain->capabilities();
  return absl::StrCat(
      role_ == Role::kOwner ? "recv channel from task " : "send channel to task ", peer_task_,
      " over ", caps.backend, " (", caps.provider, "), endpoint ",
      absl::BytesToHexString(endpoint_ ? endpoint_->LocalAddress() : "").substr(0, 32), ", ",
      mb_ ? mb_->rx_slots() : 0, " message slots",
      lanes_connected_ > 0 ? absl::StrCat(", ", lanes_connected_ + 1, " lanes") : "");
}

void Channel::SendMessage(Message m) {
  if (state_ == State::kClosed || !closing_.ok()) return;
  absl::Status s = mb_->Send(std::move(m));
  if (!s.ok()) {
    CloseAfterThisTurn(absl::UnavailableError(
        absl::StrCat("sending a control message to task ", peer_task_, " failed: ", s.message())));
  }
}

absl::Status Channel::MessagesFailed(const absl::Status& s) const {
  return absl::Status(
      s.code(), absl::StrCat("control messages with task ", peer_task_, " failed: ", s.message()));
}

void Channel::CloseAfterThisTurn(absl::Status status) {
  if (state_ == State::kClosed || !closing_.ok()) return;
  if (env_->host == nullptr) {
    Close(status);
    return;
  }
  closing_ = std::move(status);
  ChannelEnv* const env = env_;
  const uint64_t id = id_;
  env_->host->Post([env, id]() {
    if (Channel* c = env->channels->Find(id)) c->Close(c->closing_);
  });
}

void Channel::ScheduleReap() {
  if (reap_posted_) return;
  reap_posted_ = true;
  // Two words, stored inside the task with no allocation; the env outlives the loop. A channel
  // destroyed before the task runs frees its records itself.
  ChannelEnv* const env = env_;
  const uint64_t id = id_;
  env_->host->Post([env, id]() {
    if (Channel* c = env->channels->Find(id)) c->Reap();
  });
}

void Channel::Reap() {
  reap_posted_ = false;
  if (receiving_ != nullptr) receiving_->Reap();
  if (sending_ != nullptr) sending_->Reap();
}

void Channel::OnCompletion(const fabric::Completion& c) {
  AssertOwnerThread();
  if (state_ == State::kClosed) return;
  if (c.endpoint != endpoint_.get() && LaneOf(c.endpoint) == 0) {
    // Of a lane endpoint this channel let go (TakeLanesOut) earlier in the batch.
    env_->stats->dropped_imms.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (!c.status.ok()) {
    // Running out of memory here (a fabric mapping the peer's memory) is this task's trouble,
    // not the peer's, and keeps its code; anything else means the link is gone.
    const absl::StatusCode code = absl::IsResourceExhausted(c.status)
                                      ? absl::StatusCode::kResourceExhausted
                                      : absl::StatusCode::kUnavailable;
    const size_t lane = LaneOf(c.endpoint);
    if (lane == 0) {
      CloseAfterThisTurn(absl::Status(code, absl::StrCat("RDMA operation with task ", peer_task_,
                                                         " failed: ", c.status.message())));
      return;
    }
    // A further lane carries content writes alone: it is taken out and the channel goes on;
    // the response whose write failed tells its receiver once its other writes are done.
    const absl::Status failed(
        code, absl::StrCat("a content write to task ", peer_task_, " over lane ", lane, " (",
                           env_->lanes[lane - 1].source, ") failed: ", c.status.message()));
    TakeLanesOut(lane, failed);
    if (sending_ != nullptr && ContextTag(c.context) == OpTag::kContent) {
      const uint64_t value = ContextValue(c.context);
      sending_->OnWriteFailed(static_cast<uint32_t>(value), static_cast<uint32_t>(value >> 32),
                              failed);
    }
    return;
  }
  if (c.kind == fabric::CompletionKind::kRemoteWriteImm) {
    // What proves the peer alive and the channel working (HeardSinceLastLook): at the sender,
    // anything its receiver writes; at the receiver, content landing, not an ACK, which a peer
    // that then closed its end sent last.
    if (receiving_ == nullptr || ClassifyImm(c.imm) == ImmKind::kRequest) ++heard_;
    ++inbound_;
    switch (ClassifyImm(c.imm)) {
      case ImmKind::kControlMessage: {
        OnControlMessage();
        // The ACK goes out after whatever the messages set off (a content write the peer is
        // waiting for is deferred to the end of this completion batch too), so it never
        // delays an answer; one ACK covers every slot that arrived in the meantime. An ACK task
        // is queued exactly while slots are unacknowledged (it acknowledges all of them), so
        // only the first slot since the last ACK queues one.
        if (state_ == State::kClosed || mb_->unacknowledged() != 1) return;
        ChannelEnv* const env = env_;
        const uint64_t id = id_;
        env_->host->Post([env, id]() {
          if (Channel* c = env->channels->Find(id)) c->AcknowledgeMessages();
        });
        return;
      }
      case ImmKind::kAck:
        // An ACK frees slots, and the messages queued for them go out now: a refusal of
        // those posts (the peer went) or a bad count names the peer like any channel error.
        if (absl::Status s = mb_->OnAck(AckCount(c.imm)); !s.ok()) Close(MessagesFailed(s));
        return;
      case ImmKind::kRequest:
        if (!lanes_.empty()) {
          if (const size_t lane = LaneOf(c.endpoint); lane > 0 && c.imm == kImmLaneProbe) {
            OnLaneProbe(lane);
            return;
          }
          if (const size_t down = LaneDownOf(c.imm);
              down > 0 && receiving_ != nullptr && c.endpoint == endpoint_.get()) {
            TakeLanesOut(down, absl::UnavailableError(absl::StrCat(
                                   "a content write of task ", peer_task_, " over lane ", down,
                                   " (", env_->lanes[std::min(down, lanes_.size()) - 1].source,
                                   " at this end) failed there")));
            return;
          }
        }
        // On the receiver, content for a request; on a grpc+gdr sender, a released tensor.
        if (receiving_ != nullptr) {
          size_t lane = 0;
          if (lanes_connected_ > 0) {
            lane = LaneOf(c.endpoint);
            counters_.lane_segments_received[lane].fetch_add(1, std::memory_order_relaxed);
            lane_heard_[lane] = CoarseNow();
          }
          receiving_->OnContent(c.imm, lane);
        } else if (env_->options.mode == VerbsMode::kGdr) {
          sending_->OnLentReleased(c.imm);
        } else {
          env_->stats->dropped_imms.fetch_add(1, std::memory_order_relaxed);
          VLOG(1) << "dropped immediate " << c.imm << " from task " << peer_task_
                  << ": content immediates go to the receiver's end";
        }
        return;
    }
    return;
  }
  const uint64_t value = ContextValue(c.context);
  switch (ContextTag(c.context)) {
    case OpTag::kMessage:
      if (absl::Status s = mb_->OnMessageWritten(value); !s.ok()) Close(MessagesFailed(s));
      return;
    case OpTag::kAck:
      return;
    case OpTag::kRead:
      if (receiving_ != nullptr) receiving_->OnReadDone(static_cast<uint32_t>(value));
      return;
    case OpTag::kContent:
      // The value is the request index and the low bits of its response's serial (a striped
      // response may see its last completions after its index was taken again).
      if (sending_ != nullptr) {
        sending_->OnWriteDone(static_cast<uint32_t>(value), static_cast<uint32_t>(value >> 32));
      }
      return;
  }
}

void Channel::AcknowledgeMessages() {
  AssertOwnerThread();
  if (state_ == State::kClosed) return;
  if (absl::Status s = mb_->Acknowledge(); !s.ok()) {
    Close(absl::UnavailableError(absl::StrCat("acknowledging a control message of task ",
                                              peer_task_, " failed: ", s.message())));
  }
}

void Channel::OnControlMessage() {
  // The batch decodes into the channel's vector, whose capacity a steady channel reuses; it is
  // taken out while in use, so a nested call (none today) would simply start its own.
  std::vector<Message> batch = std::move(batch_);
  absl::Status s = mb_->OnControlMessage(&batch);
  received_for_probes_.store(mb_->received(), std::memory_order_relaxed);
  if (!s.ok()) {
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
  switch (m.type) {
    case MessageType::kMetaDataResponse:
    case MessageType::kErrorStatus:
      if (receiving_ != nullptr) return receiving_->OnAnswer(m);
      break;
    case MessageType::kTensorRequest:
      if (sending_ != nullptr) return sending_->OnRequest(m);
      break;
    case MessageType::kTensorReRequest:
      if (sending_ != nullptr) return sending_->OnReRequest(m);
      break;
  }
  Close(absl::DataLossError(
      absl::StrCat("task ", peer_task_, " sent ", MessageTypeName(m.type), " on a channel where ",
                   receiving_ != nullptr ? "it sends tensors" : "it receives them")));
}

std::optional<Channel::AwaitedAck> Channel::AwaitedAcknowledgement(absl::Time now) const {
  if (state_ != State::kReady || mb_ == nullptr) return std::nullopt;
  const uint64_t acked = mb_->acknowledged();
  // Only slots whose write completed here are owed (one still queued behind a full send queue
  // is this side's backlog).
  if (mb_->written() <= acked) {
    ack_watch_since_ = absl::InfinitePast();
    return std::nullopt;
  }
  // An ACK, or anything else the peer writes, starts the wait over: an ACK queued behind the
  // content the peer is sending on the same connection is late, not lost.
  if (ack_watch_since_ == absl::InfinitePast() || acked != ack_watch_count_ ||
      inbound_ != ack_watch_inbound_) {
    ack_watch_count_ = acked;
    ack_watch_inbound_ = inbound_;
    ack_watch_since_ = now;
  }
  return AwaitedAck{acked + 1, ack_watch_since_};
}

bool Channel::NoteIdle(absl::Time now) {
  const absl::Duration limit = env_->options.idle_close;
  idle_ = false;
  quiet_ = false;
  if (state_ != State::kReady) return false;
  auto get = [](const std::atomic<int64_t>& a) {
    return static_cast<uint64_t>(a.load(std::memory_order_relaxed));
  };
  const ChannelCounters& c = counters_;
  const uint64_t traffic = get(c.requests) + get(c.re_requests) + get(c.tensors_received) +
                           get(c.recv_errors) + get(c.tensors_sent) + get(c.meta_responses) +
                           get(c.errors_sent) +
                           (mb_ != nullptr ? mb_->messages_sent() + mb_->messages_received() : 0);
  const bool quiet =
      (receiving_ != nullptr ? !receiving_->awaiting_peer() : sending_->responses() == 0) &&
      (endpoint_ == nullptr || endpoint_->Outstanding() == 0) &&
      std::all_of(lanes_.begin(), lanes_.end(),
                  [](const auto& ep) { return ep == nullptr || ep->Outstanding() == 0; });
  if (!quiet || traffic != idle_traffic_ || idle_since_ == absl::InfinitePast()) {
    idle_traffic_ = traffic;
    idle_since_ = now;
    return false;
  }
  quiet_ = true;
  idle_ = limit > absl::ZeroDuration() && now - idle_since_ >= limit;
  return idle_;
}

void Channel::Close(const absl::Status& status) {
  AssertOwnerThread();
  if (state_ == State::kClosed) return;
  TransitionTo(State::kClosed, Event::kClose);
  close_status_ = status.ok() ? absl::CancelledError("closed") : status;
  closed_for_probes_.store(true, std::memory_order_release);
  if (status.code() != absl::StatusCode::kCancelled) {
    env_->stats->channel_errors.fetch_add(1, std::memory_order_relaxed);
    // Nothing a caller waits for goes with a channel that only had requests made ahead (a
    // peer that stopped after its last step, as every task does at the end of training):
    // that is news, not a warning.
    const bool idle = receiving_ != nullptr ? receiving_->idle() : sending_->responses() == 0;
    if (idle) {
      LOG(INFO) << Describe() << " closed with nothing pending: " << status.message();
    } else {
      LOG(WARNING) << Describe() << " closed: " << status.message();
    }
  }
  std::vector<Tensor> memory;
  if (receiving_ != nullptr) receiving_->Close(close_status_, &memory);
  if (sending_ != nullptr) sending_->Close();
  // No more operations from this side. The endpoint goes first: on a NIC, writes in flight read
  // the responses' tensors and the message buffers until its queue pair is gone. The keys
  // offered to the peer go with it: a write the peer still makes with them is refused.
  if (endpoint_ != nullptr && env_->memory != nullptr) env_->memory->DropEndpoint(endpoint_.get());
  endpoint_.reset();
  for (size_t i = 0; i < lanes_.size(); ++i) {
    if (lanes_[i] == nullptr) continue;
    if (env_->lanes[i].memory != nullptr) env_->lanes[i].memory->DropEndpoint(lanes_[i].get());
    lanes_[i].reset();
  }
  mb_.reset();
  if (receiving_ != nullptr) receiving_->copy_buffers().Clear();
  if (sending_ != nullptr) sending_->copy_buffers().Clear();
  if (!memory.empty()) {
    // The peer may still be alive and writing into these destinations.
    env_->host->Quarantine(std::move(memory), absl::Now() + env_->quarantine());
  }
}

}  // namespace tensorverbs::protocol
