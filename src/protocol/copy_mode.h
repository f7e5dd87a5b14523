// grpc+verbs-copy (seed 002's design) on the grpc+verbs machinery: what a channel does
// differently in copy mode, kept beside the payload layout it uses (copy_payload.h).
//
// Each side of a channel keeps a pre-registered buffer per tensor name (CopyBuffers): the
// sender lays the tensor out in its buffer (the copy in), one write moves it into the
// receiver's buffer for that name, and the receiver copies it out. REQUEST, META_DATA_RESPONSE
// and RE_REQUEST describe a name's buffer as a uint8 tensor of its size (BufferMeta), which
// keeps the codec's checks (bytes = elements x size) meaningful; META_DATA_RESPONSE and
// RE_REQUEST then play the seed's BUFFER_REQUEST and BUFFER_RESPONSE.
//
// Everything here runs on the transport's progress thread (it uses the fabric domain through
// the memory manager). A CopyBuffers belongs to one channel.
#ifndef TENSORVERBS_PROTOCOL_COPY_MODE_H_
#define TENSORVERBS_PROTOCOL_COPY_MODE_H_

#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "src/fabric/fabric.h"
#include "src/protocol/copy_payload.h"
#include "src/protocol/memory_mgr.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::protocol {

// The meta-data that describes a name's buffer of `bytes`, and the check a peer's must pass.
TensorMetaData BufferMeta(uint64_t bytes);
bool IsBufferMeta(const TensorMetaData& meta);

// Keeps `buffer` if it holds `bytes` (else replaces it with a larger registered one) and
// returns its registered region.
absl::StatusOr<const fabric::MemoryRegion*> EnsureCopyBuffer(RdmaMemoryMgr* memory, Tensor& buffer,
                                                             uint64_t bytes);

// One channel side's pre-registered buffers by tensor name (rx on the owner, tx on the
// acceptor). A buffer is taken while a transfer uses it and given back after.
class CopyBuffers {
 public:
  // The name's buffer, or an empty tensor if it has none (first transfer, or it is in use).
  Tensor Take(const std::string& name);
  // Two transfers of one name may overlap (different steps): the larger buffer is kept.
  void Return(const std::string& name, Tensor buffer);
  void Clear() { buffers_.clear(); }
  bool empty() const { return buffers_.empty(); }

 private:
  // Bounded like the key cache: a model has a fixed set of names, a runaway peer does not.
  static constexpr size_t kMaxNames = 65536;
  absl::flat_hash_map<std::string, Tensor> buffers_;
};

// Sender: lays `tensor` out in `*buffer` (grown to fit, registered) and returns the buffer's
// region, with the payload's size in `*bytes` (the copy in; the caller counts it).
absl::StatusOr<const fabric::MemoryRegion*> LayOutCopyPayload(RdmaMemoryMgr* memory,
                                                              const Tensor& tensor, bool is_dead,
                                                              Tensor* buffer, uint64_t* bytes);

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_COPY_MODE_H_
