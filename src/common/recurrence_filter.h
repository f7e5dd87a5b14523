// RecurrenceFilter: whether a name was seen before, so that a cache built for names a training
// loop repeats every step admits a name only at its second sighting.
//
// Names made for one message only (torch.distributed's point to point and collectives number
// every message) would otherwise fill each per-key cache (parsed keys, interned keys, request
// indexes) with entries never asked for again, and the caches' bounded tables would start over
// every few thousand messages, throwing out the names that do repeat. The filter is a
// direct-mapped table of 32-bit fingerprints: a name is "seen" while its slot still holds its
// fingerprint. Two names that share a slot evict each other, so a repeated name may wait a few
// sightings more to be admitted; a false "seen" (two names with one fingerprint in one slot)
// only admits a name early. Not thread-safe: its owner's lock or thread guards it. The slots
// are allocated at the first sighting.
#ifndef TENSORVERBS_COMMON_RECURRENCE_FILTER_H_
#define TENSORVERBS_COMMON_RECURRENCE_FILTER_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/hash/hash.h"
#include "absl/strings/string_view.h"

namespace tensorverbs {

class RecurrenceFilter {
 public:
  // `slots` is rounded up to a power of two; a cache of up to N repeated names wants several
  // times N, so that few of them share a slot.
  explicit RecurrenceFilter(size_t slots) : slots_(RoundUp(slots)) {}

  // True when `name` was offered before and its slot has held it since; otherwise remembers
  // it and returns false.
  bool SeenBefore(absl::string_view name) {
    if (table_.empty()) table_.assign(slots_, 0);
    const uint64_t hash = absl::Hash<absl::string_view>{}(name);
    // The slot comes from the low bits, the fingerprint from the high ones; never 0, which
    // marks an empty slot.
    const uint32_t fingerprint = static_cast<uint32_t>(hash >> 32) | 1u;
    uint32_t& slot = table_[hash & (slots_ - 1)];
    if (slot == fingerprint) return true;
    slot = fingerprint;
    return false;
  }

  // Forgets every name.
  void Clear() { table_.clear(); }

 private:
  static size_t RoundUp(size_t n) {
    size_t p = 1;
    while (p < n) p <<= 1;
    return p;
  }

  const size_t slots_;
  std::vector<uint32_t> table_;
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_RECURRENCE_FILTER_H_
