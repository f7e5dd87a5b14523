// The server half of the `grpc` protocol: serves one RecvTensor call.
//
// Called on a gRPC callback thread; never blocks it. It validates the request (the key must be
// well formed, name this task as its source and carry this task's incarnation; the step must
// not be cleaned up), then waits in the step's rendezvous for the tensor and answers with the
// zero-copy encoding. If the caller cancels or its deadline passes, the pending local recv is
// withdrawn. Every call is finished exactly once.
//
// A RecvTensorBudget, shared by the server's service and the calls it holds, bounds how many
// calls wait at once for each receiving task; any thread may use it.
#ifndef TENSORVERBS_TRANSPORT_GRPC_RECV_TENSOR_HANDLER_H_
#define TENSORVERBS_TRANSPORT_GRPC_RECV_TENSOR_HANDLER_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "src/common/mutex.h"

#include "src/protocol/remote_tensor.h"
#include "src/rendezvous/rendezvous_mgr.h"

namespace tensorverbs::grpc_transport {

// grpc+gdr: tensors up to this size travel inline in the response; a read costs more
// (TensorFlow's GDR used the same threshold).
inline constexpr size_t kDmaMinBytes = 1024;

// How many RecvTensor calls this task holds at once for each task that receives from it
// (TENSORVERBS_MAX_RESPONSES, the bound a grpc+verbs channel puts on its peer's requests): a
// peer asking for keys that are not sent yet cannot make this task hold calls without end.
// Keys naming a receiver outside `tasks` (the cluster's task names) share one count, so the
// table holds at most one entry per task plus one.
class RecvTensorBudget {
 public:
  RecvTensorBudget(int max_per_task, absl::flat_hash_set<std::string> tasks)
      : max_per_task_(max_per_task), tasks_(std::move(tasks)) {}

  // Counts one more call held for `receiver`, or ResourceExhausted naming the variable when
  // `receiver` already has the most. On OK the caller calls Release(receiver) once.
  absl::Status Acquire(const std::string& receiver);
  void Release(const std::string& receiver);

  // The calls held for `receiver` now.
  int Held(const std::string& receiver) const;

 private:
  const std::string& Bucket(const std::string& receiver) const;

  const int max_per_task_;
  const absl::flat_hash_set<std::string> tasks_;
  mutable Mutex mu_;
  absl::flat_hash_map<std::string, int> held_ ABSL_GUARDED_BY(mu_);
};

// With a `lender` (grpc+gdr) and a request that allows it, a POD tensor above kDmaMinBytes is
// lent instead of sent: the response names where the receiver reads it. `caller` is the task
// the call was authenticated as (empty without security): it may receive only its own keys.
// `budget` (optional) bounds the calls held per receiver; the call keeps it alive until done.
grpc::ServerUnaryReactor* HandleRecvTensor(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response, RendezvousMgr* mgr,
                                           const WorkerEnv* env, const std::string& caller,
                                           protocol::TensorLender* lender = nullptr,
                                           std::shared_ptr<RecvTensorBudget> budget = nullptr);

}  // namespace tensorverbs::grpc_transport

#endif  // TENSORVERBS_TRANSPORT_GRPC_RECV_TENSOR_HANDLER_H_
