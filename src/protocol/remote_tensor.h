// A tensor another task makes readable over RDMA, and the two hooks that turn the `grpc`
// protocol into `grpc+gdr` (TensorFlow's GDR design): the meta-data still travels in the
// RecvTensor call, but a large POD tensor's bytes do not. The sender lends the tensor
// (TensorLender: keeps it alive in registered memory and names where it can be read); the
// receiver pulls it into its destination with one RDMA read over its channel and then releases
// it with a zero-byte write whose immediate is the tensor key (TensorPuller).
//
// They live in the protocol layer because the protocol owns what they describe: the packed
// remote key, and the immediate space the tensor key shares with request indexes. The grpc+verbs
// transport implements both interfaces; the `grpc` transport only calls them.
//
// Both may be called from any thread; each `done` runs exactly once, on any thread, and must
// not block.
#ifndef TENSORVERBS_PROTOCOL_REMOTE_TENSOR_H_
#define TENSORVERBS_PROTOCOL_REMOTE_TENSOR_H_

#include <cstdint>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "src/protocol/imm.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::protocol {

// Tensor keys are immediates of the release write, so they live in the request-index space
// below the values that mark control messages and ACKs on the same channel.
inline constexpr uint32_t kMaxTensorKey = kMaxRequestIndex;

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
  // releases it at the sender. An uninitialized `dest` releases it without reading.
  virtual void Pull(const std::string& task, const RemoteTensorRef& ref, Tensor dest,
                    absl::AnyInvocable<void(const absl::Status&) &&> done) = 0;
};

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_REMOTE_TENSOR_H_
