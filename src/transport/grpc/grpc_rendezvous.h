// GrpcRemoteRendezvous: the `grpc` protocol's rendezvous. A remote recv is one RecvTensor call
// to the source task with a deadline (TENSORVERBS_RECV_TIMEOUT_MS); the response is parsed
// straight into a tensor from the destination allocator, and the user's callback runs on the
// worker's callback executor. With a protocol::TensorPuller it is `grpc+gdr`'s: a response may name
// where the tensor waits instead of carrying it, and the puller reads it into the destination.
// StartAbort ends in-flight recvs with the abort status. grpc's calls are cancelled; grpc+gdr's
// drain instead (the sender may have lent the tensor, and only the answer names the lease,
// which is then released unread) until their answer, the step's cleanup or shutdown.
// Thread-safe; created by the RendezvousMgr factory through std::make_shared.
#ifndef TENSORVERBS_TRANSPORT_GRPC_GRPC_RENDEZVOUS_H_
#define TENSORVERBS_TRANSPORT_GRPC_GRPC_RENDEZVOUS_H_

#include <atomic>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "src/common/mutex.h"
#include "src/protocol/remote_tensor.h"
#include "src/rendezvous/remote_rendezvous.h"
#include "src/transport/grpc/tensor_coding.h"
#include "src/transport/grpc/worker_client.h"

namespace tensorverbs::grpc_transport {

class GrpcRemoteRendezvous final : public RemoteRendezvous,
                                   public std::enable_shared_from_this<GrpcRemoteRendezvous> {
 public:
  // With a `puller` this is grpc+gdr: large POD tensors are read by RDMA after the call.
  GrpcRemoteRendezvous(const WorkerEnv* env, int64_t step_id, GrpcWorkerCache* workers,
                       absl::Duration recv_timeout, protocol::TensorPuller* puller = nullptr);

 protected:
  void RecvFromRemoteAsync(const ParsedKey& key, const RecvArgs& args,
                           RecvDoneCallback done) override;
  void AbortRemote(const absl::Status& status) override;

 private:
  struct Call;
  // grpc+gdr: the answer to a call whose recv ended at an abort; releases the tensor it lent.
  void ReleaseDrained(Call& call, const grpc::Status& s);
  // grpc+gdr: tells the sender to drop the tensor `parsed` names, unread.
  void ReleaseUnread(const Call& call, const ParsedResponse& parsed);

  GrpcWorkerCache* const workers_;
  const absl::Duration recv_timeout_;
  protocol::TensorPuller* const puller_;
  Mutex mu_;
  // In-flight calls, shared so that AbortRemote can cancel them without holding mu_.
  absl::flat_hash_map<Call*, std::shared_ptr<Call>> active_ ABSL_GUARDED_BY(mu_);
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tensorverbs::grpc_transport

#endif  // TENSORVERBS_TRANSPORT_GRPC_GRPC_RENDEZVOUS_H_
