// KeyTable: rendezvous keys parsed once and shared by every recv of them.
//
// A training loop receives the same keys every step. Copying a ParsedKey into each recv costs
// several heap allocations (the full key, the edge name, the device names) and deriving the
// source task name costs another; an interned key is shared by reference count instead, and
// carries what a transport derives from it once. Intern() is called by any thread (a recv's
// caller); the table is bounded: past `max_keys` distinct keys it starts over, and keys already
// handed out stay valid (they are reference counted). A table made with `admit_repeated_only`
// takes a key in at its second sighting (RecurrenceFilter) and hands out a copy of its own at
// the first: names made for one message (torch.distributed numbers every message) then neither
// fill the table nor push out the names a loop repeats. The transport's table of recv keys
// interns at the first sighting: its channels keep per-key state (push-ahead, request
// indexes) by the interned copy, from the first recv on.
#ifndef TENSORVERBS_RENDEZVOUS_KEY_TABLE_H_
#define TENSORVERBS_RENDEZVOUS_KEY_TABLE_H_

#include <algorithm>
#include <cstddef>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "src/common/mutex.h"
#include "src/common/recurrence_filter.h"
#include "tensorverbs/parsed_key.h"

namespace tensorverbs {

struct InternedKey {
  explicit InternedKey(ParsedKey k) : key(std::move(k)), src_task(key.src.TaskName()) {}

  const ParsedKey key;
  const std::string src_task;  // key.src.TaskName()
};

using KeyRef = std::shared_ptr<const InternedKey>;

// An interned key outside any table (a one-off recv, a test).
inline KeyRef MakeKeyRef(ParsedKey key) { return std::make_shared<InternedKey>(std::move(key)); }

class KeyTable {
 public:
  static constexpr size_t kDefaultMaxKeys = 65536;

  explicit KeyTable(size_t max_keys = kDefaultMaxKeys, bool admit_repeated_only = false)
      : max_keys_(max_keys),
        admit_repeated_only_(admit_repeated_only),
        seen_(std::max<size_t>(max_keys, 4096)) {}
  KeyTable(const KeyTable&) = delete;
  KeyTable& operator=(const KeyTable&) = delete;

  // The shared copy of `key` (the same one for every call with the same full key until the
  // table starts over); with admit_repeated_only, a copy of its own at the key's first sighting.
  KeyRef Intern(const ParsedKey& key);
  size_t size() const;

 private:
  const size_t max_keys_;
  const bool admit_repeated_only_;
  mutable Mutex mu_;
  // Views into the interned keys' own full_key, which the values keep alive.
  absl::flat_hash_map<absl::string_view, KeyRef> keys_ ABSL_GUARDED_BY(mu_);
  RecurrenceFilter seen_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_RENDEZVOUS_KEY_TABLE_H_
