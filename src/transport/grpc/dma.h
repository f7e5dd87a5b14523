// The two hooks that turn the `grpc` protocol into `grpc+gdr` (TensorFlow's GDR design): the
// meta-data still travels in the RecvTensor call, but a large POD tensor's bytes do not. The
// sender lends the tensor (TensorLender: keeps it alive in registered memory and names where
// it can be read); the receiver pulls it into its destination with one RDMA read and then
// releases it with a zero-byte write with immediate (TensorPuller). The grpc+verbs transport
// implements both; the `grpc` protocol code only calls them.
//
// Both may be called from any thread; each `done` runs exactly once, on any thread, and must
// not block.
#ifndef TENSORVERBS_TRANSPORT_GRPC_DMA_H_
#define TENSORVERBS_TRANSPORT_GRPC_DMA_H_

#include <cstdint>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "src/tensor/tensor.h"

namespace tensorverbs::grpc_transport {

// Tensors up to this size travel inline in the response; a read costs more (TensorFlow's GDR
// used the same threshold).
inline constexpr size_t kDmaMinBytes = 1024;
// Tensor keys are immediates of the release write; the values above mark grpc+verbs' control
// messages and ACKs on the same channel (protocol/imm.h).
inline constexpr uint32_t kMaxTensorKey = 0xFFFFFBFE;

struct RemoteTensorRef {
  uint64_t addr = 0;
  std::string key;  // the fabric's packed remote key
  uint32_t tensor_key = 0;
  uint64_t bytes = 0;
};

class TensorLender {
 public:
  virtual ~TensorLender() = default;
  // Makes `tensor` readable by `requester` until that task releases it (or the lease ends).
  virtual void Lend(const std::string& requester, const Tensor& tensor,
                    absl::AnyInvocable<void(absl::StatusOr<RemoteTensorRef>) &&> done) = 0;
};

class TensorPuller {
 public:
  virtual ~TensorPuller() = default;
  // Reads the tensor `ref` names from task `task` into `dest` (allocated to its size), then
  // releases it at the sender.
  virtual void Pull(const std::string& task, const RemoteTensorRef& ref, Tensor dest,
                    absl::AnyInvocable<void(const absl::Status&) &&> done) = 0;
};

}  // namespace tensorverbs::grpc_transport

#endif  // TENSORVERBS_TRANSPORT_GRPC_DMA_H_
