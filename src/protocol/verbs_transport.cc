#include "src/protocol/verbs_transport.h"

#include <algorithm>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "src/common/coarse_clock.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"
#include "src/transport/grpc/grpc_util.h"

namespace tensorverbs::protocol {
namespace {

constexpr absl::Duration kHousekeepingInterval = absl::Milliseconds(20);
constexpr size_t kPollBatch = 64;
constexpr absl::Duration kShutdownGrace = absl::Seconds(2);

}  // namespace

class VerbsTransport::Service final : public proto::VerbsService::CallbackService {
 public:
  explicit Service(VerbsTransport* transport) : transport_(transport) {}

  grpc::ServerUnaryReactor* Connect(grpc::CallbackServerContext* context,
                                    const proto::ConnectRequest* request,
                                    proto::ConnectResponse* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    Task task = [this, request, response, reactor]() mutable {
      absl::Status s = transport_->Accept(*request, response);
      reactor->Finish(grpc_transport::ToGrpcStatus(s));
    };
    if (!transport_->Post(task)) {
      reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                   "the server is shutting down"));
    }
    return reactor;
  }

  grpc::ServerUnaryReactor* CheckChannel(grpc::CallbackServerContext* context,
                                         const proto::CheckChannelRequest* request,
                                         proto::CheckChannelResponse* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    Task task = [this, request, response, reactor]() mutable {
      transport_->CheckChannel(*request, response);
      reactor->Finish(grpc::Status::OK);
    };
    if (!transport_->Post(task)) {
      reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                   "the server is shutting down"));
    }
    return reactor;
  }

 private:
  VerbsTransport* const transport_;
};

VerbsTransport::VerbsTransport(VerbsOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<VerbsTransport>> VerbsTransport::Create(VerbsOptions options) {
  if (options.env == nullptr || options.pool == nullptr) {
    return absl::InvalidArgumentError("VerbsTransport needs a worker env and a pool");
  }
  auto transport = std::unique_ptr<VerbsTransport>(new VerbsTransport(std::move(options)));
  RETURN_IF_ERROR(transport->Start());
  return transport;
}

absl::Status VerbsTransport::Start() {
  if (options_.poll_mode == "busy") {
    poll_mode_ = PollMode::kBusy;
  } else if (options_.poll_mode == "blocking") {
    poll_mode_ = PollMode::kBlocking;
  } else if (options_.poll_mode == "adaptive") {
    poll_mode_ = PollMode::kAdaptive;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown poll mode '", options_.poll_mode,
                                                   "'; expected busy, blocking or adaptive"));
  }
  ASSIGN_OR_RETURN(Registration registration, ParseRegistration(options_.registration));
  absl::StatusOr<std::unique_ptr<fabric::Domain>> domain =
      fabric::OpenFabric(options_.fabric, options_.ofi_provider, options_.all_peers_local);
  if (!domain.ok()) {
    return absl::Status(domain.status().code(),
                        absl::StrCat("grpc+verbs: ", domain.status().message(),
                                     ", or use --protocol grpc"));
  }
  domain_ = *std::move(domain);
  memory_ = std::make_unique<RdmaMemoryMgr>(domain_.get(), options_.pool);

  channel_env_.worker = options_.env;
  channel_env_.memory = memory_.get();
  channel_env_.domain = domain_.get();
  channel_env_.stats = &stats_;
  channel_env_.registration = registration;
  channel_env_.mode = options_.mode;
  channel_env_.data_validation = options_.data_validation;
  channel_env_.message_slots = options_.message_slots;
  channel_env_.message_batch = options_.message_batch;
  channel_env_.quarantine = options_.peer_timeout;
  channel_env_.post = [this](absl::AnyInvocable<void() &&> task) { Post(task); };
  channel_env_.find_channel = [this](uint64_t id) { return FindChannel(id); };
  channel_env_.deliver = [this](Executor::Task callback) {
    if (OnProgressThread()) {
      callbacks_.push_back(std::move(callback));
    } else {
      options_.env->callback_executor->Schedule(std::move(callback));
    }
  };
  channel_env_.quarantine_memory = [this](std::vector<Tensor> memory, absl::Time until) {
    quarantine_.emplace_back(until, std::move(memory));
  };
  channel_env_.release_lent = [this](const std::string& task, uint32_t key) {
    ReleaseLent(task, key);
  };
  service_ = std::make_unique<Service>(this);

  progress_thread_ = std::thread([this] { ProgressLoop(); });
  watchdog_thread_ = std::thread([this] { WatchdogLoop(); });
  LOG(INFO) << "task " << options_.env->task_name << ": " << VerbsModeProtocol(options_.mode)
            << " over " << fabric_name()
            << ", " << options_.message_slots << " message slots (batches of up to "
            << options_.message_batch << "), " << RegistrationName(registration)
            << " registration, " << options_.poll_mode << " polling"
            << (options_.data_validation ? ", data validation on" : "");
  return absl::OkStatus();
}

VerbsTransport::~VerbsTransport() { Shutdown(); }

grpc::Service* VerbsTransport::service() { return service_.get(); }

std::string VerbsTransport::fabric_name() const {
  const fabric::Capabilities& caps = domain_->capabilities();
  return absl::StrCat(caps.backend, " (", caps.provider, ")");
}

bool VerbsTransport::Post(Task& task) {
  if (OnProgressThread()) {
    // On the progress thread (a completion, a task, or an inline user callback): no lock and
    // no wake-up, just later in this turn of the loop.
    deferred_.push_back(std::move(task));
    return true;
  }
  {
    MutexLock lock(&mu_);
    if (stopping_) return false;
    tasks_.push_back(std::move(task));
    has_tasks_.store(true, std::memory_order_release);
  }
  if (sleeping_.load()) domain_->Interrupt();
  return true;
}

bool VerbsTransport::RunDeferred() {
  bool ran = false;
  while (!deferred_.empty()) {
    std::vector<Task> batch;
    batch.swap(deferred_);
    for (Task& task : batch) std::move(task)();
    ran = true;
  }
  return ran;
}

void VerbsTransport::ProgressLoop() {
  fabric::Completion completions[kPollBatch];
  absl::Time next_housekeeping = CoarseNow();
  // The first idle turn after the last activity (adaptive mode); the fine clock is read only
  // on idle turns, so a busy loop pays for no clock reads but the coarse one.
  absl::Time idle_since = absl::InfiniteFuture();
  std::deque<Task> batch;
  absl::Status last_poll_error;
  progress_thread_id_.store(std::this_thread::get_id());
  while (true) {
    bool active = false;
    if (has_tasks_.load(std::memory_order_acquire)) {
      MutexLock lock(&mu_);
      if (tasks_.empty() && stopping_) break;
      batch.swap(tasks_);
      // While stopping, keep looking until the queue is empty.
      has_tasks_.store(stopping_, std::memory_order_relaxed);
    }
    for (Task& task : batch) {
      std::move(task)();
      active = true;
    }
    batch.clear();
    active |= RunDeferred();
    absl::StatusOr<size_t> n = domain_->Poll(absl::MakeSpan(completions));
    if (!n.ok()) {
      if (n.status() != last_poll_error) LOG(ERROR) << "grpc+verbs: polling failed: " << n.status();
      last_poll_error = n.status();
    } else if (*n > 0) {
      active = true;
      for (size_t i = 0; i < *n; ++i) {
        auto it = by_endpoint_.find(completions[i].endpoint);
        if (it != by_endpoint_.end()) it->second->OnCompletion(completions[i]);
      }
      RunDeferred();
    }
    const absl::Time coarse = CoarseNow();
    if (coarse >= next_housekeeping) {
      Housekeeping(absl::Now());
      RunDeferred();
      next_housekeeping = coarse + kHousekeepingInterval;
    }
    if (!callbacks_.empty()) {
      // One hand-off for the turn's callbacks: a wake-up per callback costs more than the
      // protocol's own work on a small tensor.
      options_.env->callback_executor->ScheduleAll(&callbacks_);
      active = true;
    }
    if (active) {
      idle_since = absl::InfiniteFuture();
      continue;
    }
    if (poll_mode_ == PollMode::kBusy) continue;
    if (poll_mode_ == PollMode::kAdaptive) {
      const absl::Time now = absl::Now();
      if (idle_since == absl::InfiniteFuture()) idle_since = now;
      if (now - idle_since < options_.poll_spin) continue;
      // Data progress is manual on libfabric's shm and tcp providers: a transfer in flight
      // moves only while this thread polls, so it does not sleep until its writes complete.
      if (OperationsInFlight()) continue;
    }
    sleeping_.store(true);
    bool work;
    {
      MutexLock lock(&mu_);
      work = !tasks_.empty() || stopping_;
    }
    if (!work) {
      absl::Status s =
          domain_->Wait(std::max(next_housekeeping - CoarseNow(), absl::Microseconds(100)));
      if (!s.ok() && s != last_poll_error) {
        LOG(ERROR) << "grpc+verbs: waiting for completions failed: " << s;
        last_poll_error = s;
      }
    }
    sleeping_.store(false);
  }
  // From here on channels close on the thread that shuts the transport down; their callbacks
  // go to the executor directly.
  progress_thread_id_.store(std::thread::id());
  options_.env->callback_executor->ScheduleAll(&callbacks_);
}

bool VerbsTransport::OperationsInFlight() const {
  // A lent tensor is about to be read, and on shm the reads progress through this side too.
  if (!lent_.empty()) return true;
  // By channel: a closed channel's endpoint is gone while by_endpoint_ still names it.
  for (const auto& [id, channel] : channels_) {
    fabric::Endpoint* endpoint = channel->endpoint();
    if (endpoint != nullptr && endpoint->Outstanding() > 0) return true;
  }
  return false;
}

void VerbsTransport::Housekeeping(absl::Time now) {
  std::vector<uint64_t> closed;
  for (auto& [id, channel] : channels_) {
    if (channel->state() == Channel::State::kClosed) {
      closed.push_back(id);
    } else if (channel->role() == Channel::Role::kOwner) {
      channel->ExpireRequests(now);
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
  quarantine_.erase(std::remove_if(quarantine_.begin(), quarantine_.end(),
                                   [now](const auto& q) { return q.first <= now; }),
                    quarantine_.end());
  // A receiver that died (or gave up) never releases what it was lent.
  for (auto it = lent_.begin(); it != lent_.end();) {
    if (it->second.expires <= now) {
      lend_keys_.Release(it->first);
      lent_.erase(it++);
    } else {
      ++it;
    }
  }
}

Channel* VerbsTransport::FindChannel(uint64_t id) {
  auto it = channels_.find(id);
  return it == channels_.end() ? nullptr : it->second.get();
}

absl::StatusOr<Channel*> VerbsTransport::OwnerChannel(const std::string& task) {
  if (auto it = owner_by_task_.find(task); it != owner_by_task_.end()) {
    Channel* c = FindChannel(it->second);
    if (c != nullptr && c->state() != Channel::State::kClosed) return c;
  }
  auto address = options_.task_addresses.find(task);
  if (address == options_.task_addresses.end()) {
    return absl::NotFoundError(absl::StrCat("task ", task, " is not in the cluster spec"));
  }
  const uint64_t id = next_channel_id_++;
  auto channel = std::make_unique<Channel>(&channel_env_, Channel::Role::kOwner, id, task);
  channel->set_peer_address(address->second);
  if (absl::Status s = channel->Init(); !s.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot create the grpc+verbs channel to task ",
                                               task, ": ", s.message()));
  }
  Channel* raw = channel.get();
  channels_.emplace(id, std::move(channel));
  by_endpoint_[raw->endpoint()] = raw;
  owner_by_task_[task] = id;

  std::shared_ptr<proto::VerbsService::Stub> stub = Stub(task, address->second);
  auto connecting = std::make_unique<Connecting>();
  proto::ConnectRequest& request = connecting->request;
  request.set_task_name(options_.env->task_name);
  request.set_incarnation(options_.env->incarnation);
  request.set_fabric(domain_->capabilities().family);
  request.set_protocol(VerbsModeProtocol(options_.mode));
  request.set_channel_id(id);
  request.mutable_end()->set_endpoint_address(raw->endpoint()->LocalAddress());
  request.mutable_end()->set_rx_addr(raw->message_buffer()->rx_addr());
  request.mutable_end()->set_rx_key(raw->message_buffer()->rx_key());
  request.mutable_end()->set_rx_slots(static_cast<uint32_t>(raw->message_buffer()->rx_slots()));
  request.mutable_end()->set_wire_version(kWireVersion);
  connecting->context.set_deadline(absl::ToChronoTime(absl::Now() + options_.connect_timeout));
  connecting->context.set_wait_for_ready(true);
  Connecting* c = connecting.get();
  connecting_.emplace(id, std::move(connecting));
  connects_in_flight_.fetch_add(1);
  stub->async()->Connect(&c->context, &c->request, &c->response, [this, id](grpc::Status s) {
    Task task = [this, id, s]() mutable { OnConnectDone(id, s); };
    Post(task);
    connects_in_flight_.fetch_sub(1);
  });
  return raw;
}

void VerbsTransport::OnConnectDone(uint64_t id, const grpc::Status& status) {
  auto node = connecting_.extract(id);
  if (node.empty()) return;
  std::unique_ptr<Connecting> connecting = std::move(node.mapped());
  Channel* channel = FindChannel(id);
  if (channel == nullptr) return;
  const std::string task = channel->peer_task();
  absl::Status result;
  if (channel->state() == Channel::State::kClosed) {
    result = absl::CancelledError("the channel was closed while it was being set up");
  } else if (!status.ok()) {
    absl::Status s = grpc_transport::FromGrpcStatus(status);
    result = absl::Status(
        s.code() == absl::StatusCode::kDeadlineExceeded ? absl::StatusCode::kUnavailable
                                                        : s.code(),
        absl::StrCat("could not set up the grpc+verbs channel to task ", task, " at ",
                     options_.task_addresses.at(task), ": ", s.message()));
  } else {
    const proto::ConnectResponse& r = connecting->response;
    result = CheckWireVersion(task, r.end().wire_version());
    if (result.ok()) {
      result = channel->Connect(r.end().endpoint_address(), r.end().rx_addr(), r.end().rx_key(),
                                static_cast<int>(r.end().rx_slots()), r.incarnation());
      if (!result.ok()) {
        result = absl::UnavailableError(absl::StrCat(
            "connecting the grpc+verbs channel to task ", task, " failed: ", result.message()));
      }
    }
  }
  if (result.ok()) {
    LOG(INFO) << channel->Describe() << " ready; peer endpoint "
              << absl::BytesToHexString(connecting->response.end().endpoint_address()).substr(0, 32)
              << ", peer incarnation " << absl::StrFormat("%016x", channel->peer_incarnation());
  } else {
    channel->Close(result);
  }
  MutexLock lock(&connect_mu_);
  connect_results_[task] = result;
}

absl::Status VerbsTransport::CheckWireVersion(const std::string& task, uint32_t version) const {
  if (version == kWireVersion) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "task ", task, " speaks grpc+verbs wire version ",
      version == 0 ? std::string("1 or older") : absl::StrCat(version), " but task ",
      options_.env->task_name, " speaks ", kWireVersion,
      "; run the same tensorverbs release on every task"));
}

absl::Status VerbsTransport::Accept(const proto::ConnectRequest& request,
                                    proto::ConnectResponse* response) {
  const std::string& task = request.task_name();
  if (request.fabric() != domain_->capabilities().family) {
    return absl::FailedPreconditionError(absl::StrCat(
        "task ", task, " uses fabric ", request.fabric(), " but task ", options_.env->task_name,
        " uses ", domain_->capabilities().family,
        "; set TENSORVERBS_FABRIC and TENSORVERBS_OFI_PROVIDER the same on every task"));
  }
  if (request.protocol() != VerbsModeProtocol(options_.mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "task ", task, " runs protocol ", request.protocol(), " but task ",
        options_.env->task_name, " runs ", VerbsModeProtocol(options_.mode),
        "; every task of a cluster must use the same --protocol"));
  }
  if (absl::Status s = CheckWireVersion(task, request.end().wire_version()); !s.ok()) return s;
  if (request.expected_incarnation() != 0 &&
      request.expected_incarnation() != options_.env->incarnation) {
    return absl::AbortedError(absl::StrFormat(
        "task %s expected incarnation %016x of task %s, which now runs %016x (restarted)", task,
        request.expected_incarnation(), options_.env->task_name, options_.env->incarnation));
  }
  // The caller sets up a new channel only when it has none: any older one from it is obsolete
  // (it restarted, or dropped that channel after an error).
  for (auto& [id, channel] : channels_) {
    if (channel->role() != Channel::Role::kAcceptor || channel->peer_task() != task) continue;
    if (channel->peer_incarnation() != request.incarnation()) {
      channel->Close(absl::AbortedError(absl::StrCat("task ", task, " restarted")));
    } else {
      channel->Close(absl::CancelledError(absl::StrCat("task ", task, " replaced the channel")));
    }
  }
  const uint64_t id = next_channel_id_++;
  auto channel = std::make_unique<Channel>(&channel_env_, Channel::Role::kAcceptor, id, task);
  channel->set_peer_channel_id(request.channel_id());
  RETURN_IF_ERROR(channel->Init());
  const proto::ChannelEnd& end = request.end();
  absl::Status s = channel->Connect(end.endpoint_address(), end.rx_addr(), end.rx_key(),
                                    static_cast<int>(end.rx_slots()), request.incarnation());
  if (!s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("task ", task, "'s channel end is unusable: ",
                                                   s.message()));
  }
  response->set_task_name(options_.env->task_name);
  response->set_incarnation(options_.env->incarnation);
  response->mutable_end()->set_endpoint_address(channel->endpoint()->LocalAddress());
  response->mutable_end()->set_rx_addr(channel->message_buffer()->rx_addr());
  response->mutable_end()->set_rx_key(channel->message_buffer()->rx_key());
  response->mutable_end()->set_rx_slots(static_cast<uint32_t>(channel->message_buffer()->rx_slots()));
  response->mutable_end()->set_wire_version(kWireVersion);
  LOG(INFO) << channel->Describe() << " ready; peer endpoint "
            << absl::BytesToHexString(end.endpoint_address()).substr(0, 32);
  by_endpoint_[channel->endpoint()] = channel.get();
  channels_.emplace(id, std::move(channel));
  return absl::OkStatus();
}

void VerbsTransport::CheckChannel(const proto::CheckChannelRequest& request,
                                  proto::CheckChannelResponse* response) {
  response->set_incarnation(options_.env->incarnation);
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

void VerbsTransport::CloseChannelsOf(const std::string& task, bool owner_only,
                                     const absl::Status& status) {
  for (auto& [id, channel] : channels_) {
    if (channel->peer_task() != task) continue;
    if (owner_only && channel->role() != Channel::Role::kOwner) continue;
    channel->Close(status);
  }
}

void VerbsTransport::Recv(std::shared_ptr<RemoteRendezvous> rendezvous, const ParsedKey& key,
                          Allocator* allocator, RecvDoneCallback done) {
  const absl::Time deadline = absl::Now() + options_.recv_timeout;
  auto holder = std::make_shared<RecvDoneCallback>(std::move(done));
  Task task = [this, rendezvous, key, allocator, deadline, holder]() mutable {
    // An abort that raced with this recv's start: its AbortStep ran before this task, so the
    // step's status already tells.
    if (absl::Status s = rendezvous->status(); !s.ok()) {
      options_.env->callback_executor->Schedule(
          [holder, s]() mutable { std::move(*holder)(s, Tensor(), false); });
      return;
    }
    const int64_t step_id = rendezvous->step_id();
    absl::StatusOr<Channel*> channel = OwnerChannel(key.src.TaskName());
    if (!channel.ok()) {
      absl::Status s = absl::Status(channel.status().code(),
                                    absl::StrCat("recv of '", key.full_key, "': ",
                                                 channel.status().message()));
      options_.env->callback_executor->Schedule(
          [holder, s]() mutable { std::move(*holder)(s, Tensor(), false); });
      return;
    }
    (*channel)->StartRecv(step_id, key, allocator, deadline, std::move(*holder));
  };
  if (!Post(task)) {
    std::move(*holder)(absl::CancelledError(absl::StrCat(
                           "recv of '", key.full_key, "': the server is shutting down")),
                       Tensor(), false);
  }
}

static_assert(grpc_transport::kMaxTensorKey == kMaxRequestIndex,
              "tensor keys and request indexes share the immediates below the reserved ones");

void VerbsTransport::Lend(
    const std::string& requester, const Tensor& tensor,
    absl::AnyInvocable<void(absl::StatusOr<grpc_transport::RemoteTensorRef>) &&> done) {
  auto holder = std::make_shared<decltype(done)>(std::move(done));
  Task task = [this, requester, tensor, holder]() mutable {
    auto& done = *holder;
    const size_t bytes = tensor.TotalBytes();
    Tensor source = tensor;
    absl::StatusOr<const fabric::MemoryRegion*> region = memory_->FindRegistered(tensor.data(), bytes);
    if (region.ok() && *region == nullptr) {
      // Not pool memory: lend a registered copy.
      const fabric::MemoryRegion* staging_region = nullptr;
      absl::StatusOr<Tensor> staged = memory_->StageCopyOf(tensor.data(), bytes, &staging_region);
      if (!staged.ok()) {
        std::move(done)(staged.status());
        return;
      }
      stats_.CountCopy(bytes, options_.env->stats);
      source = *std::move(staged);
      region = staging_region;
    }
    if (!region.ok()) {
      std::move(done)(region.status());
      return;
    }
    absl::StatusOr<uint32_t> key = lend_keys_.Allocate();
    if (!key.ok()) {
      std::move(done)(key.status());
      return;
    }
    grpc_transport::RemoteTensorRef ref;
    ref.addr = reinterpret_cast<uint64_t>(source.data());
    ref.key = (*region)->PackRemoteKey();
    ref.tensor_key = *key;
    ref.bytes = bytes;
    lent_[*key] = Lent{std::move(source), requester,
                       absl::Now() + options_.recv_timeout + options_.peer_timeout};
    stats_.content_writes.fetch_add(1, std::memory_order_relaxed);
    std::move(done)(std::move(ref));
  };
  if (!Post(task)) {
    std::move(*holder)(absl::UnavailableError(absl::StrCat(
        "task ", options_.env->task_name, " is shutting down")));
  }
}

void VerbsTransport::ReleaseLent(const std::string& task, uint32_t tensor_key) {
  auto it = lent_.find(tensor_key);
  if (it == lent_.end() || it->second.requester != task) {
    // Unknown, already released, or another task's: count and ignore.
    stats_.dropped_imms.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  lent_.erase(it);
  lend_keys_.Release(tensor_key);
}

size_t VerbsTransport::NumLentTensors() {
  return AskLoop<size_t>([this] { return lent_.size(); }).value_or(0);
}

void VerbsTransport::Pull(const std::string& task, const grpc_transport::RemoteTensorRef& ref,
                          Tensor dest, absl::AnyInvocable<void(const absl::Status&) &&> done) {
  const absl::Time deadline = absl::Now() + options_.recv_timeout;
  auto holder = std::make_shared<decltype(done)>(std::move(done));
  Task t = [this, task, ref, dest, deadline, holder]() mutable {
    absl::StatusOr<Channel*> channel = OwnerChannel(task);
    if (!channel.ok()) {
      std::move(*holder)(channel.status());
      return;
    }
    (*channel)->StartPull(ref, std::move(dest), deadline, std::move(*holder));
  };
  if (!Post(t)) {
    std::move(*holder)(absl::CancelledError(absl::StrCat(
        "task ", options_.env->task_name, " is shutting down")));
  }
}

void VerbsTransport::AbortStep(int64_t step_id, const absl::Status& status) {
  Task task = [this, step_id, status]() mutable {
    for (auto& [id, channel] : channels_) {
      if (channel->role() == Channel::Role::kOwner) channel->AbortStep(step_id, status);
    }
  };
  Post(task);
}

absl::Status VerbsTransport::ConnectPeers(absl::Duration timeout) {
  std::vector<std::string> peers;
  for (const auto& [task, address] : options_.task_addresses) {
    if (task != options_.env->task_name) peers.push_back(task);
  }
  std::sort(peers.begin(), peers.end());
  {
    MutexLock lock(&connect_mu_);
    for (const std::string& p : peers) connect_results_.erase(p);
  }
  Task task = [this, peers]() mutable {
    for (const std::string& p : peers) {
      absl::StatusOr<Channel*> c = OwnerChannel(p);
      if (!c.ok() || (*c)->state() == Channel::State::kReady) {
        MutexLock lock(&connect_mu_);
        connect_results_[p] = c.status();
      }
    }
  };
  if (!Post(task)) return absl::CancelledError("the server is shutting down");
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
  return absl::UnavailableError(absl::StrCat(
      "task ", options_.env->task_name, " could not set up grpc+verbs channels to ",
      failures.size(), " peer(s): ", absl::StrJoin(failures, "; "),
      " (raise TENSORVERBS_CONNECT_TIMEOUT_MS if peers start slowly)"));
}

size_t VerbsTransport::NumReadyChannels() {
  return AskLoop<size_t>([this] {
           size_t n = 0;
           for (auto& [id, c] : channels_) n += c->state() == Channel::State::kReady;
           return n;
         })
      .value_or(0);
}

std::shared_ptr<proto::VerbsService::Stub> VerbsTransport::Stub(const std::string& task,
                                                               const std::string& address) {
  MutexLock lock(&stubs_mu_);
  std::shared_ptr<proto::VerbsService::Stub>& stub = stubs_[task];
  if (stub == nullptr) {
    stub = proto::VerbsService::NewStub(grpc::CreateCustomChannel(
        address, grpc::InsecureChannelCredentials(), grpc_transport::ClientChannelArguments()));
  }
  return stub;
}

void VerbsTransport::WatchdogLoop() {
  const absl::Duration interval =
      std::clamp(options_.peer_timeout / 4, absl::Milliseconds(25), absl::Seconds(5));
  while (true) {
    {
      MutexLock lock(&watchdog_mu_);
      if (watchdog_mu_.AwaitWithTimeout(
              [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(watchdog_mu_) { return watchdog_stop_; },
              interval)) {
        return;
      }
    }
    // Which peers have recvs outstanding, and which incarnation served them.
    struct Probe {
      std::string task;
      uint64_t incarnation;
      uint64_t channel_id;
    };
    absl::StatusOr<std::vector<Probe>> probes = AskLoop<std::vector<Probe>>(
        [this] {
          std::vector<Probe> out;
          for (auto& [id, c] : channels_) {
            if (c->role() == Channel::Role::kOwner && c->state() == Channel::State::kReady &&
                c->pending_requests() > 0) {
              out.push_back({c->peer_task(), c->peer_incarnation(), id});
            }
          }
          return out;
        },
        absl::Seconds(5));
    if (absl::IsCancelled(probes.status())) return;
    if (!probes.ok()) continue;
    std::vector<std::thread> checks;
    for (const Probe& probe : *probes) {
      checks.emplace_back([this, probe] {
        auto address = options_.task_addresses.find(probe.task);
        if (address == options_.task_addresses.end()) return;
        std::shared_ptr<proto::VerbsService::Stub> stub = Stub(probe.task, address->second);
        grpc::ClientContext context;
        context.set_deadline(absl::ToChronoTime(absl::Now() + options_.peer_timeout));
        context.set_wait_for_ready(true);
        proto::CheckChannelRequest request;
        request.set_task_name(options_.env->task_name);
        request.set_channel_id(probe.channel_id);
        proto::CheckChannelResponse response;
        grpc::Status status = stub->CheckChannel(&context, request, &response);
        absl::Status verdict;
        if (!status.ok()) {
          verdict = absl::UnavailableError(absl::StrCat(
              "task ", probe.task, " at ", address->second,
              " stopped answering (no reply within TENSORVERBS_PEER_TIMEOUT_MS=",
              absl::ToInt64Milliseconds(options_.peer_timeout), "): ", status.error_message()));
        } else if (response.incarnation() != probe.incarnation) {
          verdict = absl::AbortedError(absl::StrFormat(
              "task %s restarted (incarnation %016x, now %016x): its tensors of the old "
              "incarnation are gone",
              probe.task, probe.incarnation, response.incarnation()));
        } else if (!response.open()) {
          verdict = absl::UnavailableError(absl::StrCat("task ", probe.task,
                                                        " closed its end of the channel: ",
                                                        response.reason()));
        }
        if (verdict.ok()) return;
        LOG(WARNING) << "grpc+verbs: " << verdict.message();
        const uint64_t id = probe.channel_id;
        Task close = [this, id, verdict]() mutable {
          if (Channel* c = FindChannel(id)) c->Close(verdict);
        };
        Post(close);
      });
    }
    for (std::thread& t : checks) t.join();
  }
}

void VerbsTransport::Shutdown() {
  {
    MutexLock lock(&mu_);
    if (stopping_ || !progress_thread_.joinable()) return;
  }
  {
    MutexLock lock(&watchdog_mu_);
    watchdog_stop_ = true;
  }
  if (watchdog_thread_.joinable()) watchdog_thread_.join();
  // Tensors a peer already took from this task's table are still on their way (a write posted
  // or about to be, a lent tensor being read): let them finish, as gRPC's shutdown lets
  // responses in progress finish, for up to kShutdownGrace.
  const absl::Time grace_end = absl::Now() + kShutdownGrace;
  while (absl::Now() < grace_end) {
    absl::StatusOr<bool> busy = AskLoop<bool>(
        [this] {
          bool any = !lent_.empty();
          for (auto& [id, c] : channels_) any |= c->responses_in_progress() > 0;
          return any;
        },
        absl::Seconds(1));
    if (!busy.ok() || !*busy) break;
    absl::SleepFor(absl::Milliseconds(1));
  }
  Task close_all = [this]() mutable {
    for (auto& [id, c] : channels_) {
      c->Close(absl::CancelledError(
          absl::StrCat("task ", options_.env->task_name, " is shutting down")));
    }
    for (auto& [id, c] : connecting_) c->context.TryCancel();
  };
  Post(close_all);
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    has_tasks_.store(true, std::memory_order_release);  // the loop looks, and sees it stop
  }
  domain_->Interrupt();
  progress_thread_.join();
  // Cancelled set-up calls finish promptly; their callbacks only touch connects_in_flight_
  // once Post refuses.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (connects_in_flight_.load() > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  channels_.clear();
  by_endpoint_.clear();
  connecting_.clear();
  quarantine_.clear();
  lent_.clear();
  memory_.reset();
}

}  // namespace tensorverbs::protocol
