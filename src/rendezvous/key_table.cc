#include "src/rendezvous/key_table.h"

namespace tensorverbs {

KeyRef KeyTable::Intern(const ParsedKey& key) {
  MutexLock lock(&mu_);
  if (auto it = keys_.find(key.full_key); it != keys_.end()) return it->second;
  if (admit_repeated_only_ && !seen_.SeenBefore(key.full_key)) return MakeKeyRef(key);
  // A peer or a program inventing keys cannot grow the table without bound.
  if (keys_.size() >= max_keys_) keys_.clear();
  KeyRef ref = MakeKeyRef(key);
  keys_.emplace(ref->key.full_key, ref);
  return ref;
}

size_t KeyTable::size() const {
  MutexLock lock(&mu_);
  return keys_.size();
}

}  // namespace tensorverbs
