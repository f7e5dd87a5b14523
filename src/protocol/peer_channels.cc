#include "src/protocol/peer_channels.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"
#include "src/protocol/message.h"

namespace tensorverbs::protocol {
namespace {

// An owner lists every lane it made; an acceptor, answering, the lanes it connected.
void FillEnd(Channel& channel, proto::ChannelEnd* end) {
  end->set_endpoint_address(channel.endpoint()->LocalAddress());
  end->set_rx_addr(channel.message_buffer()->rx_addr());
  end->set_rx_key(channel.message_buffer()->rx_key());
  end->set_rx_slots(static_cast<uint32_t>(channel.message_buffer()->rx_slots()));
  end->set_wire_version(kWireVersion);
  end->set_device_writes(channel.env()->device_direct);
  const std::vector<fabric::Endpoint*> lanes = channel.role() == Channel::Role::kOwner
                                                   ? channel.FurtherLaneEndpoints()
                                                   : channel.AgreedLaneEndpoints();
  for (size_t i = 0; i < lanes.size(); ++i) {
    proto::LaneEnd* lane = end->add_lanes();
    lane->set_endpoint_address(lanes[i]->LocalAddress());
    lane->set_source(channel.env()->lanes[i].source);
    if (absl::StatusOr<Channel::LaneProbe> probe = channel.LaneProbeTarget(i + 1); probe.ok()) {
      lane->set_probe_addr(probe->addr);
      lane->set_probe_key(std::string(probe->key.view()));
    }
  }
}

// The peer's probe words, lane 1 first (an empty key where it gave none).
std::vector<Channel::LaneProbe> LaneProbes(const proto::ChannelEnd& end) {
  std::vector<Channel::LaneProbe> out;
  for (const proto::LaneEnd& lane : end.lanes()) {
    if (out.size() + 1 >= kMaxLanes) break;
    Channel::LaneProbe p;
    p.addr = lane.probe_addr();
    if (lane.probe_key().size() <= fabric::RemoteKey::kCapacity) p.key = lane.probe_key();
    out.push_back(std::move(p));
  }
  return out;
}

// The peer's further lanes' addresses, at most kMaxLanes - 1 of them.
std::vector<std::string> LaneAddresses(const proto::ChannelEnd& end) {
  std::vector<std::string> out;
  for (const proto::LaneEnd& lane : end.lanes()) {
    if (out.size() + 1 >= kMaxLanes) break;
    out.push_back(lane.endpoint_address());
  }
  return out;
}

}  // namespace

PeerChannels::PeerChannels(Options options, FabricContexts* fabrics, ChannelTable* table,
                           ProgressEngine* engine)
    : options_(std::move(options)),
      fabrics_(fabrics),
      env_(&fabrics->primary().env),
      table_(table),
      engine_(engine) {}

FabricContext& PeerChannels::ContextFor(const std::string& task) const {
  if (FabricContext* local = fabrics_->FirstWith(FabricContext::Reach::kSameHost);
      local != nullptr && options_.same_host_tasks.contains(task) && !elsewhere_.contains(task)) {
    return *local;
  }
  return fabrics_->primary();
}

void PeerChannels::AssertOnLoop() const {
  DCHECK(engine_->OnOwnerThread()) << "grpc+verbs channel state used off the progress thread";
}

void PeerChannels::StartRecv(RecvStart r) {
  AssertOnLoop();
  auto fail = [this, &r](const absl::Status& s) { env_->FailRecv(std::move(r.done), s); };
  // An abort that raced with this recv's start: its AbortStep ran before this task, so the
  // step's status already tells.
  if (absl::Status s = r.rendezvous->status(); !s.ok()) {
    fail(s);
    return;
  }
  if (std::optional<Tensor> landed =
          landed_.Take(r.key->src_task, r.key->key.full_key, r.rendezvous->step_id())) {
    env_->CountRecv(absl::OkStatus(), *landed);
    env_->host->Deliver(
        {std::move(r.done), absl::OkStatus(), *std::move(landed), false, r.landing.quick_callback});
    return;
  }
  absl::StatusOr<Channel*> channel = OwnerChannel(r.key->src_task);
  if (!channel.ok()) {
    fail(absl::Status(channel.status().code(), absl::StrCat("recv of '", r.key->key.full_key,
                                                            "': ", channel.status().message())));
    return;
  }
  if (r.expected_dtype != DataType::kInvalid && DataTypeCanMemCopy(r.expected_dtype)) {
    // The caller knows what comes: as good as the meta-data of an earlier step of this key.
    if (absl::StatusOr<uint64_t> bytes =
            Tensor::AllocationBytes(r.expected_dtype, r.expected_shape);
        bytes.ok()) {
      TensorMetaData meta;
      meta.dtype = r.expected_dtype;
      meta.shape = r.expected_shape;
      meta.tensor_bytes = *bytes;
      // The cache of the channel's own fabric, which its requests read.
      RdmaMemoryMgr* memory = (*channel)->env()->memory;
      const TensorMetaData* cached = memory->CachedMeta(r.key->key.full_key);
      if (cached == nullptr || *cached != meta) memory->CacheMeta(r.key->key.full_key, meta);
    }
  }
  // An owner channel: the side that receives is there.
  (*channel)->receiving()->StartRecv(r.rendezvous->step_id(), std::move(r.key), r.allocator,
                                     std::move(r.landing), r.deadline, std::move(r.done));
}

void PeerChannels::AbortStep(int64_t step_id, const absl::Status& status) {
  AssertOnLoop();
  landed_.DropStep(step_id);
  table_->AbortStep(step_id, status);
}

void PeerChannels::Expire(absl::Time now) { landed_.Expire(now); }

absl::StatusOr<Channel*> PeerChannels::OwnerChannel(const std::string& task) {
  AssertOnLoop();
  if (Channel* c = table_->OwnerFor(task)) return c;
  auto address = options_.task_addresses.find(task);
  if (address == options_.task_addresses.end()) {
    return absl::NotFoundError(absl::StrCat("task ", task, " is not in the cluster spec"));
  }
  const uint64_t id = table_->NextId();
  ChannelEnv* env = &ContextFor(task).env;
  auto channel = std::make_unique<Channel>(env, Channel::Role::kOwner, id, task);
  channel->set_peer_address(address->second);
  if (absl::Status s = channel->Init(); !s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("cannot create the grpc+verbs channel to task ", task, ": ", s.message()));
  }
  Channel* raw = table_->Add(std::move(channel));
  {
    // A first channel to `task` goes by what its probe said, so that recvs issued while it is
    // set up can land in GPU memory directly. A later one goes by nothing until its peer
    // answers: a restarted task may not write GPU memory.
    MutexLock lock(&connect_mu_);
    PeerWrites& writes = peer_writes_[task];
    if (writes.channeled) writes.device = false;
    writes.channeled = true;
  }

  proto::ConnectRequest request;
  request.set_task_name(env_->worker->task_name);
  request.set_incarnation(env_->worker->incarnation);
  request.set_fabric(env->domain->capabilities().family);
  request.set_protocol(VerbsModeProtocol(env_->options.mode));
  request.set_channel_id(id);
  request.set_host(fabric::ThisHostIdentity());
  FillEnd(*raw, request.mutable_end());
  connecting_.insert(id);
  env_->host->Connect(task, address->second, request,
                      [this, id](absl::StatusOr<proto::ConnectResponse> answer) {
                        OnConnectAnswer(id, std::move(answer));
                      });
  return raw;
}

void PeerChannels::OnConnectAnswer(uint64_t id, absl::StatusOr<proto::ConnectResponse> answer) {
  AssertOnLoop();
  if (connecting_.erase(id) == 0) return;
  Channel* channel = table_->Find(id);
  if (channel == nullptr) return;
  const std::string task = channel->peer_task();
  absl::Status result;
  if (channel->state() == Channel::State::kClosed) {
    result = absl::CancelledError("the channel was closed while it was being set up");
  } else if (!answer.ok()) {
    const absl::Status& s = answer.status();
    result = absl::Status(
        s.code() == absl::StatusCode::kDeadlineExceeded ? absl::StatusCode::kUnavailable : s.code(),
        absl::StrCat("could not set up the grpc+verbs channel to task ", task, " at ",
                     options_.task_addresses.at(task), ": ", s.message()));
  } else if (const proto::ConnectResponse& r = *answer;
             fabric::SameHostOnly(channel->env()->domain->capabilities().family) &&
             (!r.refused().empty() || r.host() != fabric::ThisHostIdentity())) {
    const std::string why = !r.refused().empty()
                                ? r.refused()
                                : absl::StrCat("it runs on host ", r.host(), ", this task on ",
                                               fabric::ThisHostIdentity());
    if (channel->env() != env_) {
      // Its address is local, yet it is elsewhere (another network namespace, a container
      // behind a forwarded port): the network fabric reaches it. Once per peer.
      elsewhere_.insert(task);
      LOG(WARNING) << "task " << task << " at " << options_.task_addresses.at(task)
                   << " is not on this host after all (" << why << "); its channels go over "
                   << fabrics_->primary().Name() << " instead";
      channel->Close(absl::UnavailableError(absl::StrCat(
          "the same-host channel to task ", task, " was refused (", why,
          "); the recvs that started it fail, later ones go over the network fabric")));
      // Set up over the network fabric at once: wait-for-peers, which started this channel,
      // waits for that one.
      absl::StatusOr<Channel*> again = OwnerChannel(task);
      if (!again.ok()) RecordConnectResult(task, again.status());
      return;
    }
    result = absl::FailedPreconditionError(absl::StrCat(
        "task ", task, " cannot share the same-host fabric with task ", env_->worker->task_name,
        ": ", why, "; set TENSORVERBS_FABRIC to a network fabric (ofi, ibverbs)"));
  } else {
    result = CheckWireVersion(task, r.end().wire_version());
    if (result.ok()) {
      // The lanes first: a channel is ready with all of them. The acceptor answered with only
      // the lanes it connected, so the two ends agree on as many as both connect.
      result = channel->ConnectLanes(LaneAddresses(r.end()));
      if (result.ok()) {
        result = channel->Connect(r.end().endpoint_address(), r.end().rx_addr(), r.end().rx_key(),
                                  static_cast<int>(r.end().rx_slots()), r.incarnation());
      }
      if (result.ok()) {
        channel->SetPeerLaneProbes(LaneProbes(r.end()));
        channel->ProbeLanes();
      }
      if (!result.ok()) {
        result = absl::UnavailableError(absl::StrCat("connecting the grpc+verbs channel to task ",
                                                     task, " failed: ", result.message()));
      }
    }
  }
  {
    MutexLock lock(&connect_mu_);
    peer_writes_[task].device = result.ok() && answer->end().device_writes();
  }
  if (result.ok()) {
    LOG(INFO) << channel->Describe() << " ready; peer endpoint "
              << absl::BytesToHexString(answer->end().endpoint_address()).substr(0, 32)
              << ", peer incarnation " << absl::StrFormat("%016x", channel->peer_incarnation());
  } else {
    channel->Close(result);
  }
  RecordConnectResult(task, result);
}

bool PeerChannels::PeerWritesDevice(const std::string& task) const {
  MutexLock lock(&connect_mu_);
  auto it = peer_writes_.find(task);
  return it != peer_writes_.end() && it->second.device;
}

void PeerChannels::NoteProbedPeer(const std::string& task, bool device_writes) {
  MutexLock lock(&connect_mu_);
  PeerWrites& writes = peer_writes_[task];
  if (!writes.channeled) writes.device = device_writes;
}

void PeerChannels::RecordConnectResult(const std::string& task, const absl::Status& status) {
  MutexLock lock(&connect_mu_);
  connect_results_[task] = status;
}

absl::Status PeerChannels::CheckWireVersion(const std::string& task, uint32_t version) const {
  if (version == kWireVersion) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("task ", task, " speaks grpc+verbs wire version ",
                   version == 0 ? std::string("1 or older") : absl::StrCat(version), " but task ",
                   env_->worker->task_name, " speaks ", kWireVersion,
                   "; run the same tensorverbs release on every task"));
}

absl::Status PeerChannels::Accept(const proto::ConnectRequest& request,
                                  proto::ConnectResponse* response) {
  AssertOnLoop();
  const std::string& task = request.task_name();
  const std::string& self = env_->worker->task_name;
  const char* protocol = VerbsModeProtocol(env_->options.mode);
  // Everything is checked before anything existing is touched: only a task of the cluster
  // spec may have a channel here, and a request that fails any check leaves the caller's
  // current channel (if any) as it was.
  if (task == self || !options_.task_addresses.contains(task)) {
    return absl::PermissionDeniedError(
        absl::StrCat("task '", absl::CEscape(task.substr(0, 256)), "' is not a peer in task ", self,
                     "'s cluster spec; every task must be started with the same cluster"));
  }
  FabricContext* context = fabrics_->OfFamily(request.fabric());
  ChannelEnv* env = context != nullptr ? &context->env : nullptr;
  if (env == nullptr && !fabric::SameHostOnly(request.fabric())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "task ", task, " uses fabric ", request.fabric(), " but task ", self, " uses ",
        fabrics_->Families(),
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
  response->set_host(fabric::ThisHostIdentity());
  if (fabric::SameHostOnly(request.fabric()) &&
      (env == nullptr || request.host() != fabric::ThisHostIdentity())) {
    // Checked, not trusted from the address: the caller must really share this host for the
    // same-host fabric to reach it, and this task must have that fabric open (it has not when
    // it counts the caller as elsewhere). Answered, not failed, so that the caller falls back.
    response->set_refused(
        env == nullptr
            ? absl::StrCat("task ", self, " has no same-host fabric open: it counts task ", task,
                           " as on another host")
            : absl::StrCat("task ", task, " runs on host ", request.host(), " and task ", self,
                           " on ", fabric::ThisHostIdentity()));
    LOG(INFO) << "task " << self << " refused the same-host fabric to task " << task << ": "
              << response->refused();
    return absl::OkStatus();
  }
  const uint64_t id = table_->NextId();
  auto channel = std::make_unique<Channel>(env, Channel::Role::kAcceptor, id, task);
  channel->set_peer_channel_id(request.channel_id());
  RETURN_IF_ERROR(channel->Init());
  const proto::ChannelEnd& end = request.end();
  absl::Status s = channel->ConnectLanes(LaneAddresses(end));
  channel->SetPeerLaneProbes(LaneProbes(end));
  if (s.ok()) {
    s = channel->Connect(end.endpoint_address(), end.rx_addr(), end.rx_key(),
                         static_cast<int>(end.rx_slots()), request.incarnation());
  }
  if (!s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("task ", task, "'s channel end is unusable: ", s.message()));
  }
  // The caller sets up a new channel only when it has none: any older one from it is obsolete
  // (it restarted, or dropped that channel after an error). Closed only now that the new one
  // stands.
  table_->CloseAcceptedFrom(task, request.incarnation(), /*keep=*/nullptr);
  response->set_task_name(self);
  response->set_incarnation(env_->worker->incarnation);
  FillEnd(*channel, response->mutable_end());
  LOG(INFO) << channel->Describe() << " ready; peer endpoint "
            << absl::BytesToHexString(end.endpoint_address()).substr(0, 32);
  table_->Add(std::move(channel));
  return absl::OkStatus();
}

void PeerChannels::CheckChannel(const proto::CheckChannelRequest& request,
                                proto::CheckChannelResponse* response) const {
  response->set_incarnation(env_->worker->incarnation);
  // The acceptor of a channel this task owns asks whether this end still stands; or the owner
  // of a channel this task accepted asks about that one.
  const ChannelTable::ProbeAnswer answer =
      request.owned_channel_id() != 0
          ? table_->ProbeOwned(request.task_name(), request.owned_channel_id())
          : table_->ProbeAccepted(request.task_name(), request.channel_id());
  response->set_open(answer.open);
  if (!answer.open) response->set_reason(answer.reason);
  response->set_closed_as_routine(answer.routine);
  response->set_messages_received(answer.messages_received);
  if (std::optional<absl::Duration> age = engine_->IdlePollAge()) {
    response->set_idle_poll_age_us(absl::ToInt64Microseconds(*age));
  }
}

bool PeerChannels::MessageLost(const Channel::AwaitedAck& awaited, uint64_t peer_received,
                               std::optional<absl::Duration> idle_poll_age, absl::Time probe_sent,
                               absl::Duration margin) {
  if (peer_received >= awaited.slots || !idle_poll_age.has_value()) return false;
  // The answer came after the probe was sent, so the idle poll was no earlier than this.
  return probe_sent - *idle_poll_age > awaited.since + margin;
}

std::vector<PeerChannels::Probe> PeerChannels::PendingPeers(bool spare_heard) const {
  AssertOnLoop();
  std::vector<Probe> out;
  const absl::flat_hash_set<std::string> lent_to =
      options_.lent_to ? options_.lent_to() : absl::flat_hash_set<std::string>();
  const absl::Time now = absl::Now();
  table_->ForEach([&](const Channel& c) {
    const std::optional<Channel::AwaitedAck> awaited = c.AwaitedAcknowledgement(now);
    // A ready channel its peer wrote into since the last round needs no probe this round.
    if (c.state() == Channel::State::kReady && c.HeardSinceLastLook() && spare_heard) return;
    if (c.role() == Channel::Role::kOwner && c.state() != Channel::State::kClosed &&
        c.receiving()->pending_requests() > 0) {
      Probe probe{c.peer_task(), options_.task_addresses.at(c.peer_task()), c.peer_incarnation(),
                  c.id(), c.state() == Channel::State::kConnecting};
      probe.awaited = awaited;
      out.push_back(std::move(probe));
    } else if (c.role() == Channel::Role::kAcceptor && c.state() == Channel::State::kReady &&
               (c.sending()->holds_state_for_peer() || lent_to.contains(c.peer_task()) ||
                c.idle())) {
      auto address = options_.task_addresses.find(c.peer_task());
      if (address == options_.task_addresses.end()) return;
      Probe probe{c.peer_task(), address->second, c.peer_incarnation(), c.id()};
      probe.accepting = true;
      probe.idle = c.idle();
      probe.idle_only = !c.sending()->holds_state_for_peer() && !lent_to.contains(c.peer_task());
      probe.peer_channel_id = c.peer_channel_id();
      probe.awaited = awaited;
      out.push_back(std::move(probe));
    }
  });
  return out;
}

absl::Status PeerChannels::ConnectPeers(absl::Duration timeout) {
  const std::string& self = env_->worker->task_name;
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

}  // namespace tensorverbs::protocol
