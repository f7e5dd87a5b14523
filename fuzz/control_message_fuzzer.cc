// Fuzzes the decoding of a grpc+verbs control-message slot, one message or a batch, as the
// receiving side of a channel reads what a peer wrote (MessageBuffer walks a batch the same
// way). A message that decodes must encode to a canonical form that decodes to itself.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "fuzz/fuzz_check.h"
#include "src/protocol/message.h"

namespace {

using tensorverbs::protocol::Message;

std::vector<uint8_t> Encode(const Message& m) {
  absl::StatusOr<size_t> size = tensorverbs::protocol::EncodedSize(m);
  FUZZ_CHECK(size.ok(), "a decoded message has an encoded size");
  std::vector<uint8_t> out(*size);
  FUZZ_CHECK(tensorverbs::protocol::EncodeMessage(m, absl::MakeSpan(out)).ok(),
             "a decoded message encodes");
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::Span<const uint8_t> slot(data, size);
  // The most messages a slot can hold; a batch that claims more is malformed, not a loop.
  for (int i = 0; i < 1024 && !slot.empty(); ++i) {
    uint16_t more = 0;
    absl::StatusOr<Message> m = tensorverbs::protocol::DecodeMessage(slot, &more);
    if (!m.ok()) {
      FUZZ_CHECK(m.status().code() == absl::StatusCode::kDataLoss, "decoding fails as DataLoss");
      return 0;
    }
    const std::vector<uint8_t> canonical = Encode(*m);
    absl::StatusOr<Message> again = tensorverbs::protocol::DecodeMessage(canonical);
    FUZZ_CHECK(again.ok(), "a canonical encoding decodes");
    FUZZ_CHECK(Encode(*again) == canonical, "decode and encode are inverses");
    const size_t length = tensorverbs::protocol::EncodedLength(slot);
    FUZZ_CHECK(length > 0 && length <= slot.size(), "a message's length is within its slot");
    if (more == 0) break;
    slot.remove_prefix(length);
  }
  return 0;
}
