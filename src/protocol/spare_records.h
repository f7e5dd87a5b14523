// Spare records: finished request and response records kept (up to kMaxSpareRecords of each
// kind) and reassigned to the next ones, so a steady channel makes no heap allocation for them.
// Sanitizer builds keep none, so a use after free stays one that ASan reports.
//
// Used by the channel sides (receiving_side.h, sending_side.h) on the progress thread.
#ifndef TENSORVERBS_PROTOCOL_SPARE_RECORDS_H_
#define TENSORVERBS_PROTOCOL_SPARE_RECORDS_H_

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "src/common/sanitizers.h"

namespace tensorverbs::protocol {

inline constexpr size_t kMaxSpareRecords = kUnderAddressSanitizer ? 0 : 256;

// A record built from `args`: a spare one reassigned, or a new one.
template <typename T, typename... Args>
std::unique_ptr<T> RenewRecord(std::vector<std::unique_ptr<T>>& spares, Args&&... args) {
  if (spares.empty()) return std::make_unique<T>(std::forward<Args>(args)...);
  std::unique_ptr<T> r = std::move(spares.back());
  spares.pop_back();
  *r = T(std::forward<Args>(args)...);
  return r;
}

// Keeps a finished record as a spare, after `blank` replaced everything it held (tensors,
// callbacks, its rendezvous): nothing outlives the record's use.
template <typename T>
void RetireRecord(std::vector<std::unique_ptr<T>>& spares, std::unique_ptr<T> r, T blank) {
  if (spares.size() >= kMaxSpareRecords) return;  // `r` is deleted here
  *r = std::move(blank);
  spares.push_back(std::move(r));
}

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_SPARE_RECORDS_H_
