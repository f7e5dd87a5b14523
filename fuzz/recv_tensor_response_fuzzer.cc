// Fuzzes ParseRecvTensorResponse, what a receiver does with a peer's RecvTensor answer over
// grpc and grpc+gdr (where it carries the RemoteTensor descriptor of the tensor to read). The
// first input byte splits the rest into two slices, as gRPC hands a response in several. A
// tensor that parses (with its bytes) must encode and parse back to the same content.
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz/fuzz_check.h"
#include "src/transport/grpc/tensor_coding.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tensorverbs;
  if (size == 0) return 0;
  const size_t split = std::min<size_t>(data[0], size - 1);
  const uint8_t* body = data + 1;
  const size_t body_size = size - 1;
  std::vector<grpc::Slice> slices;
  slices.emplace_back(body, split);
  slices.emplace_back(body + split, body_size - split);
  grpc::ByteBuffer buffer(slices.data(), slices.size());
  grpc_transport::ParsedResponse parsed;
  absl::Status status = grpc_transport::ParseRecvTensorResponse(&buffer, CpuAllocator(),
                                                                fuzz::kMaxTensorBytes, &parsed);
  if (!status.ok()) {
    FUZZ_CHECK(status.code() == absl::StatusCode::kDataLoss ||
                   status.code() == absl::StatusCode::kResourceExhausted,
               "a refused response is DataLoss or ResourceExhausted");
    return 0;
  }
  if (parsed.has_remote || !parsed.tensor.IsInitialized()) return 0;
  if (parsed.tensor.CanMemCopy()) {
    FUZZ_CHECK(parsed.tensor.TotalBytes() <= body_size, "elements come from the response");
  }
  grpc::ByteBuffer encoded;
  grpc_transport::EncodeRecvTensorResponse(parsed.tensor, parsed.is_dead, 0, &encoded);
  grpc_transport::ParsedResponse again;
  FUZZ_CHECK(grpc_transport::ParseRecvTensorResponse(&encoded, CpuAllocator(),
                                                     fuzz::kMaxTensorBytes, &again)
                 .ok(),
             "a tensor's own response parses");
  FUZZ_CHECK(again.tensor.ContentEquals(parsed.tensor), "the round trip keeps the content");
  return 0;
}
