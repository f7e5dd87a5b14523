// VerbsTransport: the grpc+verbs protocol engine of one server (also grpc+verbs-copy, and the
// RDMA half of grpc+gdr).
//
// It owns the fabrics it opened (chosen by fabric::OpenFabric's policy from VerbsOptions::fabric),
// each a context of domain, registrations and channel env (protocol/fabric_contexts.h), and the
// parts that run the protocol on them:
// - ProgressEngine (protocol/progress_engine.h): the one thread that touches the domain and
//   every channel; other threads reach them by posting tasks to it.
// - ChannelTable (protocol/channel_table.h): the channels, which PeerChannels
//   (protocol/peer_channels.h) finds and makes, and where recvs start. The transport is the
//   channels' ChannelHost: it carries a new channel's handshake to the peer over
//   VerbsService.Connect (ConnectCalls, connect_calls.h), and VerbsServiceImpl
//   (verbs_service.h) serves the peers' on the server's gRPC port.
// - PeerWatchdog (peer_watchdog.h): liveness probes of peers with pending recvs.
// - LentTensors (lent_tensors.h): grpc+gdr's tensors lent to readers.
// Recv() starts a recv of a remote tensor: on first use of a peer the channel is set up by one
// Connect RPC, then the tensor moves by RDMA as protocol/channel.h describes.
//
// Configuration comes in VerbsOptions only (the server fills it from the environment at its
// edge), so two differently configured transports can run in one process.
//
// Thread-safety: public methods may be called from any thread; Recv, AbortStep, Lend and Pull
// also from the progress thread (inline callbacks), the others not. User callbacks run on the
// worker's callback executor (inline when it has no threads), each exactly once. Shutdown()
// (also run by the destructor) first lets tensors that peers already took finish sending (up
// to 2 s), then fails whatever is pending with Cancelled and joins the threads.
#ifndef TENSORVERBS_TRANSPORT_VERBS_VERBS_TRANSPORT_H_
#define TENSORVERBS_TRANSPORT_VERBS_VERBS_TRANSPORT_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/common/config.h"
#include "src/common/mutex.h"
#include "src/fabric/fabric.h"
#include "src/protocol/channel.h"
#include "src/protocol/channel_env.h"
#include "src/protocol/channel_table.h"
#include "src/protocol/fabric_contexts.h"
#include "src/protocol/inbox.h"
#include "src/protocol/local_tensor_inbox.h"
#include "src/protocol/memory_mgr.h"
#include "src/protocol/peer_channels.h"
#include "src/protocol/progress_engine.h"
#include "src/protocol/push_ahead.h"
#include "src/protocol/remote_tensor.h"
#include "src/rendezvous/key_table.h"
#include "src/rendezvous/remote_rendezvous.h"
#include "src/rendezvous/rendezvous_mgr.h"
#include "src/rendezvous/transfer_settings.h"
#include "src/rpc/security.h"

namespace tensorverbs::verbs {

class ConnectCalls;
class LentTensors;
class PeerWatchdog;
class VerbsServiceImpl;
class VerbsStubs;

// Each setting that has a variable starts from its default (Config::Defaults(), declared once
// in common/config.h). The server fills in env, pool, task addresses, security, transfer,
// channel.mode and device_memory; tests and tools set the rest as they need.
struct VerbsOptions {
  const WorkerEnv* env = nullptr;
  PoolAllocator* pool = nullptr;  // registered once per region; staging comes from it too
  absl::flat_hash_map<std::string, std::string> task_addresses;  // every task of the cluster
  // How calls to other tasks prove this one (null: no security).
  std::shared_ptr<const rpc::RpcSecurity> security;
  // The settings every protocol shares (ServerOptions::transfer): recv and peer timeouts, the
  // slow-recv warning, the connect deadline, the bound on a peer's requests.
  TransferSettings transfer;
  // The channels' own settings (message slots, push-ahead, bounds, registration, mode).
  protocol::ChannelOptions channel;
  bool all_peers_local = false;  // every task runs on this host (shm is then a candidate)
  // The peer tasks on this host: with TENSORVERBS_FABRIC=auto and some peers elsewhere, their
  // channels go over the same-host fabric and the others' over the network fabric (null: the
  // server fills in the tasks whose address is local to this host).
  std::optional<absl::flat_hash_set<std::string>> same_host_tasks;
  std::string fabric = Config::Defaults().fabric;              // TENSORVERBS_FABRIC
  std::string ofi_provider = Config::Defaults().ofi_provider;  // TENSORVERBS_OFI_PROVIDER
  RdmaConfig rdma = Config::Defaults().rdma;                   // the RDMA_* variables (ibverbs)
  std::string poll_mode = Config::Defaults().poll_mode;        // TENSORVERBS_POLL_MODE
  absl::Duration poll_spin = Config::Defaults().poll_spin;     // TENSORVERBS_POLL_SPIN_US
  // TENSORVERBS_INLINE_CALLBACK_US
  absl::Duration inline_callback_limit = Config::Defaults().inline_callback_limit;
  bool waiter_progress = Config::Defaults().waiter_progress;       // TENSORVERBS_WAITER_PROGRESS
  int shmem_copy_threads = Config::Defaults().shmem_copy_threads;  // TENSORVERBS_SHMEM_COPY_THREADS
  // TENSORVERBS_OFI_SHARED_ENDPOINT
  bool ofi_shared_endpoint = Config::Defaults().ofi_shared_endpoint;
  bool shmem_peer_copy = Config::Defaults().shmem_peer_copy;       // TENSORVERBS_SHMEM_PEER_COPY
  std::string remote_keys = Config::Defaults().remote_keys;        // TENSORVERBS_REMOTE_KEYS
  bool gpu_direct = Config::Defaults().gpu_direct;                 // TENSORVERBS_GPU_DIRECT
  // TENSORVERBS_RAILS: where further lanes bind (addresses of this host, or interface names),
  // each a domain beside the first that must open; or one entry, a count of rails to choose.
  std::vector<std::string> rails;
  // The GPU runtime through which the fabric may reach device memory directly (the shmem
  // fabric's CUDA IPC), when gpu_direct; null: device tensors go through host memory.
  std::shared_ptr<fabric::DeviceMemory> device_memory;

  // The settings above that have a variable, from `config`.
  static VerbsOptions FromConfig(const Config& config);
};

class VerbsTransport : public protocol::TensorLender, public protocol::TensorPuller {
 public:
  static absl::StatusOr<std::unique_ptr<VerbsTransport>> Create(VerbsOptions options);
  VerbsTransport(const VerbsTransport&) = delete;
  VerbsTransport& operator=(const VerbsTransport&) = delete;
  ~VerbsTransport() override;

  // The service to register on the server's gRPC port, before it starts.
  grpc::Service* service();
  // Where requests from peers find the local sends. Set before the server starts serving; it
  // is handed to the progress thread, which already runs and is the one that reads it.
  void set_rendezvous_mgr(RendezvousMgr* mgr);

  // Receives `key` (its source task is a peer) for `rendezvous`'s step into memory from
  // `allocator`. The recv fails at once if the rendezvous was aborted before it started. An
  // `expected_dtype` (not kInvalid) and shape are cached as the key's meta-data before the
  // request goes (see RecvArgs). `landing`: RecvArgs' into and progress.
  void Recv(std::shared_ptr<RemoteRendezvous> rendezvous, const ParsedKey& key,
            Allocator* allocator, DataType expected_dtype, const TensorShape& expected_shape,
            RecvLanding landing, RecvDoneCallback done);
  // Fails the step's pending recvs with `status`.
  void AbortStep(int64_t step_id, const absl::Status& status);

  // GPU tensors written directly. Whether this transport's fabric moves GPU memory with no
  // copy through host memory (see protocol::ChannelEnv::device_direct).
  // With a same-host fabric beside the network one, whether either does.
  bool device_direct() const {
    for (const auto& context : fabrics_) {
      if (context->env.device_direct) return true;
    }
    return false;
  }
  // Registers `pool`'s regions (GPU memory) with the fabric as they come, so tensors in it are
  // written from and into directly. Any thread; `pool` outlives this transport. A no-op without
  // device_direct().
  void AddDevicePool(PoolAllocator* pool);
  // Whether a recv from `src_task` into `allocator` lands on the device directly: device_direct,
  // `allocator` is a pool added here, and the task's end of the channel writes GPU memory
  // (known once a channel to it is set up). Any thread.
  bool LandsOnDevice(const std::string& src_task, const Allocator* allocator) const;
  // What `task` said of itself when probed (Server::PeerIncarnation), for LandsOnDevice before
  // a channel from it is set up. Any thread.
  void NoteProbedPeer(const std::string& task, bool device_writes);

  // grpc+gdr (VerbsMode::kGdr). Lend: the sender keeps `tensor` (or a registered copy of it)
  // for `requester` until a release immediate from that task names it, or the lease of
  // recv_timeout + peer_timeout passes. Pull: the receiver reads it over its channel to `task`
  // (set up on first use) and releases it.
  void Lend(const std::string& requester, const Tensor& tensor,
            absl::AnyInvocable<void(absl::StatusOr<protocol::RemoteTensorRef>) &&> done) override;
  void Pull(const std::string& task, const protocol::RemoteTensorRef& ref, Tensor dest,
            absl::AnyInvocable<void(const absl::Status&) &&> done) override;
  // Tensors lent and not yet released (any thread; asks the loop).
  size_t NumLentTensors();

  // Sets up channels to every peer task, waiting up to `timeout` (wait-for-peers). The error
  // names the tasks whose channel could not be set up and why.
  absl::Status ConnectPeers(absl::Duration timeout);

  // "ofi (shm)", "ibverbs (mlx5_0:1)", "loopback (loopback)"; with a same-host fabric beside
  // it, "ofi (tcp;ofi_rxm) + shmem (shmem) on this host".
  std::string fabric_name() const;
  const protocol::VerbsStats& stats() const { return stats_; }
  // The memory manager's registration gauges (any thread).
  protocol::RdmaMemoryMgr::RegistrationGauges registration_gauges() const;
  // The transport's counters and registration gauges, under their catalog names (any thread).
  void AppendCounters(CounterList* out) const;
  // For fault injection in tests (loopback::SetFaults is thread-safe); nothing else may use it.
  fabric::Domain* domain_for_testing() { return fabrics_.primary().domain.get(); }
  // Channels that are set up, of both roles, for tests and tools (any thread; asks the loop).
  size_t NumReadyChannels();
  // Every channel with its counters (any thread; asks the loop, empty if it does not answer
  // within `timeout`).
  std::vector<protocol::ChannelSnapshot> ChannelSnapshots(absl::Duration timeout);
  // The same without waiting, for gRPC's threads: `done` runs once, on the loop thread, or at
  // once (with no channels) when the loop has stopped.
  void ChannelSnapshotsAsync(
      absl::AnyInvocable<void(std::vector<protocol::ChannelSnapshot>) &&> done);

  // Lets the writes already under way finish (up to a grace period), then stops the progress
  // loop: from here on this task posts nothing to any peer. Channels stay open until Shutdown.
  // Idempotent; any thread but the loop's.
  void StopTraffic();
  // StopTraffic, then closes every channel and releases the fabric. Idempotent.
  void Shutdown();
  // Where the progress loop is ("grpc+verbs over shmem (shmem): the progress thread is in a
  // posted task after N turns"), or empty when it does not run; for a report on a stuck
  // shutdown.
  std::string LoopReport() const;
  // Whether the calling thread is the progress loop's, or runs its recv callbacks inline (also
  // one the loop left while a callback held it).
  bool OnLoopThread() const {
    return engine_ != nullptr && (engine_->OnLoopThread() || engine_->InInlineCallback());
  }
  // Waits for `event`, driving the transport's progress meanwhile (ProgressEngine::DriveUntil).
  bool DriveUntil(Event& event, absl::Time deadline) {
    return engine_ != nullptr ? engine_->DriveUntil(event, deadline) : event.WaitUntil(deadline);
  }
  // ProgressEngine::QuietScope over this transport's progress (see Server::QuietScope).
  std::shared_ptr<void> QuietScope() {
    if (engine_ == nullptr) return nullptr;
    return std::make_shared<protocol::ProgressEngine::QuietScope>(engine_.get());
  }
  // What an idle turn of the progress loop costs (ProgressEngine::IdleTurnCost); nullopt before
  // one was timed.
  std::optional<protocol::ProgressEngine::TurnCost> IdleTurnCost() const {
    return engine_ != nullptr ? engine_->IdleTurnCost() : std::nullopt;
  }
  void RestartIdleTurnCost() {
    if (engine_ != nullptr) engine_->RestartIdleTurnCost();
  }
  // Idle turns timed since the start or the last restart.
  uint64_t IdleTurnsTimed() const { return engine_ != nullptr ? engine_->IdleTurnsTimed() : 0; }
  // How many times a waiting thread took this transport's progress over.
  uint64_t waiter_drives() const { return engine_ != nullptr ? engine_->waiter_drives() : 0; }

 private:
  explicit VerbsTransport(VerbsOptions options);
  absl::Status Start();
  // Opens a domain per rail of options_.rails beside the primary, through `add_context`, and
  // gives the primary's channels their lanes. A count instead of a list takes the host's
  // interfaces ranked for this task (fabric::ChooseRails). InvalidArgument or the fabric's
  // error, naming the rail, when a listed one cannot open; a rail of a count that cannot open
  // is logged and left out.
  absl::Status OpenLanes(const fabric::FabricChoice& choice,
                         const std::function<void(protocol::FabricContext::Reach,
                                                  std::unique_ptr<fabric::Domain>)>& add_context);
  // Progress thread.
  void Housekeeping(absl::Time now);
  bool OperationsInFlight() const;
  // Whether a peer still has a tensor of this task's on its way to it (a response in progress,
  // or a lent tensor whose borrower has a channel open): what StopTraffic's grace waits for.
  bool ResponsesStillOnTheirWay() const;

  // What the channels need of this transport (protocol::ChannelHost).
  class Host final : public protocol::ChannelHost {
   public:
    explicit Host(VerbsTransport* transport) : transport_(transport) {}
    void Post(absl::AnyInvocable<void() &&> task) override;
    void Deliver(protocol::ProgressEngine::RecvDelivery delivery) override;
    void Quarantine(std::vector<Tensor> memory, absl::Time until) override;
    void ReleaseLent(const std::string& task, uint32_t tensor_key) override;
    bool OnOwnerThread() const override;
    void Connect(const std::string& task, const std::string& address,
                 const proto::ConnectRequest& request, ConnectAnswered answered) override;

   private:
    VerbsTransport* const transport_;
  };

  using RecvStart = protocol::RecvStart;
  // Starts the recvs in recv_inbox_ (PeerChannels::StartRecv): on the progress thread; on any
  // other (the engine refused the task: shutting down) it fails them.
  void StartQueuedRecvs();
  // The primary fabric's env: recvs that never reach a channel are counted and failed through
  // it, and what serves every fabric (the local-tensor inbox, grpc+gdr's lending) is built on it.
  protocol::ChannelEnv& env() { return fabrics_.primary().env; }

  const VerbsOptions options_;
  protocol::VerbsStats stats_;
  KeyTable keys_;  // the keys recvs ask for, parsed once (any thread)
  // The fabric for every peer, and beside it, where OpensSameHostFabric, the same-host fabric
  // for the peers on this host; the progress engine drives all of them.
  protocol::FabricContexts fabrics_;
  Host host_{this};
  std::unique_ptr<protocol::ProgressEngine> engine_;
  std::unique_ptr<protocol::ChannelTable> table_;
  std::unique_ptr<protocol::LocalTensorInbox> local_tensors_;
  std::unique_ptr<VerbsStubs> stubs_;
  std::unique_ptr<ConnectCalls> connect_calls_;
  std::unique_ptr<protocol::PeerChannels> channels_;
  std::unique_ptr<VerbsServiceImpl> service_;
  std::unique_ptr<PeerWatchdog> watchdog_;

  // Progress-thread state.
  std::vector<std::pair<absl::Time, std::vector<Tensor>>> quarantine_;
  std::unique_ptr<LentTensors> lent_;
  // Held by the any-thread users of the fabrics' registrations (gauges, device pools) and by
  // Shutdown, which drops them while they may run.
  mutable Mutex memory_mu_;
  // Recvs started by callers, waiting for the progress thread: one posted task per batch, not
  // one owning each recv (protocol/inbox.h).
  protocol::Inbox<RecvStart> recv_inbox_;
  std::atomic<bool> traffic_stopped_{false};
  std::atomic<bool> shut_down_{false};
};

}  // namespace tensorverbs::verbs

#endif  // TENSORVERBS_TRANSPORT_VERBS_VERBS_TRANSPORT_H_
