#include "src/transport/verbs/channel_setup.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"
#include "src/protocol/message.h"
#include "src/rpc/grpc_util.h"

namespace tensorverbs::verbs {

using protocol::Channel;

namespace {

void FillEnd(const Channel& channel, proto::ChannelEnd* end) {
  end->set_endpoint_address(channel.endpoint()->LocalAddress());
  end->set_rx_addr(channel.message_buffer()->rx_addr());
  end->set_rx_key(channel.message_buffer()->rx_key());
  end->set_rx_slots(static_cast<uint32_t>(channel.message_buffer()->rx_slots()));
  end->set_wire_version(protocol::kWireVersion);
  end->set_device_writes(channel.env()->device_direct);
}

}  // namespace

ChannelSetup::ChannelSetup(Options options, protocol::ChannelEnv* env,
                           protocol::ProgressEngine* engine, VerbsStubs* stubs)
    : options_(std::move(options)), env_(env), engine_(engine), stubs_(stubs) {}

void ChannelSetup::AssertOnLoop() const {
  DCHECK(engine_->OnOwnerThread()) << "grpc+verbs channel state used off the progress thread";
}

Channel* ChannelSetup::Find(uint64_t id) {
  AssertOnLoop();
  auto it = channels_.find(id);
  return it == channels_.end() ? nullptr : it->second.get();
}

Channel* ChannelSetup::Add(std::unique_ptr<Channel> channel) {
  Channel* raw = channel.get();
  by_endpoint_[raw->endpoint()] = raw;
  channels_.emplace(raw->id(), std::move(channel));
  return raw;
}

void ChannelSetup::Dispatch(const fabric::Completion& c) {
  AssertOnLoop();
  auto it = by_endpoint_.find(c.endpoint);
  if (it != by_endpoint_.end()) it->second->OnCompletion(c);
}

absl::StatusOr<Channel*> ChannelSetup::OwnerChannel(const std::string& task) {
  AssertOnLoop();
  if (auto it = owner_by_task_.find(task); it != owner_by_task_.end()) {
    Channel* c = Find(it->second);
    if (c != nullptr && c->state() != Channel::State::kClosed) return c;
  }
  auto address = options_.task_addresses.find(task);
  if (address == options_.task_addresses.end()) {
    return absl::NotFoundError(absl::StrCat("task ", task, " is not in the cluster spec"));
  }
  const uint64_t id = next_channel_id_++;
  auto channel = std::make_unique<Channel>(env_, Channel::Role::kOwner, id, task);
  channel->set_peer_address(address->second);
  if (absl::Status s = channel->Init(); !s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("cannot create the grpc+verbs channel to task ", task, ": ", s.message()));
  }
  Channel* raw = Add(std::move(channel));
  owner_by_task_[task] = id;
  {
    // Until this channel's peer says otherwise: a restarted task may not write GPU memory.
    MutexLock lock(&connect_mu_);
    peer_device_writes_[task] = false;
  }

  std::shared_ptr<proto::VerbsService::Stub> stub = stubs_->Get(task, address->second);
  auto connecting = std::make_unique<Connecting>();
  proto::ConnectRequest& request = connecting->request;
  request.set_task_name(env_->worker->task_name);
  request.set_incarnation(env_->worker->incarnation);
  request.set_fabric(env_->domain->capabilities().family);
  request.set_protocol(protocol::VerbsModeProtocol(env_->mode));
  request.set_channel_id(id);
  FillEnd(*raw, request.mutable_end());
  connecting->context.set_deadline(absl::ToChronoTime(absl::Now() + options_.connect_timeout));
  connecting->context.set_wait_for_ready(true);
  Connecting* c = connecting.get();
  connecting_.emplace(id, std::move(connecting));
  connects_in_flight_.fetch_add(1);
  stub->async()->Connect(&c->context, &c->request, &c->response, [this, id](grpc::Status s) {
    engine_->Post([this, id, s]() mutable { OnConnectDone(id, s); });
    connects_in_flight_.fetch_sub(1);
  });
  return raw;
}

void ChannelSetup::OnConnectDone(uint64_t id, const grpc::Status& status) {
  auto node = connecting_.extract(id);
  if (node.empty()) return;
  std::unique_ptr<Connecting> connecting = std::move(node.mapped());
  Channel* channel = Find(id);
  if (channel == nullptr) return;
  const std::string task = channel->peer_task();
  absl::Status result;
  if (channel->state() == Channel::State::kClosed) {
    result = absl::CancelledError("the channel was closed while it was being set up");
  } else if (!status.ok()) {
    absl::Status s = rpc::FromGrpcStatus(status);
    result = absl::Status(
        s.code() == absl::StatusCode::kDeadlineExceeded ? absl::StatusCode::kUnavailable : s.code(),
        absl::StrCat("could not set up the grpc+verbs channel to task ", task, " at ",
                     options_.task_addresses.at(task), ": ", s.message()));
  } else {
    const proto::ConnectResponse& r = connecting->response;
    result = CheckWireVersion(task, r.end().wire_version());
    if (result.ok()) {
      result = channel->Connect(r.end().endpoint_address(), r.end().rx_addr(), r.end().rx_key(),
                                static_cast<int>(r.end().rx_slots()), r.incarnation());
      if (!result.ok()) {
        result = absl::UnavailableError(absl::StrCat("connecting the grpc+verbs channel to task ",
                                                     task, " failed: ", result.message()));
      }
    }
  }
  {
    MutexLock lock(&connect_mu_);
    peer_device_writes_[task] = result.ok() && connecting->response.end().device_writes();
  }
  if (result.ok()) {
    LOG(INFO) << channel->Describe() << " ready; peer endpoint "
              << absl::BytesToHexString(connecting->response.end().endpoint_address()).substr(0, 32)
              << ", peer incarnation " << absl::StrFormat("%016x", channel->peer_incarnation());
  } else {
    channel->Close(result);
  }
  RecordConnectResult(task, result);
}

bool ChannelSetup::PeerWritesDevice(const std::string& task) const {
  MutexLock lock(&connect_mu_);
  auto it = peer_device_writes_.find(task);
  return it != peer_device_writes_.end() && it->second;
}

void ChannelSetup::RecordConnectResult(const std::string& task, const absl::Status& status) {
  MutexLock lock(&connect_mu_);
  connect_results_[task] = status;
}

absl::Status ChannelSetup::CheckWireVersion(const std::string& task, uint32_t version) const {
  if (version == protocol::kWireVersion) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("task ", task, " speaks grpc+verbs wire version ",
                   version == 0 ? std::string("1 or older") : absl::StrCat(version), " but task ",
                   env_->worker->task_name, " speaks ", protocol::kWireVersion,
                   "; run the same tensorverbs release on every task"));
}

absl::Status ChannelSetup::Accept(const proto::ConnectRequest& request,
                                  proto::ConnectResponse* response) {
  AssertOnLoop();
  const std::string& task = request.task_name();
  const std::string& self = env_->worker->task_name;
  const std::string& family = env_->domain->capabilities().family;
  const char* protocol = protocol::VerbsModeProtocol(env_->mode);
  // Everything is checked before anything existing is touched: only a task of the cluster
  // spec may have a channel here, and a request that fails any check leaves the caller's
  // current channel (if any) as it was.
  if (task == self || !options_.task_addresses.contains(task)) {
    return absl::PermissionDeniedError(
        absl::StrCat("task '", absl::CEscape(task.substr(0, 256)), "' is not a peer in task ", self,
                     "'s cluster spec; every task must be started with the same cluster"));
  }
  if (request.fabric() != family) {
    return absl::FailedPreconditionError(absl::StrCat(
        "task ", task, " uses fabric ", request.fabric(), " but task ", self, " uses ", family,
        "; set TENSORVERBS_FABRIC and TENSORVERBS_OFI_PROVIDER the same on every task"));
  }
  if (request.protocol() != protocol) {
    return absl::FailedPreconditionError(
        absl::StrCat("task ", task, " runs protocol ", request.protocol(), " but task ", self,
                     " runs ", protocol, "; every task of a cluster must use the same --protocol"));
  }
  RETURN_IF_ERROR(CheckWireVersion(task, request.end().wire_version()));
  if (request.expected_incarnation() != 0 &&
      request.expected_incarnation() != env_->worker->incarnation) {
    return absl::AbortedError(absl::StrFormat(
        "task %s expected incarnation %016x of task %s, which now runs %016x (restarted)", task,
        request.expected_incarnation(), self, env_->worker->incarnation));
  }
  const uint64_t id = next_channel_id_++;
  auto channel = std::make_unique<Channel>(env_, Channel::Role::kAcceptor, id, task);
  channel->set_peer_channel_id(request.channel_id());
  RETURN_IF_ERROR(channel->Init());
  const proto::ChannelEnd& end = request.end();
  absl::Status s = channel->Connect(end.endpoint_address(), end.rx_addr(), end.rx_key(),
                                    static_cast<int>(end.rx_slots()), request.incarnation());
  if (!s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("task ", task, "'s channel end is unusable: ", s.message()));
  }
  // The caller sets up a new channel only when it has none: any older one from it is obsolete
  // (it restarted, or dropped that channel after an error). Closed only now that the new one
  // stands.
  for (auto& [other_id, other] : channels_) {
    if (other->role() != Channel::Role::kAcceptor || other->peer_task() != task) continue;
    if (other->peer_incarnation() != request.incarnation()) {
      other->Close(absl::AbortedError(absl::StrCat("task ", task, " restarted")));
    } else {
      other->Close(absl::CancelledError(absl::StrCat("task ", task, " replaced the channel")));
    }
  }
  response->set_task_name(self);
  response->set_incarnation(env_->worker->incarnation);
  FillEnd(*channel, response->mutable_end());
  LOG(INFO) << channel->Describe() << " ready; peer endpoint "
            << absl::BytesToHexString(end.endpoint_address()).substr(0, 32);
  Add(std::move(channel));
  return absl::OkStatus();
}

void ChannelSetup::CheckChannel(const proto::CheckChannelRequest& request,
                                proto::CheckChannelResponse* response) {
  AssertOnLoop();
  response->set_incarnation(env_->worker->incarnation);
  if (request.owned_channel_id() != 0) {
    // The acceptor of a channel this task owns asks whether this end still stands.
    auto it = channels_.find(request.owned_channel_id());
    if (it != channels_.end() && it->second->role() == Channel::Role::kOwner &&
        it->second->peer_task() == request.task_name()) {
      response->set_open(it->second->state() != Channel::State::kClosed);
      if (!response->open()) {
        response->set_reason(std::string(it->second->close_status().message()));
      }
      return;
    }
    response->set_open(false);
    response->set_reason("no such channel (it was closed and replaced, or this task restarted)");
    return;
  }
  for (auto& [id, channel] : channels_) {
    if (channel->role() == Channel::Role::kAcceptor &&
        channel->peer_task() == request.task_name() &&
        channel->peer_channel_id() == request.channel_id()) {
      response->set_open(channel->state() != Channel::State::kClosed);
      if (!response->open()) response->set_reason(std::string(channel->close_status().message()));
      return;
    }
  }
  response->set_open(false);
  auto it = closed_accepted_.find({request.task_name(), request.channel_id()});
  response->set_reason(it != closed_accepted_.end() ? std::string(it->second.message())
                                                    : "no such channel (this task restarted?)");
}

void ChannelSetup::Housekeeping(absl::Time now) {
  AssertOnLoop();
  std::vector<uint64_t> closed;
  for (auto& [id, channel] : channels_) {
    if (channel->state() == Channel::State::kClosed) {
      closed.push_back(id);
    } else if (channel->role() == Channel::Role::kOwner) {
      channel->ExpireRequests(now);
    } else {
      channel->ExpireResponses(now);
    }
  }
  for (uint64_t id : closed) {
    Channel* c = channels_[id].get();
    if (c->role() == Channel::Role::kAcceptor) {
      if (closed_accepted_.size() >= 1024) closed_accepted_.clear();
      closed_accepted_[{c->peer_task(), c->peer_channel_id()}] = c->close_status();
    }
    absl::erase_if(by_endpoint_, [c](const auto& entry) { return entry.second == c; });
    auto owner = owner_by_task_.find(c->peer_task());
    if (owner != owner_by_task_.end() && owner->second == id) owner_by_task_.erase(owner);
    if (connecting_.contains(id)) continue;  // its RPC callback still refers to it by id
    channels_.erase(id);
  }
}

bool ChannelSetup::OperationsInFlight() const {
  // By channel: a closed channel's endpoint is gone while by_endpoint_ still names it.
  for (const auto& [id, channel] : channels_) {
    fabric::Endpoint* endpoint = channel->endpoint();
    if (endpoint != nullptr && endpoint->Outstanding() > 0) return true;
  }
  return false;
}

bool ChannelSetup::AwaitingPeers() const {
  for (const auto& [id, c] : channels_) {
    if (c->state() == protocol::Channel::State::kReady && c->awaiting_peer()) return true;
  }
  return false;
}

bool ChannelSetup::ResponsesInProgress() const {
  for (const auto& [id, c] : channels_) {
    if (c->responses_in_progress() > 0) return true;
  }
  return false;
}

std::vector<protocol::ChannelSnapshot> ChannelSetup::Snapshot() const {
  AssertOnLoop();
  std::vector<protocol::ChannelSnapshot> out;
  out.reserve(channels_.size());
  for (const auto& [id, channel] : channels_) out.push_back(channel->Snapshot());
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return std::tie(a.peer_task, a.receives) < std::tie(b.peer_task, b.receives);
  });
  return out;
}

size_t ChannelSetup::NumReady() const {
  AssertOnLoop();
  size_t n = 0;
  for (const auto& [id, c] : channels_) n += c->state() == Channel::State::kReady;
  return n;
}

std::vector<ChannelSetup::Probe> ChannelSetup::PendingPeers() const {
  AssertOnLoop();
  std::vector<Probe> out;
  const absl::flat_hash_set<std::string> lent_to =
      options_.lent_to ? options_.lent_to() : absl::flat_hash_set<std::string>();
  for (const auto& [id, c] : channels_) {
    if (c->role() == Channel::Role::kOwner && c->state() != Channel::State::kClosed &&
        c->pending_requests() > 0) {
      out.push_back({c->peer_task(), options_.task_addresses.at(c->peer_task()),
                     c->peer_incarnation(), id, c->state() == Channel::State::kConnecting});
    } else if (c->role() == Channel::Role::kAcceptor && c->state() == Channel::State::kReady &&
               (c->holds_state_for_peer() || lent_to.contains(c->peer_task()))) {
      auto address = options_.task_addresses.find(c->peer_task());
      if (address == options_.task_addresses.end()) continue;
      Probe probe{c->peer_task(), address->second, c->peer_incarnation(), id};
      probe.accepting = true;
      probe.peer_channel_id = c->peer_channel_id();
      out.push_back(std::move(probe));
    }
  }
  return out;
}

void ChannelSetup::AbortStep(int64_t step_id, const absl::Status& status) {
  AssertOnLoop();
  for (auto& [id, channel] : channels_) {
    if (channel->role() == Channel::Role::kOwner) channel->AbortStep(step_id, status);
  }
}

void ChannelSetup::CloseAll(const absl::Status& status) {
  AssertOnLoop();
  for (auto& [id, c] : channels_) c->Close(status);
  for (auto& [id, c] : connecting_) c->context.TryCancel();
}

absl::Status ChannelSetup::ConnectPeers(const std::string& self, absl::Duration timeout) {
  std::vector<std::string> peers;
  for (const auto& [task, address] : options_.task_addresses) {
    if (task != self) peers.push_back(task);
  }
  std::sort(peers.begin(), peers.end());
  {
    MutexLock lock(&connect_mu_);
    for (const std::string& p : peers) connect_results_.erase(p);
  }
  const bool posted = engine_->Post([this, peers]() mutable {
    for (const std::string& p : peers) {
      absl::StatusOr<Channel*> c = OwnerChannel(p);
      if (!c.ok() || (*c)->state() == Channel::State::kReady) RecordConnectResult(p, c.status());
    }
  });
  if (!posted) return absl::CancelledError("the server is shutting down");
  MutexLock lock(&connect_mu_);
  connect_mu_.AwaitWithTimeout(
      [this, &peers]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(connect_mu_) {
        for (const std::string& p : peers) {
          if (!connect_results_.contains(p)) return false;
        }
        return true;
      },
      timeout);
  std::vector<std::string> failures;
  for (const std::string& p : peers) {
    auto it = connect_results_.find(p);
    if (it == connect_results_.end()) {
      failures.push_back(absl::StrCat(p, ": no answer within ", absl::FormatDuration(timeout)));
    } else if (!it->second.ok()) {
      failures.push_back(std::string(it->second.message()));
    }
  }
  if (failures.empty()) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat("task ", self, " could not set up grpc+verbs channels to ", failures.size(),
                   " peer(s): ", absl::StrJoin(failures, "; "),
                   " (raise TENSORVERBS_CONNECT_TIMEOUT_MS if peers start slowly)"));
}

void ChannelSetup::Shutdown(absl::Duration timeout) {
  // Cancelled set-up calls finish promptly; their callbacks only touch connects_in_flight_
  // once the engine refuses posts.
  const absl::Time deadline = absl::Now() + timeout;
  while (connects_in_flight_.load() > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  channels_.clear();
  by_endpoint_.clear();
  connecting_.clear();
}

}  // namespace tensorverbs::verbs
