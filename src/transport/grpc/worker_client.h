// WorkerClient: the gRPC client of one peer task's WorkerService; GrpcWorkerCache: one client
// per task of the cluster, created on first use.
//
// RecvTensorAsync is non-blocking: its callback runs once on a gRPC thread. GetStatus and
// CleanupStep block the calling thread (start-up and tools only, never a gRPC or loop thread).
// Errors name the method, the peer task and its address; a call that could not reach the peer
// before its deadline is Unavailable. Thread-safe.
//
// A RecvTensor call waits for its peer's connection (wait_for_ready: a peer may be starting or
// restarting), but not for the whole recv timeout: GrpcWorkerCache's watch thread fails the
// calls to a peer whose connection has not been ready for the peer timeout (none since the
// oldest waiting call started) with Unavailable, as keepalive does for a frozen connection.
#ifndef TENSORVERBS_TRANSPORT_GRPC_WORKER_CLIENT_H_
#define TENSORVERBS_TRANSPORT_GRPC_WORKER_CLIENT_H_

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/worker.grpc.pb.h"
#include "src/common/mutex.h"
#include "src/rpc/security.h"

namespace tensorverbs::grpc_transport {

class WorkerClient {
 public:
  // Calls prove this task with `security`; answers above `max_answer_bytes` are refused; a
  // connection that stops answering pings for about `peer_timeout` fails its calls.
  WorkerClient(std::string task_name, std::string address, const rpc::RpcSecurity& security,
               uint64_t max_answer_bytes, absl::Duration peer_timeout);

  const std::string& task_name() const { return task_name_; }
  const std::string& address() const { return address_; }

  // `response` receives the raw RecvTensorResponse. `context` carries the deadline; the client
  // holds it (and whatever owns it, when it is an aliasing pointer) until the callback has run,
  // so that the watch can cancel it. Cancelling it fails the call with CANCELLED. `key` and
  // `step_id` name the recv in the slow-recv warning.
  void RecvTensorAsync(std::shared_ptr<grpc::ClientContext> context,
                       const grpc::ByteBuffer* request, grpc::ByteBuffer* response, std::string key,
                       int64_t step_id, std::function<void(grpc::Status)> done);

  absl::StatusOr<proto::GetStatusResponse> GetStatus(absl::Duration timeout);
  absl::Status CleanupStep(int64_t step_id, absl::Duration timeout);

  // Turns a failed call's status into one that names the method, the task and the address.
  // `timeout` is what the caller waited, for the message.
  absl::Status CallError(absl::string_view method, const grpc::Status& status,
                         absl::Duration timeout);

  // The watch: fails the waiting RecvTensor calls if the connection has not been ready since
  // `now - peer_timeout` (nor since the oldest of them started). Returns how many it failed.
  int CancelIfUnreachable(absl::Time now, absl::Duration peer_timeout);
  // The watch: logs a warning, once per call, for each RecvTensor call waiting longer than
  // `threshold` (TENSORVERBS_SLOW_RECV_MS).
  void WarnSlowRecvs(absl::Time now, absl::Duration threshold);

 private:
  struct Waiting {
    std::shared_ptr<grpc::ClientContext> context;
    absl::Time started;
    std::string key;
    int64_t step_id = 0;
    bool slow_warned = false;
    bool unreachable = false;         // cancelled by the watch
    bool out_of_descriptors = false;  // ... while this process could not open a descriptor
  };

  const std::string task_name_;
  const std::string address_;
  Mutex waiting_mu_;
  absl::flat_hash_map<grpc::ClientContext*, Waiting> waiting_ ABSL_GUARDED_BY(waiting_mu_);
  absl::Time last_ready_ ABSL_GUARDED_BY(waiting_mu_) = absl::InfinitePast();
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<proto::WorkerService::Stub> stub_;
  std::unique_ptr<grpc::GenericStub> generic_stub_;
};

class GrpcWorkerCache {
 public:
  // task name (/job:J/replica:0/task:T) -> host:port
  // Clients accept tensors of up to `max_tensor_bytes` (the task's limit) and give up on a
  // peer that stops answering for `peer_timeout`.
  // A zero `peer_timeout` leaves calls to their deadlines (no keepalive, no watch thread).
  // The watch also warns of recvs waiting longer than `slow_recv_warning` (zero: never).
  GrpcWorkerCache(absl::flat_hash_map<std::string, std::string> addresses,
                  std::shared_ptr<const rpc::RpcSecurity> security, uint64_t max_tensor_bytes,
                  absl::Duration peer_timeout,
                  absl::Duration slow_recv_warning = absl::ZeroDuration());
  ~GrpcWorkerCache();  // stops the watch thread

  // NotFound naming the task when it is not in the cluster.
  absl::StatusOr<WorkerClient*> Get(const std::string& task_name);

  // In-flight asynchronous calls, so that a shutting-down server can wait for their callbacks
  // before it destroys what they use.
  void CallStarted();
  void CallDone();
  // True if every call finished within `timeout`.
  bool WaitForNoCalls(absl::Duration timeout);
  // Calls whose recv already ended (grpc+gdr, step aborted) but whose answer is still awaited,
  // so that a tensor the sender lent for it is released. CancelDraining cancels those still in
  // flight (a shutting-down server, before WaitForNoCalls).
  void AddDraining(std::weak_ptr<grpc::ClientContext> context);
  void CancelDraining();

 private:
  void Watch();

  Mutex calls_mu_;
  int64_t calls_ ABSL_GUARDED_BY(calls_mu_) = 0;
  std::vector<std::weak_ptr<grpc::ClientContext>> draining_ ABSL_GUARDED_BY(calls_mu_);

  const absl::flat_hash_map<std::string, std::string> addresses_;
  const std::shared_ptr<const rpc::RpcSecurity> security_;
  const uint64_t max_tensor_bytes_;
  const absl::Duration peer_timeout_;
  const absl::Duration slow_recv_warning_;
  Mutex mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<WorkerClient>> clients_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread watch_;
};

}  // namespace tensorverbs::grpc_transport

#endif  // TENSORVERBS_TRANSPORT_GRPC_WORKER_CLIENT_H_
