#include "src/server/server.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/worker.grpc.pb.h"
#include "src/common/config.h"
#include "src/common/logging.h"
#include "src/common/malloc_tuning.h"
#include "src/common/process_limits.h"
#include "src/common/status_macros.h"
#include "src/common/trace.h"
#include "src/fabric/fabric.h"
#include "src/rpc/grpc_util.h"
#include "src/server/protocols.h"
#include "src/transport/grpc/recv_tensor_handler.h"
#include "tensorverbs/device_name.h"

namespace tensorverbs {
namespace {

uint64_t NewIncarnation() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0) v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return v;
}

using WorkerServiceBase =
    proto::WorkerService::WithRawCallbackMethod_RecvTensor<proto::WorkerService::CallbackService>;

class WorkerServiceImpl final : public WorkerServiceBase {
 public:
  WorkerServiceImpl(
      const WorkerEnv* env, RendezvousMgr* mgr, const ProtocolSpec* protocol, std::string device,
      protocol::TensorLender* lender, const rpc::RpcSecurity* security,
      std::shared_ptr<grpc_transport::RecvTensorBudget> budget,
      std::function<void(absl::AnyInvocable<void(proto::GetStatsResponse) &&>)> collect_stats,
      bool device_writes)
      : env_(env),
        mgr_(mgr),
        protocol_(protocol),
        device_(std::move(device)),
        lender_(lender),
        security_(security),
        budget_(std::move(budget)),
        collect_stats_(std::move(collect_stats)),
        device_writes_(device_writes) {}

  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* context,
                                      const proto::GetStatusRequest* request,
                                      proto::GetStatusResponse* response) override {
    std::string caller;
    if (grpc::Status allowed = security_->Authenticate(*context, &caller); !allowed.ok()) {
      return Refuse(context, allowed);
    }
    response->set_task_name(env_->task_name);
    response->set_incarnation(env_->incarnation);
    response->add_devices(device_);
    response->set_protocol(std::string(protocol_->name));
    response->set_device_writes(device_writes_);
    auto* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerUnaryReactor* RecvTensor(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override {
    std::string caller;
    if (grpc::Status allowed = security_->Authenticate(*context, &caller); !allowed.ok()) {
      return Refuse(context, allowed);
    }
    if (!protocol_->serves_recv_tensor) {
      // Only the protocol in use is served: these tensors go over RDMA channels.
      auto* reactor = context->DefaultReactor();
      reactor->Finish(grpc::Status(
          grpc::StatusCode::UNIMPLEMENTED,
          absl::StrCat("task ", env_->task_name, " serves protocol ", protocol_->name,
                       ": its tensors are received over RDMA channels, not RecvTensor")));
      return reactor;
    }
    return grpc_transport::HandleRecvTensor(context, request, response, mgr_, env_, caller, lender_,
                                            budget_);
  }

  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const proto::GetStatsRequest* request,
                                     proto::GetStatsResponse* response) override {
    std::string caller;
    if (grpc::Status allowed = security_->Authenticate(*context, &caller); !allowed.ok()) {
      return Refuse(context, allowed);
    }
    // The channels are asked of the progress loop, which answers later: nothing waits on this
    // gRPC thread.
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    collect_stats_([response, reactor](proto::GetStatsResponse stats) {
      *response = std::move(stats);
      reactor->Finish(grpc::Status::OK);
    });
    return reactor;
  }

  grpc::ServerUnaryReactor* CleanupStep(grpc::CallbackServerContext* context,
                                        const proto::CleanupStepRequest* request,
                                        proto::CleanupStepResponse* response) override {
    std::string caller;
    if (grpc::Status allowed = security_->Authenticate(*context, &caller); !allowed.ok()) {
      return Refuse(context, allowed);
    }
    mgr_->Cleanup(request->step_id());
    auto* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  static grpc::ServerUnaryReactor* Refuse(grpc::CallbackServerContext* context,
                                          const grpc::Status& status) {
    auto* reactor = context->DefaultReactor();
    reactor->Finish(status);
    return reactor;
  }

  const WorkerEnv* const env_;
  RendezvousMgr* const mgr_;
  const ProtocolSpec* const protocol_;
  const std::string device_;
  protocol::TensorLender* const lender_;  // grpc+gdr only
  const rpc::RpcSecurity* const security_;
  const std::shared_ptr<grpc_transport::RecvTensorBudget> budget_;  // shared with held calls
  const std::function<void(absl::AnyInvocable<void(proto::GetStatsResponse) &&>)> collect_stats_;
  const bool device_writes_;  // GetStatusResponse.device_writes
};

}  // namespace

std::vector<std::string> AvailableProtocols() {
  std::vector<std::string> names;
  for (const ProtocolSpec& spec : Protocols()) names.emplace_back(spec.name);
  return names;
}

Server::Server(ServerOptions options, const ProtocolSpec* protocol)
    : options_(std::move(options)), protocol_(protocol) {}

ServerOptions ServerOptions::FromConfig(const Config& config) {
  ServerOptions o;
  o.transfer = TransferSettings::FromConfig(config);
  o.callback_threads = config.callback_threads;
  o.stop_timeout = config.stop_timeout;
  o.pool_region_bytes = config.pool_region_bytes;
  o.max_tensor_bytes = config.max_tensor_bytes;
  o.proxy_chunk_bytes = config.proxy_chunk_bytes;
  o.max_peer_steps = config.max_peer_steps;
  o.pool_keep_free_bytes = config.pool_keep_free_bytes;
  o.pin_pool = config.pin_pool;
  o.security.tls_cert_file = config.tls_cert_file;
  o.security.tls_key_file = config.tls_key_file;
  o.security.tls_ca_file = config.tls_ca_file;
  o.security.secret_file = config.secret_file;
  o.malloc_tuning = config.malloc_tuning;
  o.malloc_trim_bytes = config.malloc_trim_bytes;
  o.verbs = verbs::VerbsOptions::FromConfig(config);
  return o;
}

absl::StatusOr<ServerOptions> ServerOptions::FromEnvironment() {
  RETURN_IF_ERROR(Config::EnvironmentStatus());
  return FromConfig(Config::Get());
}

absl::StatusOr<std::unique_ptr<Server>> Server::Create(ServerOptions options) {
  ASSIGN_OR_RETURN(std::string address, options.cluster.TaskAddress(options.job, options.task));
  ASSIGN_OR_RETURN(const ProtocolSpec* protocol, FindProtocol(options.protocol));
  if (options.listen_address.empty()) options.listen_address = address;
  auto server = std::unique_ptr<Server>(new Server(std::move(options), protocol));
  RETURN_IF_ERROR(server->Start());
  return server;
}

absl::Status Server::Start() {
  rpc::PinGrpcCallbackQueue();
  if (options_.malloc_tuning) ApplyMallocTuning(options_.malloc_trim_bytes);
  // Where the peers are: by address, unless the options say (tests, tools).
  const std::string self = TaskName(options_.job, options_.task);
  absl::flat_hash_set<std::string> same_host;
  if (options_.verbs.same_host_tasks.has_value()) {
    same_host = *options_.verbs.same_host_tasks;
  } else {
    // Once per host, not per task: a name may take a DNS lookup.
    absl::flat_hash_map<std::string, bool> local;
    for (const auto& [task, address] : options_.cluster.TaskAddresses()) {
      const std::string host = address.substr(0, address.rfind(':'));
      auto [it, inserted] = local.try_emplace(host, false);
      if (inserted) it->second = AddressIsLocal(address);
      if (task != self && it->second) same_host.insert(task);
    }
  }
  const bool all_peers_local = same_host.size() + 1 >= options_.cluster.TaskAddresses().size();
  if (absl::Status s =
          RaiseDescriptorLimit(DescriptorsFor(options_.cluster.TaskAddresses().size()));
      !s.ok()) {
    LOG(WARNING) << "task " << self << ": " << s.message();
  }
  StartPool(all_peers_local, !same_host.empty());
  executor_ = std::make_unique<Executor>("tv-callbacks", options_.callback_threads);
  FillEnv();
  SetUpDeviceCopier();
  {
    absl::StatusOr<std::shared_ptr<const rpc::RpcSecurity>> security = rpc::RpcSecurity::Create(
        options_.security, env_.task_name, options_.cluster.TaskAddresses());
    if (!security.ok()) {
      return absl::Status(security.status().code(),
                          absl::StrCat("task ", env_.task_name, ": ", security.status().message()));
    }
    security_ = *std::move(security);
  }
  workers_ = std::make_unique<grpc_transport::GrpcWorkerCache>(
      options_.cluster.TaskAddresses(), security_, options_.max_tensor_bytes,
      options_.transfer.peer_timeout, options_.transfer.slow_recv_warning);
  RETURN_IF_ERROR(StartProtocol(all_peers_local, std::move(same_host)));
  RETURN_IF_ERROR(Listen());
  NameTraceProcess(env_.task_name);
  LOG(INFO) << "task " << env_.task_name << " serving protocol " << options_.protocol << " on "
            << options_.listen_address << " (incarnation " << std::hex << env_.incarnation
            << std::dec << ", authentication: " << security_->Describe() << ")";
  WarnIfOpenToAnyone();
  return absl::OkStatus();
}

void Server::StartPool(bool all_peers_local, bool some_peers_local) {
  PoolAllocator::Options pool_options;
  pool_options.region_bytes = static_cast<size_t>(options_.pool_region_bytes);
  pool_options.keep_free_bytes = static_cast<size_t>(options_.pool_keep_free_bytes);
  pool_options.release_after = ServerOptions::kPoolReleaseAfter;
  // Tensors land in the pool: when the same-host fabric will carry them, the pool's memory is
  // what peers map, so a write into it is one memcpy.
  fabric::FabricChoice choice;
  choice.fabric = options_.verbs.fabric;
  choice.all_peers_local = all_peers_local;
  choice.some_peers_local = some_peers_local;
  pool_options.shareable =
      protocol_->verbs_mode.has_value() &&
      (fabric::UsesSharedMemory(choice) || fabric::OpensSameHostFabric(choice));
  recv_allocator_ = std::make_unique<PoolAllocator>("recv", pool_options);
  PinPoolIfAsked();
}

void Server::FillEnv() {
  env_.job = options_.job;
  env_.task = options_.task;
  env_.task_name = TaskName(options_.job, options_.task);
  env_.incarnation = NewIncarnation();
  env_.recv_allocator = recv_allocator_.get();
  env_.callback_executor = executor_.get();
  env_.stats = &stats_;
  env_.keys = &keys_;
  env_.max_tensor_bytes = options_.max_tensor_bytes;
  env_.proxy_chunk_bytes = options_.proxy_chunk_bytes;
  env_.step_sizes = &step_sizes_;
}

absl::Status Server::StartProtocol(bool all_peers_local,
                                   absl::flat_hash_set<std::string> same_host_tasks) {
  if (protocol_->verbs_mode.has_value()) {
    verbs::VerbsOptions verbs_options = options_.verbs;
    verbs_options.channel.mode = *protocol_->verbs_mode;
    verbs_options.env = &env_;
    verbs_options.device_memory = FabricDeviceMemory();
    verbs_options.pool = recv_allocator_.get();
    verbs_options.task_addresses = options_.cluster.TaskAddresses();
    verbs_options.security = security_;
    verbs_options.all_peers_local = all_peers_local;
    verbs_options.same_host_tasks = std::move(same_host_tasks);
    verbs_options.transfer = options_.transfer;
    absl::StatusOr<std::unique_ptr<verbs::VerbsTransport>> verbs =
        verbs::VerbsTransport::Create(std::move(verbs_options));
    if (!verbs.ok()) {
      return absl::Status(verbs.status().code(),
                          absl::StrCat("task ", env_.task_name, ": ", verbs.status().message()));
    }
    verbs_ = *std::move(verbs);
  }
  rendezvous_mgr_ = NewRendezvousMgr(
      *protocol_, {&env_, workers_.get(), options_.transfer.recv_timeout, verbs_.get()});
  if (verbs_) verbs_->set_rendezvous_mgr(rendezvous_mgr_.get());
  rendezvous_mgr_->SetPeerStepLimits(
      {static_cast<size_t>(options_.max_peer_steps), options_.transfer.recv_timeout});
  return absl::OkStatus();
}

absl::Status Server::Listen() {
  absl::flat_hash_set<std::string> task_names;
  for (const auto& [name, address] : options_.cluster.TaskAddresses()) task_names.insert(name);
  service_ = std::make_unique<WorkerServiceImpl>(
      &env_, rendezvous_mgr_.get(), protocol_, device_name(),
      protocol_->lends_tensors ? verbs_.get() : nullptr, security_.get(),
      std::make_shared<grpc_transport::RecvTensorBudget>(options_.transfer.max_responses,
                                                         std::move(task_names)),
      [this](absl::AnyInvocable<void(proto::GetStatsResponse) &&> done) {
        CollectStatsAsync(std::move(done));
      },
      verbs_ != nullptr && verbs_->device_direct());
  grpc::ServerBuilder builder;
  rpc::ConfigureServerBuilder(&builder, options_.transfer.peer_timeout);
  int bound_port = 0;
  builder.AddListeningPort(options_.listen_address, security_->ServerCredentials(), &bound_port);
  builder.RegisterService(service_.get());
  if (verbs_) builder.RegisterService(verbs_->service());
  grpc_server_ = builder.BuildAndStart();
  if (grpc_server_ == nullptr || bound_port == 0) {
    grpc_server_.reset();
    return absl::UnavailableError(
        absl::StrCat("task ", env_.task_name, " cannot listen on ", options_.listen_address,
                     ": the port is in use or the address is not local to this host"));
  }
  return absl::OkStatus();
}

void Server::WarnIfOpenToAnyone() const {
  const absl::string_view host =
      absl::string_view(options_.listen_address).substr(0, options_.listen_address.rfind(':'));
  const bool loopback_only =
      host == "localhost" || host == "[::1]" || absl::StartsWith(host, "127.");
  if (security_->enabled() || loopback_only) return;
  static std::once_flag warned;
  std::call_once(warned, [this] {
    LOG(WARNING) << "task " << env_.task_name << " listens on " << options_.listen_address
                 << " without authentication: anyone who reaches the port can receive its "
                    "tensors; set TENSORVERBS_SECRET_FILE or TENSORVERBS_TLS_* (docs/guide.md, "
                    "\"Security\")";
  });
}

Server::~Server() { Stop(); }

void Server::StopTraffic() {
  if (verbs_) verbs_->StopTraffic();
}

void Server::Stop() {
  {
    MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  auto step = [this](const char* what) { stop_step_.store(what, std::memory_order_relaxed); };
  // The grpc+verbs channels close first (after the writes already under way finish): the
  // requests peers made ahead of their recvs wait in this task's rendezvous tables, and
  // cleaning those up must not answer over a channel whose peer may be gone.
  step("closing the grpc+verbs channels");
  if (verbs_) verbs_->Shutdown();
  // Fail pending recvs so RecvTensor handlers finish and the shutdown does not wait.
  step("failing the pending recvs");
  if (rendezvous_mgr_) rendezvous_mgr_->CleanupAll();
  step("shutting down the gRPC server");
  if (grpc_server_) {
    // Responses already being sent may finish; the rest are cancelled at the deadline.
    grpc_server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    grpc_server_->Wait();
  }
  // grpc+gdr calls left draining by aborted steps (CleanupAll above aborts every step) wait for
  // answers that need not come now. Cancelled client calls complete promptly; their callbacks
  // use the executor below.
  step("waiting for the remote recvs in flight");
  if (workers_) workers_->CancelDraining();
  if (workers_ && !workers_->WaitForNoCalls(absl::Seconds(10))) {
    LOG(WARNING) << "task " << env_.task_name << ": remote recvs still in flight at shutdown";
  }
  // Device copies still completing call back into this task (its executor, stats and pools).
  step("waiting for the device copies in flight");
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (stats_.device_copies_in_flight.load(std::memory_order_acquire) > 0) {
    if (absl::Now() > deadline) {
      LOG(WARNING) << "task " << env_.task_name << ": " << stats_.device_copies_in_flight.load()
                   << " device copies still in flight "
                   << "after 30 s at shutdown; the GPU may have failed";
      break;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  FlushTrace();  // a task's recvs are in its trace file once it stopped
  step("stopped");
}

bool Server::DriveUntil(Event& event, absl::Time deadline) {
  if (verbs_ != nullptr) return verbs_->DriveUntil(event, deadline);
  return event.WaitUntil(deadline);
}

std::shared_ptr<void> Server::QuietScope() {
  if (verbs_ == nullptr) return nullptr;
  return verbs_->QuietScope();
}

bool Server::OnOwnThread() const {
  return (executor_ != nullptr && executor_->OnOwnThread()) || (verbs_ && verbs_->OnLoopThread());
}

std::string Server::StopReport() const {
  std::string report = absl::StrCat("Stop is ", stop_step_.load(std::memory_order_relaxed));
  if (verbs_) {
    const std::string loop = verbs_->LoopReport();
    if (!loop.empty()) absl::StrAppend(&report, "; ", loop);
  }
  return report;
}

std::string Server::device_name() const { return CpuDeviceName(options_.job, options_.task); }

absl::StatusOr<grpc_transport::WorkerClient*> Server::Worker(const std::string& task_name) {
  return workers_->Get(task_name);
}

absl::StatusOr<uint64_t> Server::PeerIncarnation(const std::string& task_name,
                                                 absl::Duration timeout) {
  if (task_name == env_.task_name) return env_.incarnation;
  {
    MutexLock lock(&mu_);
    auto it = peer_incarnations_.find(task_name);
    if (it != peer_incarnations_.end()) return it->second;
  }
  ASSIGN_OR_RETURN(grpc_transport::WorkerClient * worker, workers_->Get(task_name));
  ASSIGN_OR_RETURN(proto::GetStatusResponse status, worker->GetStatus(timeout));
  if (verbs_ != nullptr) verbs_->NoteProbedPeer(task_name, status.device_writes());
  MutexLock lock(&mu_);
  peer_incarnations_[task_name] = status.incarnation();
  return status.incarnation();
}

CounterList Server::Counters() const {
  CounterList out;
  stats_.AppendCounters(&out);
  const PoolAllocator::Stats pool = recv_allocator_->GetStats();
  AddCounter(&out, Counter::kPoolRegions, static_cast<int64_t>(pool.regions));
  AddCounter(&out, Counter::kPoolBytes, static_cast<int64_t>(pool.region_bytes));
  AddCounter(&out, Counter::kPoolBytesInUse, static_cast<int64_t>(pool.bytes_in_use));
  AddCounter(&out, Counter::kPoolAllocations, static_cast<int64_t>(pool.allocations));
  if (verbs_ != nullptr) verbs_->AppendCounters(&out);
  return out;
}

proto::GetStatsResponse Server::CountersWithoutChannels() {
  proto::GetStatsResponse out;
  out.set_task_name(env_.task_name);
  out.set_protocol(options_.protocol);
  out.set_incarnation(env_.incarnation);
  out.set_uptime_ms(absl::ToInt64Milliseconds(absl::Now() - started_));
  for (auto& [name, value] : Counters()) (*out.mutable_counters())[name] = value;
  if (verbs_ != nullptr) out.set_fabric(verbs_->fabric_name());
  return out;
}

void Server::AddChannels(const std::vector<protocol::ChannelSnapshot>& channels,
                         proto::GetStatsResponse* out) const {
  auto& c = *out->mutable_counters();
  int64_t pending = 0;
  for (const protocol::ChannelSnapshot& s : channels) {
    proto::ChannelStats* ch = out->add_channels();
    ch->set_peer_task(s.peer_task);
    ch->set_receives(s.receives);
    ch->set_state(s.state);
    ch->set_fabric(s.fabric);
    ch->set_description(s.description);
    for (const auto& [name, value] : s.counters) {
      (*ch->mutable_counters())[name] = value;
      if (name == CounterInfoOf(Counter::kPendingRecvs).name) pending += value;
    }
  }
  c[std::string(CounterInfoOf(Counter::kPendingRecvs).name)] = pending;
  c[std::string(CounterInfoOf(Counter::kChannels).name)] = out->channels_size();
}

proto::GetStatsResponse Server::CollectStats() {
  proto::GetStatsResponse out = CountersWithoutChannels();
  if (verbs_ != nullptr) AddChannels(verbs_->ChannelSnapshots(absl::Seconds(2)), &out);
  return out;
}

void Server::CollectStatsAsync(absl::AnyInvocable<void(proto::GetStatsResponse) &&> done) {
  proto::GetStatsResponse out = CountersWithoutChannels();
  if (verbs_ == nullptr) {
    std::move(done)(std::move(out));
    return;
  }
  verbs_->ChannelSnapshotsAsync([this, out = std::move(out), done = std::move(done)](
                                    std::vector<protocol::ChannelSnapshot> channels) mutable {
    AddChannels(channels, &out);
    std::move(done)(std::move(out));
  });
}

std::optional<uint64_t> Server::KnownPeerIncarnation(const std::string& task_name) {
  if (task_name == env_.task_name) return env_.incarnation;
  MutexLock lock(&mu_);
  auto it = peer_incarnations_.find(task_name);
  if (it == peer_incarnations_.end()) return std::nullopt;
  return it->second;
}

absl::Status Server::WaitForPeers(absl::Duration timeout) {
  std::vector<std::string> tasks;
  for (const auto& [task, address] : options_.cluster.TaskAddresses()) tasks.push_back(task);
  std::sort(tasks.begin(), tasks.end());  // a stable order for the error's list
  return WaitForPeers(tasks, timeout);
}

absl::Status Server::WaitForPeers(const std::vector<std::string>& tasks, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  const absl::flat_hash_map<std::string, std::string> addresses = options_.cluster.TaskAddresses();
  std::vector<std::pair<std::string, std::string>> peers;  // task, address
  absl::flat_hash_set<std::string> listed;
  for (const std::string& task : tasks) {
    auto it = addresses.find(task);
    if (it == addresses.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("task ", env_.task_name, " was asked to wait for '", task,
                       "', which is not a task of its cluster (names are "
                       "/job:J/replica:0/task:T)"));
    }
    if (task != env_.task_name && listed.insert(task).second) peers.emplace_back(task, it->second);
  }
  // One probe per peer, at most kProbeWave under way at once: a peer that starts late holds up
  // one prober, not every probe behind it, and a task of a thousand opens no thousand
  // connections at the same moment.
  std::vector<absl::Status> results(peers.size());
  std::atomic<size_t> next{0};
  // A probe whose connection dropped under it (UNAVAILABLE: a keepalive unanswered by a peer
  // starved of CPU, a reset) asks again until the deadline: the peer may be slow, not gone,
  // and a wait for peers is the place to wait for it. Other errors (refused credentials, a
  // peer of another cluster) are answers and end the probe.
  auto probe = [&] {
    for (size_t i; (i = next.fetch_add(1)) < peers.size();) {
      for (;;) {
        const absl::Duration left = std::max(deadline - absl::Now(), absl::Milliseconds(1));
        results[i] = PeerIncarnation(peers[i].first, left).status();
        if (results[i].code() != absl::StatusCode::kUnavailable ||
            absl::Now() + kProbeRetryPause >= deadline) {
          break;
        }
        absl::SleepFor(kProbeRetryPause);
      }
    }
  };
  std::vector<std::thread> probers;
  const size_t probing = std::min(peers.size(), kProbeWave);
  for (size_t h = 1; h < probing; ++h) probers.emplace_back(probe);  // this thread is one
  probe();
  for (std::thread& t : probers) t.join();
  std::vector<std::string> missing;
  std::string first_error;
  for (size_t i = 0; i < peers.size(); ++i) {
    if (results[i].ok()) continue;
    missing.push_back(absl::StrCat(peers[i].first, " at ", peers[i].second));
    if (first_error.empty()) first_error = std::string(results[i].message());
  }
  if (!missing.empty()) {
    return absl::UnavailableError(absl::StrCat(
        "task ", env_.task_name, " could not reach ", missing.size(), " peer task(s) within ",
        absl::FormatDuration(timeout), ": ", absl::StrJoin(missing, ", "), " (first error: ",
        first_error, "); raise TENSORVERBS_CONNECT_TIMEOUT_MS if they start slowly"));
  }
  return absl::OkStatus();
}

absl::Status Server::SetUpChannels(absl::Duration timeout) {
  if (verbs_ == nullptr) return absl::OkStatus();
  return verbs_->ConnectPeers(timeout);
}

}  // namespace tensorverbs
