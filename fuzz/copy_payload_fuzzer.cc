// Fuzzes the copy-out of grpc+verbs-copy: what a receiver reads from the staging buffer a peer
// wrote. Whatever the payload announces, nothing beyond the limit is allocated.
#include <cstddef>
#include <cstdint>

#include "fuzz/fuzz_check.h"
#include "src/protocol/copy_payload.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tensorverbs;
  absl::StatusOr<protocol::ReadPayload> payload =
      protocol::ReadCopyPayload(data, size, CpuAllocator(), fuzz::kMaxTensorBytes);
  if (!payload.ok() || payload->is_dead) return 0;
  if (payload->tensor.CanMemCopy()) {
    FUZZ_CHECK(payload->tensor.TotalBytes() <= size, "elements come from the payload");
  }
  return 0;
}
