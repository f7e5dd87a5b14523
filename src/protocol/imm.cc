#include "src/protocol/imm.h"

#include "absl/strings/str_cat.h"

namespace tensorverbs::protocol {

RequestIndexAllocator::RequestIndexAllocator(uint64_t limit) : limit_(limit) {}

absl::StatusOr<uint32_t> RequestIndexAllocator::Allocate() {
  if (live_.size() >= limit_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("all ", limit_, " request indexes of the channel are in use"));
  }
  while (live_.contains(static_cast<uint32_t>(next_))) next_ = (next_ + 1) % limit_;
  const auto index = static_cast<uint32_t>(next_);
  next_ = (next_ + 1) % limit_;
  live_.insert(index);
  return index;
}

bool RequestIndexAllocator::Release(uint32_t index) { return live_.erase(index) == 1; }

}  // namespace tensorverbs::protocol
