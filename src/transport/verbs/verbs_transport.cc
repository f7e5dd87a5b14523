#include "src/transport/verbs/verbs_transport.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/common/coarse_clock.h"
#include "src/common/logging.h"
#include "src/common/net_address.h"
#include "src/common/status_macros.h"
#include "src/fabric/rails.h"
#include "src/protocol/local_tensor_inbox.h"
#include "src/transport/verbs/connect_calls.h"
#include "src/transport/verbs/lent_tensors.h"
#include "src/transport/verbs/peer_watchdog.h"
#include "src/transport/verbs/verbs_service.h"
#include "src/transport/verbs/verbs_stubs.h"

namespace tensorverbs::verbs {
namespace {

constexpr absl::Duration kShutdownGrace = absl::Seconds(2);

}  // namespace

VerbsOptions VerbsOptions::FromConfig(const Config& config) {
  VerbsOptions o;
  o.transfer = TransferSettings::FromConfig(config);
  // Config::FromEnvironment accepted only the names ParseRegistration knows.
  o.channel.registration =
      protocol::ParseRegistration(config.registration).value_or(o.channel.registration);
  o.channel.data_validation = config.data_validation;
  o.channel.message_slots = config.message_slots;
  o.channel.message_batch = config.message_batch;
  o.channel.idle_close = config.channel_idle;
  o.channel.push = config.push;
  o.channel.push_max_destinations = config.push_max_destinations;
  o.channel.push_max_bytes = config.push_max_bytes;
  o.channel.max_pending_recvs = config.max_pending_recvs;
  o.channel.large_in_flight = config.large_in_flight;
  o.channel.stripe_bytes = config.stripe_bytes;
  o.channel.stripe_by_rate = config.stripe_by_rate;
  for (absl::string_view rail : absl::StrSplit(config.rails, ',', absl::SkipWhitespace())) {
    o.rails.emplace_back(absl::StripAsciiWhitespace(rail));
  }
  o.fabric = config.fabric;
  o.ofi_provider = config.ofi_provider;
  o.rdma = config.rdma;
  o.poll_mode = config.poll_mode;
  o.poll_spin = config.poll_spin;
  o.inline_callback_limit = config.inline_callback_limit;
  o.waiter_progress = config.waiter_progress;
  o.shmem_copy_threads = config.shmem_copy_threads;
  o.shmem_peer_copy = config.shmem_peer_copy;
  o.ofi_shared_endpoint = config.ofi_shared_endpoint;
  o.remote_keys = config.remote_keys;
  o.gpu_direct = config.gpu_direct;
  return o;
}

namespace {

// The host part of this task's address in the cluster spec, without an IPv6 address's
// brackets: the address its peers reach it at, so the one its fabric endpoints should bind to.
// A wildcard binds nothing in particular: empty.
std::string SourceAddressOf(const absl::flat_hash_map<std::string, std::string>& task_addresses,
                            const std::string& task_name) {
  auto it = task_addresses.find(task_name);
  if (it == task_addresses.end()) return "";
  const absl::string_view host = HostOf(it->second);
  if (host == "0.0.0.0" || host == "::" || host == "*") return "";
  return std::string(host);
}

}  // namespace

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
  ASSIGN_OR_RETURN(protocol::PollMode poll_mode, protocol::ParsePollMode(options_.poll_mode));
  fabric::FabricChoice choice;
  choice.fabric = options_.fabric;
  choice.ofi_provider = options_.ofi_provider;
  choice.all_peers_local = options_.all_peers_local;
  choice.rdma = options_.rdma;
  choice.copy_threads = options_.shmem_copy_threads;
  choice.peer_copy = options_.shmem_peer_copy;
  choice.ofi_shared_endpoint = options_.ofi_shared_endpoint;
  choice.source_address = SourceAddressOf(options_.task_addresses, options_.env->task_name);
  if (options_.gpu_direct) choice.device_memory = options_.device_memory;
  // grpc+gdr lends tensors through the registrations of one fabric (LentTensors), so its peers
  // share that one.
  choice.some_peers_local = options_.same_host_tasks.has_value() &&
                            !options_.same_host_tasks->empty() &&
                            options_.channel.mode != protocol::VerbsMode::kGdr;
  absl::StatusOr<std::unique_ptr<fabric::Domain>> domain = fabric::OpenFabric(choice);
  if (!domain.ok()) {
    return absl::Status(
        domain.status().code(),
        absl::StrCat("grpc+verbs: ", domain.status().message(), ", or use --protocol grpc"));
  }
  if (options_.remote_keys != "per-channel" && options_.remote_keys != "shared") {
    return absl::InvalidArgumentError(absl::StrCat("unknown remote keys '", options_.remote_keys,
                                                   "'; expected per-channel or shared"));
  }
  table_ = std::make_unique<protocol::ChannelTable>([this] { return engine_->OnOwnerThread(); });

  // What the channels of every fabric share; each context adds its domain and registrations.
  protocol::ChannelEnv shared;
  shared.worker = options_.env;
  shared.stats = &stats_;
  shared.transfer = options_.transfer;
  shared.options = options_.channel;
  shared.host = &host_;
  shared.channels = table_.get();
  auto add_context = [this, &shared](protocol::FabricContext::Reach reach,
                                     std::unique_ptr<fabric::Domain> opened) {
    auto memory = std::make_unique<protocol::RdmaMemoryMgr>(
        opened.get(), options_.pool, protocol::RemoteAccessFor(options_.channel.mode),
        options_.remote_keys == "per-channel" && opened->capabilities().channel_keys);
    protocol::FabricContext& context =
        fabrics_.Add(reach, std::move(opened), std::move(memory), shared);
    context.env.device_direct = context.domain->capabilities().device_memory &&
                                options_.channel.registration == protocol::Registration::kPool &&
                                options_.channel.mode == protocol::VerbsMode::kZeroCopy &&
                                !options_.channel.data_validation;
  };
  add_context(protocol::FabricContext::Reach::kAnyPeer, *std::move(domain));
  RETURN_IF_ERROR(OpenLanes(choice, add_context));
  if (fabric::OpensSameHostFabric(choice)) {
    absl::StatusOr<std::unique_ptr<fabric::Domain>> local = fabric::OpenSameHostFabric(choice);
    if (local.ok()) {
      add_context(protocol::FabricContext::Reach::kSameHost, *std::move(local));
    } else {
      LOG(WARNING) << "task " << options_.env->task_name << ": the same-host fabric cannot open ("
                   << local.status().message() << "); the peers on this host go over "
                   << fabric_name() << " too";
    }
  }
  // A sender's local tensors reach the responses of every fabric through one inbox.
  local_tensors_ = std::make_unique<protocol::LocalTensorInbox>(&env());
  for (const auto& context : fabrics_) context->env.local_tensors = local_tensors_.get();

  protocol::ProgressEngine::Options engine_options;
  engine_options.poll_mode = poll_mode;
  engine_options.poll_spin = options_.poll_spin;
  engine_options.inline_callback_limit = options_.inline_callback_limit;
  engine_options.waiters_drive = options_.waiter_progress;
  engine_options.name = absl::StrCat("grpc+verbs over ", fabric_name());
  protocol::ProgressEngine::Hooks hooks;
  hooks.on_completion = [this](const fabric::Completion& c) { table_->Dispatch(c); };
  hooks.housekeeping = [this](absl::Time now) { Housekeeping(now); };
  hooks.operations_in_flight = [this] { return OperationsInFlight(); };
  hooks.awaiting_peer = [this] { return table_->AwaitingPeers(); };
  engine_ = std::make_unique<protocol::ProgressEngine>(
      fabrics_.polled(), options_.env->callback_executor, engine_options, std::move(hooks));

  std::shared_ptr<const rpc::RpcSecurity> security =
      options_.security != nullptr ? options_.security : rpc::RpcSecurity::Insecure();
  stubs_ = std::make_unique<VerbsStubs>(security);
  connect_calls_ = std::make_unique<ConnectCalls>(options_.transfer.connect_timeout, engine_.get(),
                                                  stubs_.get());
  protocol::PeerChannels::Options peers;
  peers.task_addresses = options_.task_addresses;
  if (fabrics_.size() > 1) peers.same_host_tasks = *options_.same_host_tasks;
  // Progress thread, like every use of lent_ (created below, before the engine starts).
  peers.lent_to = [this] { return lent_->Borrowers(); };
  peers.peer_gone = [this](const std::string& task) { lent_->EndLeasesOf(task); };
  channels_ = std::make_unique<protocol::PeerChannels>(std::move(peers), &fabrics_, table_.get(),
                                                       engine_.get());
  for (const auto& context : fabrics_) context->env.landed = channels_->landed();
  // grpc+gdr lends through the primary fabric's registrations (it opens no other).
  lent_ = std::make_unique<LentTensors>(&env());
  service_ = std::make_unique<VerbsServiceImpl>(engine_.get(), channels_.get(), security,
                                                options_.transfer.peer_timeout / 2);
  watchdog_ = std::make_unique<PeerWatchdog>(
      options_.env->task_name, options_.transfer.peer_timeout, engine_.get(), channels_.get(),
      table_.get(), stubs_.get(), &stats_.liveness_probes);

  engine_->Start();
  watchdog_->Start();
  LOG(INFO) << "task " << options_.env->task_name << ": "
            << protocol::VerbsModeProtocol(options_.channel.mode) << " over " << fabric_name()
            << ", " << options_.channel.message_slots << " message slots (batches of up to "
            << options_.channel.message_batch << "), "
            << protocol::RegistrationName(options_.channel.registration) << " registration, "
            << (fabrics_.primary().memory->channel_keys()
                    ? (fabrics_.primary().domain->capabilities().endpoint_bound_keys
                           ? "endpoint-bound channel keys"
                           : "per-channel keys")
                    : "shared keys")
            << ", " << options_.poll_mode << " polling"
            << (options_.channel.data_validation ? ", data validation on" : "");
  return absl::OkStatus();
}

absl::Status VerbsTransport::OpenLanes(
    const fabric::FabricChoice& choice,
    const std::function<void(protocol::FabricContext::Reach, std::unique_ptr<fabric::Domain>)>&
        add_context) {
  if (options_.rails.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(fabric::RailsSpec spec,
                   fabric::ParseRails(absl::StrJoin(options_.rails, ","), fabric::kMaxRails));
  if (options_.channel.mode != protocol::VerbsMode::kZeroCopy) {
    LOG(WARNING) << "task " << options_.env->task_name << ": TENSORVERBS_RAILS is for grpc+verbs; "
                 << protocol::VerbsModeProtocol(options_.channel.mode) << " keeps to one lane";
    return absl::OkStatus();
  }
  std::vector<std::string> rails = spec.listed;
  if (spec.count > 0) {
    const fabric::RailPlan plan = fabric::PlanRails(choice, *fabrics_.primary().domain, spec.count);
    rails = plan.rails;
    LOG(INFO) << "task " << options_.env->task_name << ": TENSORVERBS_RAILS=" << spec.count
              << " ranked this host's rails: " << absl::StrJoin(plan.considered, "; ");
    if (rails.size() < static_cast<size_t>(spec.count)) {
      LOG(WARNING) << "task " << options_.env->task_name << ": TENSORVERBS_RAILS asks for "
                   << spec.count << " rails and this host has " << rails.size() << " ("
                   << absl::StrJoin(plan.considered, "; ") << "); the channels use "
                   << rails.size() + 1 << (rails.empty() ? " lane" : " lanes");
    }
  }
  std::vector<protocol::LaneEnv> lanes;
  for (const std::string& rail : rails) {
    absl::StatusOr<std::unique_ptr<fabric::Domain>> lane =
        fabric::OpenLaneDomain(choice, *fabrics_.primary().domain, rail);
    if (!lane.ok() && spec.count > 0) {
      // A rail this task chose itself: one fewer, said once.
      LOG(WARNING) << "task " << options_.env->task_name << ": the rail " << rail
                   << " cannot open (" << lane.status().message()
                   << "); the channels go without it";
      continue;
    }
    if (!lane.ok()) {
      return absl::Status(lane.status().code(),
                          absl::StrCat("grpc+verbs: the rail ", rail,
                                       " of TENSORVERBS_RAILS: ", lane.status().message()));
    }
    const fabric::Capabilities& caps = (*lane)->capabilities();
    if (caps.backend == "ibverbs" &&
        std::any_of(lanes.begin(), lanes.end(), [&](const protocol::LaneEnv& l) {
          return l.domain->capabilities().provider == caps.provider;
        })) {
      return absl::InvalidArgumentError(absl::StrCat("grpc+verbs: the rail ", rail,
                                                     " of TENSORVERBS_RAILS is ", caps.provider,
                                                     ", which another rail names too"));
    }
    fabric::Domain* raw = lane->get();
    add_context(protocol::FabricContext::Reach::kLane, *std::move(lane));
    lanes.push_back({raw, (*std::prev(fabrics_.end()))->memory.get(), rail});
  }
  fabrics_.primary().env.lanes = std::move(lanes);
  return absl::OkStatus();
}

VerbsTransport::~VerbsTransport() { Shutdown(); }

void VerbsTransport::Host::Post(absl::AnyInvocable<void() &&> task) {
  transport_->engine_->Post(task);
}

void VerbsTransport::Host::Deliver(protocol::ProgressEngine::RecvDelivery delivery) {
  transport_->engine_->DeliverRecv(std::move(delivery));
}

void VerbsTransport::Host::Quarantine(std::vector<Tensor> memory, absl::Time until) {
  transport_->quarantine_.emplace_back(until, std::move(memory));
}

void VerbsTransport::Host::ReleaseLent(const std::string& task, uint32_t tensor_key) {
  transport_->lent_->Release(task, tensor_key);
}

bool VerbsTransport::Host::OnOwnerThread() const { return transport_->engine_->OnOwnerThread(); }

void VerbsTransport::Host::Connect(const std::string& task, const std::string& address,
                                   const proto::ConnectRequest& request, ConnectAnswered answered) {
  transport_->connect_calls_->Connect(task, address, request, std::move(answered));
}

grpc::Service* VerbsTransport::service() { return service_.get(); }

std::string VerbsTransport::fabric_name() const { return fabrics_.Name(); }

bool VerbsTransport::OperationsInFlight() const {
  // A lent tensor is about to be read, and on shm the reads progress through this side too.
  return !lent_->empty() || table_->OperationsInFlight();
}

void VerbsTransport::Housekeeping(absl::Time now) {
  table_->Housekeeping(now, [this](uint64_t id) { return channels_->SettingUp(id); });
  quarantine_.erase(std::remove_if(quarantine_.begin(), quarantine_.end(),
                                   [now](const auto& q) { return q.first <= now; }),
                    quarantine_.end());
  lent_->Expire(now);
  channels_->Expire(now);
}

void VerbsTransport::Recv(std::shared_ptr<RemoteRendezvous> rendezvous, const ParsedKey& key,
                          Allocator* allocator, DataType expected_dtype,
                          const TensorShape& expected_shape, RecvLanding landing,
                          RecvDoneCallback done) {
  // The coarse clock: a recv timeout is seconds long, and this runs for every tensor.
  const bool quiet = landing.waiter_starts;
  RecvStart r{std::move(rendezvous),
              keys_.Intern(key),
              allocator,
              CoarseNow() + options_.transfer.recv_timeout,
              std::move(done),
              expected_dtype,
              expected_shape,
              std::move(landing)};
  if (!recv_inbox_.Push(std::move(r))) {
    // The task posted for the earlier ones has not taken them yet; it may have been posted
    // without waking anyone (a waiter's), and this recv may have no waiter.
    if (!quiet) engine_->Nudge();
    return;
  }
  // If the engine refuses the task (shutting down), it runs right here, off the loop thread,
  // and only fails the recvs; so does a task that a stopping engine that never started runs
  // on the stopping thread.
  protocol::ProgressEngine::Task task = [this] { StartQueuedRecvs(); };
  if (!(quiet ? engine_->PostForWaiter(task) : engine_->Post(task))) std::move(task)();
}

void VerbsTransport::StartQueuedRecvs() {
  // Off the loop thread (shutting down), possibly on several threads at once: a batch of its own,
  // whose recvs fail.
  const bool on_loop = engine_->OnLoopThread();
  recv_inbox_.Drain(
      [this, on_loop](RecvStart& r) {
        if (on_loop) {
          channels_->StartRecv(std::move(r));
        } else {
          env().FailRecv(std::move(r.done),
                         absl::CancelledError(absl::StrCat("recv of '", r.key->key.full_key,
                                                           "': the server is shutting down")));
        }
      },
      on_loop);
}

void VerbsTransport::Lend(
    const std::string& requester, const Tensor& tensor,
    absl::AnyInvocable<void(absl::StatusOr<protocol::RemoteTensorRef>) &&> done) {
  auto holder = std::make_shared<decltype(done)>(std::move(done));
  protocol::ProgressEngine::Task task = [this, requester, tensor, holder]() mutable {
    std::move (*holder)(
        lent_->Lend(requester, tensor,
                    absl::Now() + options_.transfer.recv_timeout + options_.transfer.peer_timeout));
  };
  if (!engine_->Post(task)) {
    std::move (*holder)(absl::UnavailableError(
        absl::StrCat("task ", options_.env->task_name, " is shutting down")));
  }
}

void VerbsTransport::set_rendezvous_mgr(RendezvousMgr* mgr) {
  // Written on the loop thread, so that the loop's later reads happen after the write without
  // relying on how a peer's first request reaches it.
  if (engine_->OnOwnerThread()) {  // the loop itself, or no loop any more
    fabrics_.SetRendezvousMgr(mgr);
    return;
  }
  absl::StatusOr<bool> set = engine_->AskLoop<bool>([this, mgr] {
    fabrics_.SetRendezvousMgr(mgr);
    return true;
  });
  // Refused only once the loop stops, and a stopped loop serves no request.
  if (!set.ok())
    VLOG(1) << "the rendezvous manager was set on a stopped transport: " << set.status();
}

size_t VerbsTransport::NumLentTensors() {
  return engine_->AskLoop<size_t>([this] { return lent_->size(); }).value_or(0);
}

void VerbsTransport::Pull(const std::string& task, const protocol::RemoteTensorRef& ref,
                          Tensor dest, absl::AnyInvocable<void(const absl::Status&) &&> done) {
  const absl::Time deadline = absl::Now() + options_.transfer.recv_timeout;
  auto holder = std::make_shared<decltype(done)>(std::move(done));
  protocol::ProgressEngine::Task t = [this, task, ref, dest, deadline, holder]() mutable {
    absl::StatusOr<protocol::Channel*> channel = channels_->OwnerChannel(task);
    if (!channel.ok()) {
      std::move (*holder)(channel.status());
      return;
    }
    (*channel)->receiving()->StartPull(ref, std::move(dest), deadline, std::move(*holder));
  };
  if (!engine_->Post(t)) {
    std::move (*holder)(
        absl::CancelledError(absl::StrCat("task ", options_.env->task_name, " is shutting down")));
  }
}

void VerbsTransport::AddDevicePool(PoolAllocator* pool) {
  MutexLock lock(&memory_mu_);
  for (const auto& context : fabrics_) {
    if (context->env.device_direct && context->memory != nullptr) {
      context->memory->AddDevicePool(pool);
    }
  }
}

bool VerbsTransport::LandsOnDevice(const std::string& src_task, const Allocator* allocator) const {
  if (!device_direct()) return false;
  {
    MutexLock lock(&memory_mu_);
    bool added = false;
    for (const auto& context : fabrics_) {
      added |= context->memory != nullptr && context->memory->HasDevicePool(allocator);
    }
    if (!added) return false;
  }
  return channels_ != nullptr && channels_->PeerWritesDevice(src_task);
}

void VerbsTransport::NoteProbedPeer(const std::string& task, bool device_writes) {
  if (channels_ != nullptr) channels_->NoteProbedPeer(task, device_writes);
}

void VerbsTransport::AppendCounters(CounterList* out) const {
  stats_.AppendCounters(out);
  const protocol::RdmaMemoryMgr::RegistrationGauges reg = registration_gauges();
  AddCounter(out, Counter::kRegisteredRegions, reg.regions);
  AddCounter(out, Counter::kRegisteredBytes, reg.bytes);
  AddCounter(out, Counter::kChannelRegistrations, reg.endpoint_registrations);
  AddCounter(out, Counter::kChannelRegisteredBytes, reg.endpoint_bytes);
  AddCounter(out, Counter::kWaiterDrives, static_cast<int64_t>(waiter_drives()));
}

protocol::RdmaMemoryMgr::RegistrationGauges VerbsTransport::registration_gauges() const {
  MutexLock lock(&memory_mu_);
  return fabrics_.Gauges();
}

void VerbsTransport::AbortStep(int64_t step_id, const absl::Status& status) {
  engine_->Post([this, step_id, status]() mutable { channels_->AbortStep(step_id, status); });
}

absl::Status VerbsTransport::ConnectPeers(absl::Duration timeout) {
  return channels_->ConnectPeers(timeout);
}

size_t VerbsTransport::NumReadyChannels() {
  return engine_->AskLoop<size_t>([this] { return table_->NumReady(); }).value_or(0);
}

std::vector<protocol::ChannelSnapshot> VerbsTransport::ChannelSnapshots(absl::Duration timeout) {
  if (engine_ == nullptr) return {};
  return engine_
      ->AskLoop<std::vector<protocol::ChannelSnapshot>>([this] { return table_->Snapshot(); },
                                                        timeout)
      .value_or(std::vector<protocol::ChannelSnapshot>());
}

void VerbsTransport::ChannelSnapshotsAsync(
    absl::AnyInvocable<void(std::vector<protocol::ChannelSnapshot>) &&> done) {
  using Done = absl::AnyInvocable<void(std::vector<protocol::ChannelSnapshot>) &&>;
  // Shared with the task, which a refusing Post leaves holding it.
  auto held = std::make_shared<Done>(std::move(done));
  protocol::ProgressEngine::Task task = [this, held] { std::move (*held)(table_->Snapshot()); };
  if (engine_ == nullptr || !engine_->Post(task)) std::move (*held)({});
}

void VerbsTransport::StopTraffic() {
  if (engine_ == nullptr || traffic_stopped_.exchange(true)) return;
  watchdog_->Stop();
  // Tensors a peer already took from this task's table are still on their way (a write posted
  // or about to be, a lent tensor being read): let them finish, as gRPC's shutdown lets
  // responses in progress finish, for up to kShutdownGrace.
  const absl::Time grace_end = absl::Now() + kShutdownGrace;
  absl::StatusOr<bool> lending = engine_->AskLoop<bool>([this] { return !lent_->empty(); });
  if (lending.ok() && *lending) watchdog_->LastRound(kShutdownGrace / 2);
  while (absl::Now() < grace_end) {
    absl::StatusOr<bool> busy =
        engine_->AskLoop<bool>([this] { return ResponsesStillOnTheirWay(); }, absl::Seconds(1));
    if (!busy.ok() || !*busy) break;
    absl::SleepFor(absl::Milliseconds(1));
  }
  engine_->Stop();
}

bool VerbsTransport::ResponsesStillOnTheirWay() const {
  if (table_->ResponsesInProgress()) return true;
  // A lent tensor is read, and released, over a channel with its borrower. A borrower with no
  // channel open (it broke, or the peer closed it) can neither read nor release it: waiting for
  // that release would spend the whole grace on nothing. A borrower that sets up a new channel
  // meanwhile counts again at the next look.
  for (const std::string& task : lent_->Borrowers()) {
    if (table_->HasOpenChannelWith(task)) return true;
  }
  return false;
}

std::string VerbsTransport::LoopReport() const {
  return engine_ == nullptr ? std::string() : engine_->Where();
}

void VerbsTransport::Shutdown() {
  if (engine_ == nullptr || shut_down_.exchange(true)) return;
  StopTraffic();
  // The loop has stopped, so this thread owns the channels now.
  table_->CloseAll(
      absl::CancelledError(absl::StrCat("task ", options_.env->task_name, " is shutting down")));
  connect_calls_->CancelAll();
  connect_calls_->Shutdown(absl::Seconds(10));
  table_->Clear();
  quarantine_.clear();
  lent_->Clear();
  MutexLock lock(&memory_mu_);
  fabrics_.ReleaseRegistrations();
}

}  // namespace tensorverbs::verbs
