// The byte layout of a tensor in the copy-verbs comparison mode (seed 002's design): the sender
// copies the tensor into a pre-registered buffer it keeps per tensor name, one RDMA write
// moves the bytes into the receiver's pre-registered buffer for that name, and the receiver
// copies them out into the result tensor: a copy in and a copy out per transfer.
//
// Layout, little-endian: u32 magic "TVCP" | u8 version | u8 flags (bit 0: dead) | u16 0 |
// u32 header_len | u32 0 | u64 content_len | header: a TensorProto with dtype and shape (and
// string_val for string tensors) | content: the raw element bytes of a POD tensor. The buffer
// arrives by RDMA, so ReadCopyPayload validates every length; a malformed payload is DataLoss.
// Pure functions, any thread.
#ifndef TENSORVERBS_PROTOCOL_COPY_PAYLOAD_H_
#define TENSORVERBS_PROTOCOL_COPY_PAYLOAD_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::protocol {

inline constexpr size_t kCopyPayloadHeaderBytes = 24;

// A tensor laid out for the copy mode: Size() bytes, written by WriteTo.
class CopyPayload {
 public:
  // `tensor` is ignored when `is_dead`.
  CopyPayload(const Tensor& tensor, bool is_dead);
  size_t Size() const { return kCopyPayloadHeaderBytes + header_.size() + content_bytes_; }
  // Writes Size() bytes to `out`: the copy in.
  void WriteTo(uint8_t* out) const;

 private:
  Tensor tensor_;
  bool is_dead_;
  std::string header_;
  size_t content_bytes_ = 0;
};

struct ReadPayload {
  Tensor tensor;
  bool is_dead = false;
};

// Reads a payload from the first `available` bytes at `in`, copying the elements into a tensor
// from `allocator`: the copy out. What the payload asks this task to allocate is checked against
// its contents and `max_tensor_bytes` before anything is allocated (string elements are counted
// in their encoding first).
absl::StatusOr<ReadPayload> ReadCopyPayload(const uint8_t* in, size_t available,
                                            Allocator* allocator, uint64_t max_tensor_bytes);

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_COPY_PAYLOAD_H_
