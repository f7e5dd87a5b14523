// Server: one task of a cluster. It hosts the WorkerService on the task's port, owns the task's
// rendezvous manager (one rendezvous per step, of the chosen protocol), the allocator received
// tensors land in, and the executor that runs user callbacks.
//
// Create() validates the job, task and protocol and binds the port; an error names what was
// wrong (unknown job or task, port in use, unknown protocol). Send/Recv go through
// rendezvous_mgr(). All methods are thread-safe; Stop() is idempotent, fails every pending recv
// with Cancelled and returns once the gRPC server has shut down. The destructor calls Stop().
#ifndef TENSORVERBS_SERVER_SERVER_H_
#define TENSORVERBS_SERVER_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/worker.pb.h"
#include "src/common/config.h"
#include "src/common/executor.h"
#include "src/common/mutex.h"
#include "src/rendezvous/rendezvous_mgr.h"
#include "src/rendezvous/transfer_settings.h"
#include "src/rpc/security.h"
#include "src/tensor/allocator.h"
#include "src/transport/grpc/worker_client.h"
#include "src/transport/verbs/verbs_transport.h"
#include "tensorverbs/cluster_spec.h"
#include "tensorverbs/event.h"

namespace tensorverbs {

struct ProtocolSpec;

// Everything a server is configured by. The defaults are the documented defaults of the
// variables named beside each; FromEnvironment reads them (the tools' edge), so a library user
// or a test can run differently configured servers in one process.
struct ServerOptions {
  ClusterSpec cluster;
  std::string job;
  int task = 0;
  std::string protocol = "grpc";
  // Where to listen; empty means the task's own address from the cluster spec.
  std::string listen_address;
  // The settings every protocol honours: how long a remote recv and a silent peer may take, the
  // slow-recv warning, the start-up deadline, and how many of a peer's requests one task holds
  // (TENSORVERBS_RECV_TIMEOUT_MS, _PEER_TIMEOUT_MS, _SLOW_RECV_MS, _CONNECT_TIMEOUT_MS,
  // _MAX_RESPONSES). The server hands them to whichever protocol it runs.
  TransferSettings transfer;
  // Threads that run recv callbacks; 0 runs them inline on the transport's thread
  // (TENSORVERBS_CALLBACK_THREADS).
  int callback_threads = Config::Defaults().callback_threads;
  // How long Task::Stop waits for Stop() before it gives up on it (TENSORVERBS_STOP_TIMEOUT_MS);
  // the server itself waits as long as Stop takes.
  absl::Duration stop_timeout = Config::Defaults().stop_timeout;
  // Size of each region of the receive pool (TENSORVERBS_POOL_REGION_MB).
  int64_t pool_region_bytes = Config::Defaults().pool_region_bytes;
  // Wholly free pool memory kept however long it idles (TENSORVERBS_POOL_KEEP_FREE_MB); free
  // regions beyond it are returned to the OS after kPoolReleaseAfter unused.
  uint64_t pool_keep_free_bytes = Config::Defaults().pool_keep_free_bytes;
  // TENSORVERBS_PIN_POOL: "auto" (page-lock the receive pool when an NVIDIA driver and a GPU
  // are there), "on" (the same, warning when there is none) or "off".
  std::string pin_pool = Config::Defaults().pin_pool;
  static constexpr absl::Duration kPoolReleaseAfter = absl::Seconds(30);
  // The largest tensor accepted from a peer (TENSORVERBS_MAX_TENSOR_MB); a larger announced
  // tensor fails its recv with ResourceExhausted before anything is allocated.
  uint64_t max_tensor_bytes = Config::Defaults().max_tensor_bytes;
  // Chunks of a GPU tensor on the proxy path (TENSORVERBS_PROXY_CHUNK_KB; 0: whole).
  uint64_t proxy_chunk_bytes = Config::Defaults().proxy_chunk_bytes;
  // Steps peers' requests may start before this task does (TENSORVERBS_MAX_PEER_STEPS); one it
  // has not taken up within recv_timeout is aborted.
  int64_t max_peer_steps = Config::Defaults().max_peer_steps;
  // Process-wide malloc tuning, applied by the first server (TENSORVERBS_MALLOC_TUNING,
  // TENSORVERBS_MALLOC_TRIM_MB; see common/malloc_tuning.h).
  bool malloc_tuning = Config::Defaults().malloc_tuning;
  int64_t malloc_trim_bytes = Config::Defaults().malloc_trim_bytes;
  // Who may call this task and how it proves itself to the others (TENSORVERBS_TLS_*,
  // TENSORVERBS_SECRET_FILE; see rpc/security.h). Every task of a cluster needs the same.
  rpc::SecurityOptions security;
  // grpc+verbs settings (fabric, slots, poll mode, ...). The server fills in the env, pool,
  // task addresses, security, transfer settings, mode and device memory.
  verbs::VerbsOptions verbs;
  // Copies device tensors to and from host memory. Null (the default): a CUDA copier when a
  // GPU and the CUDA runtime are present, none otherwise. Set, it must outlive the server
  // (tests give a stand-in).
  DeviceCopier* device_copier = nullptr;
  // How the fabric reaches GPU memory directly, and where device pools' regions come from.
  // Null (the default): CUDA's (CudaFabricMemory, device::NewCudaPool) when a GPU is present.
  // Set, tests stand in for a GPU with host memory (the memory must outlive the server).
  std::shared_ptr<fabric::DeviceMemory> device_memory;
  std::function<absl::StatusOr<std::unique_ptr<PoolAllocator>>(int device)> device_pool_factory;

  // The defaults with every setting that has a variable taken from `config`.
  static ServerOptions FromConfig(const Config& config);
  // FromConfig(Config::Get()), or the environment's first bad value (naming the variable).
  static absl::StatusOr<ServerOptions> FromEnvironment();
};

// The protocols this build provides, best first.
std::vector<std::string> AvailableProtocols();

class Server {
 public:
  static absl::StatusOr<std::unique_ptr<Server>> Create(ServerOptions options);
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;
  ~Server();

  void Stop();
  // What Stop() is waiting for while it runs: its step ("closing the grpc+verbs channels") and
  // where the progress loop is, for the report of an owner that gives up on a Stop that does
  // not return (Task::Stop). Any thread.
  std::string StopReport() const;
  // Whether the calling thread is one of this server's own: a callback thread, or the progress
  // thread running a callback inline. Such a thread cannot wait for the server to stop.
  bool OnOwnThread() const;
  // Waits until `event` is notified or `deadline`, driving grpc+verbs's progress meanwhile
  // (ProgressEngine::DriveUntil); other protocols only wait. Whether it was notified.
  bool DriveUntil(Event& event, absl::Time deadline);
  // A ProgressEngine::QuietScope of grpc+verbs's progress for the calling thread, ended when the
  // result goes (on the same thread); null for other protocols.
  std::shared_ptr<void> QuietScope();
  // Stops this task's grpc+verbs traffic (writes under way finish first) without closing
  // anything: for stopping several servers of one process, whose shared-memory peers must not
  // be written to once one of them has closed. Stop() does it too.
  void StopTraffic();

  const std::string& task_name() const { return env_.task_name; }
  std::string device_name() const;  // /job:J/replica:0/task:T/device:CPU:0
  uint64_t incarnation() const { return env_.incarnation; }
  const std::string& protocol() const { return options_.protocol; }
  const ClusterSpec& cluster() const { return options_.cluster; }
  const WorkerEnv& env() const { return env_; }
  RendezvousMgr* rendezvous_mgr() { return rendezvous_mgr_.get(); }
  PoolAllocator* recv_allocator() { return recv_allocator_.get(); }
  // The pool of GPU `device`'s memory for this task's device tensors, made on first use: where
  // tensors to send on that GPU and recvs into it should come from (RecvArgs::allocator), so
  // neither pays a cudaMalloc or cudaFree. FailedPrecondition without a GPU (saying why),
  // InvalidArgument for an ordinal this host lacks.
  absl::StatusOr<PoolAllocator*> DeviceAllocator(int device);
  // Whether a tensor of the receive pool or of a GPU pool is still referenced: a stopped
  // server must then live on (Task parks it), or those tensors would point at freed memory.
  bool PoolsInUse();
  // GPU `device`'s memory the caller owns as a tensor this task can send (tensor/
  // adopted_memory.h: `release` runs once, when the last reference goes or at once on an
  // error): FailedPrecondition when this task has no CUDA runtime driving that device.
  absl::StatusOr<Tensor> AdoptDeviceMemory(int device, void* data, DataType dtype,
                                           const TensorShape& shape, std::function<void()> release);
  // Returns once the work queued on `device`'s legacy default stream (and the blocking streams
  // before it) has completed: what memory written by the caller's own kernels needs before a
  // send reads it, since this task's copies run on streams of their own. OK at once with a
  // stand-in copier (tests), which has no such stream.
  absl::Status WaitForDeviceWork(int device);
  const TransferStats& stats() const { return stats_; }

  // Waits until every other task of the cluster answers (or `timeout` passes: Unavailable
  // naming the tasks that did not) and records their incarnations: one probe per peer, at most
  // kProbeWave at once. It sets up no channel: over grpc+verbs a channel is set up when the first
  // tensor needs it, so a task has channels only to the peers it exchanges with.
  absl::Status WaitForPeers(absl::Duration timeout);
  // The same for the named tasks alone ("/job:J/replica:0/task:T"; this task's own name is
  // skipped): a task that exchanges with a few peers (a parameter-server worker) waits for
  // those, and its start costs K probes, not N. InvalidArgument names a task not in the
  // cluster, before anything is probed.
  absl::Status WaitForPeers(const std::vector<std::string>& tasks, absl::Duration timeout);
  static constexpr size_t kProbeWave = 32;
  static constexpr absl::Duration kProbeRetryPause = absl::Milliseconds(100);
  // Over grpc+verbs, sets up a channel to every peer now (within `timeout`), for a job that
  // would rather pay for them at start than at each pair's first tensor; OK at once otherwise.
  absl::Status SetUpChannels(absl::Duration timeout);

  // The peer's incarnation as recorded by WaitForPeers, or asked now (bounded by `timeout`).
  absl::StatusOr<uint64_t> PeerIncarnation(const std::string& task_name, absl::Duration timeout);
  // The peer's incarnation if it is known already (this task's own, or recorded); never waits.
  std::optional<uint64_t> KnownPeerIncarnation(const std::string& task_name);

  // The grpc+verbs engine; null for other protocols.
  verbs::VerbsTransport* verbs_transport() { return verbs_.get(); }

  // This task's counters, under their catalog names (common/counters.h), without the
  // channels' (any thread).
  CounterList Counters() const;
  // This task's counters and, over the verbs protocols, every channel's (any thread; what
  // metrics files are made of). Waits up to 2 s for the progress loop's list of channels.
  proto::GetStatsResponse CollectStats();
  // The same without waiting (what the GetStats RPC answers on gRPC's threads): `done` runs
  // once, on the progress loop or at once.
  void CollectStatsAsync(absl::AnyInvocable<void(proto::GetStatsResponse) &&> done);

  // Client of another task's WorkerService (GetStatus, CleanupStep).
  absl::StatusOr<grpc_transport::WorkerClient*> Worker(const std::string& task_name);

 private:
  Server(ServerOptions options, const ProtocolSpec* protocol);
  // CollectStats' two halves: the task's counters, and the channels' (which the loop lists).
  proto::GetStatsResponse CountersWithoutChannels();
  // Page-locks the receive pool for GPU copies, as options_.pin_pool says (Start).
  void PinPoolIfAsked();
  // The device copier env_ gets: options_.device_copier, else a CUDA one where a GPU is.
  void SetUpDeviceCopier();
  // How the transport's fabric may reach GPU memory: options_.device_memory, else CUDA's where
  // a GPU is, else null.
  std::shared_ptr<fabric::DeviceMemory> FabricDeviceMemory();
  // A new pool of GPU `device`'s memory: options_.device_pool_factory's, else CUDA's.
  absl::StatusOr<std::unique_ptr<PoolAllocator>> NewDevicePool(int device);
  void AddChannels(const std::vector<protocol::ChannelSnapshot>& channels,
                   proto::GetStatsResponse* out) const;
  // Start's steps, in order: the receive pool, the worker environment, the protocol's
  // transport and rendezvous manager, then the gRPC port with the protocol's services.
  absl::Status Start();
  void StartPool(bool all_peers_local, bool some_peers_local);
  void FillEnv();
  absl::Status StartProtocol(bool all_peers_local,
                             absl::flat_hash_set<std::string> same_host_tasks);
  absl::Status Listen();
  void WarnIfOpenToAnyone() const;

  const ServerOptions options_;
  const ProtocolSpec* const protocol_;  // options_.protocol's entry (protocols.h)
  const absl::Time started_ = absl::Now();
  TransferStats stats_;
  std::unique_ptr<PoolAllocator> recv_allocator_;
  Mutex device_pools_mu_;
  std::map<int, std::unique_ptr<PoolAllocator>> device_pools_ ABSL_GUARDED_BY(device_pools_mu_);
  // Before the executor, so they outlive it: a step whose last reference goes in a callback
  // the executor drains at shutdown still reaches them.
  // env_.keys: the keys of this task's sends and local recvs, interned from their second use.
  KeyTable keys_{KeyTable::kDefaultMaxKeys, /*admit_repeated_only=*/true};
  StepSizeHint step_sizes_;  // env_.step_sizes
  std::unique_ptr<Executor> executor_;
  WorkerEnv env_;
  std::shared_ptr<const rpc::RpcSecurity> security_;
  std::unique_ptr<grpc_transport::GrpcWorkerCache> workers_;
  // Outlives the rendezvous manager: aborting a step reaches it.
  std::unique_ptr<verbs::VerbsTransport> verbs_;
  // Between the transport and the rendezvous manager: its destructor finishes the copies in
  // flight, whose callbacks reach the transport, the executor and env_.
  std::unique_ptr<DeviceCopier> cuda_copier_;
  std::unique_ptr<RendezvousMgr> rendezvous_mgr_;
  std::unique_ptr<grpc::Service> service_;
  std::unique_ptr<grpc::Server> grpc_server_;

  // The step Stop() is in (a string literal), for StopReport.
  std::atomic<const char*> stop_step_{"not stopping"};
  Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<std::string, uint64_t> peer_incarnations_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_SERVER_SERVER_H_
