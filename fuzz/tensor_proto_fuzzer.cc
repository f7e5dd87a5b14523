// Fuzzes what a receiver does with a peer's encoded TensorProto (copy-mode payloads and string
// tensors carry one): CountEncodedTensor, then TensorFromEncodedProto within the counts. A
// tensor that decodes must encode and decode back to the same content.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "fuzz/fuzz_check.h"
#include "src/tensor/tensor_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tensorverbs;
  const absl::string_view encoded(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<EncodedTensorCounts> counts = CountEncodedTensor(encoded);
  if (!counts.ok()) {
    FUZZ_CHECK(counts.status().code() == absl::StatusCode::kDataLoss, "counting fails as DataLoss");
    return 0;
  }
  // Every counted element cost at least two bytes of input.
  FUZZ_CHECK(counts->strings * 2 <= static_cast<int64_t>(size), "strings within the input");
  FUZZ_CHECK(counts->dims * 2 <= static_cast<int64_t>(size), "dimensions within the input");
  absl::StatusOr<Tensor> tensor = TensorFromEncodedProto(encoded, *counts, CpuAllocator());
  if (!tensor.ok()) return 0;
  proto::TensorProto again;
  TensorToProto(*tensor, &again);
  const std::string bytes = again.SerializeAsString();
  absl::StatusOr<EncodedTensorCounts> counts_again = CountEncodedTensor(bytes);
  FUZZ_CHECK(counts_again.ok(), "a tensor's own encoding counts");
  absl::StatusOr<Tensor> back = TensorFromEncodedProto(bytes, *counts_again, CpuAllocator());
  FUZZ_CHECK(back.ok(), "a tensor's own encoding decodes");
  FUZZ_CHECK(back->ContentEquals(*tensor), "the round trip keeps the content");
  return 0;
}
