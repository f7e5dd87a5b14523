// The server half of the `grpc` protocol: serves one RecvTensor call.
//
// Called on a gRPC callback thread; never blocks it. It validates the request (the key must be
// well formed, name this task as its source and carry this task's incarnation; the step must
// not be cleaned up), then waits in the step's rendezvous for the tensor and answers with the
// zero-copy encoding. If the caller cancels or its deadline passes, the pending local recv is
// withdrawn. Every call is finished exactly once.
#ifndef TENSORVERBS_TRANSPORT_GRPC_RECV_TENSOR_HANDLER_H_
#define TENSORVERBS_TRANSPORT_GRPC_RECV_TENSOR_HANDLER_H_

#include <grpcpp/grpcpp.h>

#include "src/protocol/remote_tensor.h"
#include "src/rendezvous/rendezvous_mgr.h"

namespace tensorverbs::grpc_transport {

// grpc+gdr: tensors up to this size travel inline in the response; a read costs more
// (TensorFlow's GDR used the same threshold).
inline constexpr size_t kDmaMinBytes = 1024;

// With a `lender` (grpc+gdr) and a request that allows it, a POD tensor above kDmaMinBytes is
// lent instead of sent: the response names where the receiver reads it. `caller` is the task
// the call was authenticated as (empty without security): it may receive only its own keys.
grpc::ServerUnaryReactor* HandleRecvTensor(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response, RendezvousMgr* mgr,
                                           const WorkerEnv* env, const std::string& caller,
                                           protocol::TensorLender* lender = nullptr);

}  // namespace tensorverbs::grpc_transport

#endif  // TENSORVERBS_TRANSPORT_GRPC_RECV_TENSOR_HANDLER_H_
