// SplitExact: a string split into a fixed number of parts without allocating, for the parsers
// that run on every key a peer sends (device names, rendezvous keys). Any thread.
#ifndef TENSORVERBS_COMMON_SPLIT_EXACT_H_
#define TENSORVERBS_COMMON_SPLIT_EXACT_H_

#include "absl/strings/string_view.h"

namespace tensorverbs {

// Splits `s` at each `sep` into exactly `n` parts, written to parts[0..n); false (parts then
// unspecified) when `s` has any other number of parts.
inline bool SplitExact(absl::string_view s, char sep, absl::string_view* parts, int n) {
  int i = 0;
  for (;;) {
    if (i == n) return false;
    const size_t at = s.find(sep);
    if (at == absl::string_view::npos) {
      parts[i++] = s;
      return i == n;
    }
    parts[i++] = s.substr(0, at);
    s.remove_prefix(at + 1);
  }
}

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_SPLIT_EXACT_H_
