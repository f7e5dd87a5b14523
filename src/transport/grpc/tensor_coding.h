// Encoding and parsing of RecvTensorResponse (proto/worker.proto) without needless copies.
//
// The sender writes the small header fields by hand into one slice; the element bytes of a POD
// tensor above kInlineLimit leave as a second slice that points into the tensor's own buffer and
// holds a reference to it until gRPC has sent it, so the sender makes no serialization copy.
// The receiver reads the fields in order straight out of gRPC's slices and copies the element
// bytes once, into a tensor allocated from the destination allocator. Everything received is
// validated. Pure functions, any thread.
#ifndef TENSORVERBS_TRANSPORT_GRPC_TENSOR_CODING_H_
#define TENSORVERBS_TRANSPORT_GRPC_TENSOR_CODING_H_

#include <grpcpp/support/byte_buffer.h>

#include "absl/status/status.h"
#include "tensorverbs/tensor.h"
#include "src/protocol/remote_tensor.h"

namespace tensorverbs::grpc_transport {

// Element bytes up to this size are copied into the header slice: a separate slice costs more.
inline constexpr size_t kInlineLimit = 1024;

// With `remote` (grpc+gdr), the response carries where the tensor can be read instead of its
// bytes.
void EncodeRecvTensorResponse(const Tensor& tensor, bool is_dead, int64_t send_start_micros,
                              grpc::ByteBuffer* out, const protocol::RemoteTensorRef* remote = nullptr);

struct ParsedResponse {
  Tensor tensor;  // with `remote`: allocated to the right dtype and shape, not yet filled
  bool is_dead = false;
  int64_t send_start_micros = 0;
  bool has_remote = false;
  protocol::RemoteTensorRef remote;
};

// DataLoss for a malformed response, with what was wrong; ResourceExhausted for a tensor larger
// than `max_tensor_bytes`. Sizes are checked against the bytes the response carries and the
// limit before anything is allocated.
absl::Status ParseRecvTensorResponse(grpc::ByteBuffer* in, Allocator* allocator,
                                     uint64_t max_tensor_bytes, ParsedResponse* out);

}  // namespace tensorverbs::grpc_transport

#endif  // TENSORVERBS_TRANSPORT_GRPC_TENSOR_CODING_H_
