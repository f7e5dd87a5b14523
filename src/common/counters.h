// The counters a task and its channels report, as (name, value) pairs, and the one catalog of
// their names with what each means.
//
// Producers (TransferStats, protocol::VerbsStats, the channels' snapshots, the server's pool
// gauges) append to a CounterList under names from CounterCatalog(); every consumer (the
// GetStats RPC, `tensorverbs stats` and its Prometheus text, the Python package) reads such a
// list or the catalog, so a counter is named in one place. The catalog is constant; any
// thread.
#ifndef TENSORVERBS_COMMON_COUNTERS_H_
#define TENSORVERBS_COMMON_COUNTERS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace tensorverbs {

// Counters by name, in the order their producer appended them.
using CounterList = std::vector<std::pair<std::string, int64_t>>;

struct CounterInfo {
  absl::string_view name;
  absl::string_view help;  // one line, for Prometheus' HELP
  bool gauge = false;      // a value now, rather than a running total
};

// Every counter a task or a channel reports. A channel's failed recvs by status code,
// recv_errors_<code>, are one entry: recv_errors_by_code.
absl::Span<const CounterInfo> CounterCatalog();
// The catalog's entry for `name`; null for a name it lacks (a newer peer's counter).
const CounterInfo* FindCounter(absl::string_view name);

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_COUNTERS_H_
