// VerbsTransport: the grpc+verbs protocol engine of one server.
//
// It owns the fabric domain (chosen by fabric::OpenFabric's policy, TENSORVERBS_FABRIC), the
// progress thread that is the only thread touching the domain, every Channel, the memory manager and the VerbsService the peers
// call to set channels up. Recv() starts a recv of a remote tensor: on first use of a peer the
// channel is set up by one Connect RPC (the endpoint address and message-buffer key exchange),
// then the tensor moves by RDMA as channel.h describes.
//
// Liveness: libfabric reports nothing when a peer dies, so a watchdog thread probes every peer
// with pending recvs (VerbsService.CheckChannel) every TENSORVERBS_PEER_TIMEOUT_MS / 4; a peer
// that does not answer within TENSORVERBS_PEER_TIMEOUT_MS fails its recvs with Unavailable
// naming it, one that answers with a new incarnation fails them with Aborted, and one that
// closed its end of the channel (after an error there) fails them with its reason. The channel
// is dropped and the next recv from that task sets up a new one.
//
// Poll modes (TENSORVERBS_POLL_MODE): busy spins on Domain::Poll; blocking sleeps in
// Domain::Wait whenever nothing is ready; adaptive (default) spins for TENSORVERBS_POLL_SPIN_US
// after the last activity, then sleeps. Work queued from other threads interrupts the sleep.
//
// Thread-safety: public methods may be called from any thread; Recv, AbortStep, Lend and Pull
// also from the progress thread (inline callbacks), the others not. User callbacks run on the
// worker's callback executor (inline when it has no threads), each exactly once. Shutdown()
// (also run by the destructor) first lets tensors that peers already took finish sending (up
// to 2 s), then fails whatever is pending with Cancelled and joins the threads.
#ifndef TENSORVERBS_PROTOCOL_VERBS_TRANSPORT_H_
#define TENSORVERBS_PROTOCOL_VERBS_TRANSPORT_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/verbs.grpc.pb.h"
#include "src/common/config.h"
#include "src/common/mutex.h"
#include "src/fabric/fabric.h"
#include "src/protocol/channel.h"
#include "src/protocol/memory_mgr.h"
#include "src/rendezvous/remote_rendezvous.h"
#include "src/rendezvous/rendezvous_mgr.h"

namespace tensorverbs::protocol {

enum class PollMode { kBusy, kBlocking, kAdaptive };

struct VerbsOptions {
  const WorkerEnv* env = nullptr;
  PoolAllocator* pool = nullptr;  // registered once per region; staging comes from it too
  absl::flat_hash_map<std::string, std::string> task_addresses;  // every task of the cluster
  bool all_peers_local = false;  // every task runs on this host (shm is then a candidate)
  absl::Duration recv_timeout = absl::Minutes(10);
  // From the environment by default (Config::Get()); tests override.
  std::string fabric = Config::Get().fabric;
  std::string ofi_provider = Config::Get().ofi_provider;
  int message_slots = Config::Get().message_slots;
  int message_batch = Config::Get().message_batch;
  std::string poll_mode = Config::Get().poll_mode;
  absl::Duration poll_spin = Config::Get().poll_spin;
  bool data_validation = Config::Get().data_validation;
  std::string registration = Config::Get().registration;
  VerbsMode mode = VerbsMode::kZeroCopy;  // set from the protocol by the server
  absl::Duration peer_timeout = Config::Get().peer_timeout;
  absl::Duration connect_timeout = Config::Get().connect_timeout;
};

class VerbsTransport : public grpc_transport::TensorLender, public grpc_transport::TensorPuller {
 public:
  static absl::StatusOr<std::unique_ptr<VerbsTransport>> Create(VerbsOptions options);
  VerbsTransport(const VerbsTransport&) = delete;
  VerbsTransport& operator=(const VerbsTransport&) = delete;
  ~VerbsTransport();

  // The service to register on the server's gRPC port, before it starts.
  grpc::Service* service();
  // Where requests from peers find the local sends. Set before the server starts serving.
  void set_rendezvous_mgr(RendezvousMgr* mgr) { channel_env_.rendezvous_mgr = mgr; }

  // Receives `key` (its source task is a peer) for `rendezvous`'s step into memory from
  // `allocator`. The recv fails at once if the rendezvous was aborted before it started.
  void Recv(std::shared_ptr<RemoteRendezvous> rendezvous, const ParsedKey& key,
            Allocator* allocator, RecvDoneCallback done);
  // Fails the step's pending recvs with `status`.
  void AbortStep(int64_t step_id, const absl::Status& status);

  // grpc+gdr (VerbsMode::kGdr). Lend: the sender keeps `tensor` (or a registered copy of it)
  // for `requester` until a release immediate from that task names it, or the lease of
  // TENSORVERBS_RECV_TIMEOUT_MS + TENSORVERBS_PEER_TIMEOUT_MS passes. Pull: the receiver reads
  // it over its channel to `task` (set up on first use) and releases it.
  void Lend(const std::string& requester, const Tensor& tensor,
            absl::AnyInvocable<void(absl::StatusOr<grpc_transport::RemoteTensorRef>) &&> done)
      override;
  void Pull(const std::string& task, const grpc_transport::RemoteTensorRef& ref, Tensor dest,
            absl::AnyInvocable<void(const absl::Status&) &&> done) override;
  // Tensors lent and not yet released (any thread; asks the loop).
  size_t NumLentTensors();

  // Sets up channels to every peer task, waiting up to `timeout` (wait-for-peers). The error
  // names the tasks whose channel could not be set up and why.
  absl::Status ConnectPeers(absl::Duration timeout);

  // "ofi (shm)", "ibverbs (mlx5_0:1)", "loopback (loopback)".
  std::string fabric_name() const;
  const VerbsStats& stats() const { return stats_; }
  // For fault injection in tests (loopback::SetFaults is thread-safe); nothing else may use it.
  fabric::Domain* domain_for_testing() { return domain_.get(); }
  // Channels by role that are set up, for tests and tools (any thread; asks the loop).
  size_t NumReadyChannels();

  void Shutdown();

 private:
  class Service;
  using Task = absl::AnyInvocable<void() &&>;

  explicit VerbsTransport(VerbsOptions options);
  absl::Status Start();

  // Runs `fn` on the progress thread and returns its result; for other threads, which wait.
  // Cancelled after shutdown, DeadlineExceeded if the loop does not get to it within `timeout`.
  template <typename T>
  absl::StatusOr<T> AskLoop(absl::AnyInvocable<T()> fn,
                            absl::Duration timeout = absl::InfiniteDuration());

  // Queues `task` for the progress thread; false (and `task` left untouched) after shutdown.
  // On the progress thread itself, defers it to later in the current turn of the loop.
  bool Post(Task& task);
  // Runs the deferred tasks (and those they defer); true if there were any.
  bool RunDeferred();
  void ProgressLoop();
  void Housekeeping(absl::Time now);
  // Whether any endpoint has operations posted and not completed.
  bool OperationsInFlight() const;

  // Progress thread.
  absl::StatusOr<Channel*> OwnerChannel(const std::string& task);
  void OnConnectDone(uint64_t channel_id, const grpc::Status& status);
  absl::Status Accept(const proto::ConnectRequest& request, proto::ConnectResponse* response);
  // FailedPrecondition naming both tasks when `task`'s control messages use another layout.
  absl::Status CheckWireVersion(const std::string& task, uint32_t version) const;
  void CheckChannel(const proto::CheckChannelRequest& request,
                    proto::CheckChannelResponse* response);
  Channel* FindChannel(uint64_t id);
  void CloseChannelsOf(const std::string& task, bool owner_only, const absl::Status& status);

  void WatchdogLoop();
  bool OnProgressThread() const {
    return std::this_thread::get_id() == progress_thread_id_.load(std::memory_order_relaxed);
  }
  // The VerbsService client of `task` (an address from task_addresses); any thread.
  std::shared_ptr<proto::VerbsService::Stub> Stub(const std::string& task,
                                                  const std::string& address);

  const VerbsOptions options_;
  PollMode poll_mode_ = PollMode::kAdaptive;
  VerbsStats stats_;
  std::unique_ptr<fabric::Domain> domain_;
  std::unique_ptr<RdmaMemoryMgr> memory_;
  ChannelEnv channel_env_;
  std::unique_ptr<Service> service_;

  Mutex mu_;
  std::deque<Task> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Set with tasks_ (and with stopping_) so that the loop looks at the queue only when there is
  // something to see.
  std::atomic<bool> has_tasks_{false};
  // Set by the progress thread before it sleeps, so Post knows to interrupt the wait.
  std::atomic<bool> sleeping_{false};
  std::atomic<std::thread::id> progress_thread_id_{};
  // Tasks posted on the progress thread itself, run later in the same turn of the loop.
  std::vector<Task> deferred_;
  // User callbacks completed in this turn of the loop, handed to the executor at its end.
  std::vector<Executor::Task> callbacks_;
  std::thread progress_thread_;

  // Connect results for ConnectPeers, written by the progress thread.
  Mutex connect_mu_;
  absl::flat_hash_map<std::string, absl::Status> connect_results_ ABSL_GUARDED_BY(connect_mu_);

  // Progress-thread state.
  absl::flat_hash_map<uint64_t, std::unique_ptr<Channel>> channels_;
  absl::flat_hash_map<fabric::Endpoint*, Channel*> by_endpoint_;
  absl::flat_hash_map<std::string, uint64_t> owner_by_task_;
  struct Connecting {
    grpc::ClientContext context;
    proto::ConnectRequest request;
    proto::ConnectResponse response;
  };
  absl::flat_hash_map<uint64_t, std::unique_ptr<Connecting>> connecting_;
  std::vector<std::pair<absl::Time, std::vector<Tensor>>> quarantine_;
  // grpc+gdr, sender side: lent tensors by the tensor key the release immediate carries.
  struct Lent {
    Tensor tensor;
    std::string requester;
    absl::Time expires;
  };
  absl::flat_hash_map<uint32_t, Lent> lent_;
  RequestIndexAllocator lend_keys_;
  void ReleaseLent(const std::string& task, uint32_t tensor_key);
  // Why recently closed acceptor channels closed, by (owner task, owner's channel id), so that
  // the owner's probe learns it; bounded.
  absl::flat_hash_map<std::pair<std::string, uint64_t>, absl::Status> closed_accepted_;
  uint64_t next_channel_id_ = 1;

  Mutex stubs_mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<proto::VerbsService::Stub>> stubs_
      ABSL_GUARDED_BY(stubs_mu_);

  // Watchdog.
  Mutex watchdog_mu_;
  bool watchdog_stop_ ABSL_GUARDED_BY(watchdog_mu_) = false;

  std::thread watchdog_thread_;
  std::atomic<int> connects_in_flight_{0};
};

template <typename T>
absl::StatusOr<T> VerbsTransport::AskLoop(absl::AnyInvocable<T()> fn, absl::Duration timeout) {
  // Shared: after a timeout the task may still run and must have somewhere to write.
  struct Answer {
    Notification done;
    T value{};
  };
  auto answer = std::make_shared<Answer>();
  Task task = [answer, fn = std::move(fn)]() mutable {
    answer->value = fn();
    answer->done.Notify();
  };
  if (!Post(task)) return absl::CancelledError("the transport is shutting down");
  if (!answer->done.WaitForNotificationWithTimeout(timeout)) {
    return absl::DeadlineExceededError("the progress thread did not answer in time");
  }
  return std::move(answer->value);
}

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_VERBS_TRANSPORT_H_
