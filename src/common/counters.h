// The counters tensorverbs reports, as (name, value) pairs, and the one catalog of them keyed
// by an enum: each counter's name, its help and whether it is a gauge.
//
// Producers (TransferStats, protocol::VerbsStats, the channels' snapshots, the server's pool
// gauges, the torch backend's groups) append to a CounterList or add to a CounterSet by key
// (AddCounter, CounterSet::Add); the name is the catalog's, typed once. Every consumer (the
// GetStats RPC, `tensorverbs stats` and its Prometheus text, the Python package, the torch
// backend's `stats()`) reads such a list or the catalog. The catalog is constant; any thread.
// A CounterSet is a set of atomics that any thread adds to.
#ifndef TENSORVERBS_COMMON_COUNTERS_H_
#define TENSORVERBS_COMMON_COUNTERS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace tensorverbs {

// Counters by name, in the order their producer appended them.
using CounterList = std::vector<std::pair<std::string, int64_t>>;

enum class Counter : uint16_t {
  // Every protocol: TransferStats and the receive pool.
  kTensorsReceived,     // tensors_received
  kBytesReceived,       // bytes_received
  kRecvErrors,          // recv_errors
  kCopies,              // copies
  kCopiedBytes,         // copied_bytes
  kDeviceToHostCopies,  // device_to_host_copies
  kHostToDeviceCopies,  // host_to_device_copies
  kDeviceCopiedBytes,   // device_copied_bytes
  kDeviceCopyErrors,    // device_copy_errors
  kDeviceDirectSends,   // device_direct_sends
  kDeviceDirectRecvs,   // device_direct_recvs
  kPoolRegions,         // pool_regions
  kPoolBytes,           // pool_bytes
  kPoolBytesInUse,      // pool_bytes_in_use
  kPoolAllocations,     // pool_allocations
  // The verbs protocols: protocol::VerbsStats, registrations, channels.
  kRequests,                 // requests
  kMetaCacheHits,            // meta_cache_hits
  kPushedRequests,           // pushed_requests
  kPushHits,                 // push_hits
  kMetaResponses,            // meta_responses
  kReRequests,               // re_requests
  kErrorsSent,               // errors_sent
  kControlMessages,          // control_messages
  kControlSlots,             // control_slots
  kSlotWaits,                // slot_waits
  kTensorsSent,              // tensors_sent
  kBytesSent,                // bytes_sent
  kTransientRegistrations,   // transient_registrations
  kInPlaceRecvs,             // in_place_recvs
  kContentSegments,          // content_segments
  kStripedRequests,          // striped_requests
  kLanesTakenOut,            // lanes_taken_out
  kChannelsRenewedForLanes,  // channels_renewed_for_lanes
  kRegisteredRegions,        // registered_regions
  kRegisteredBytes,          // registered_bytes
  kChannelRegistrations,     // channel_registrations
  kChannelRegisteredBytes,   // channel_registered_bytes
  kRegistrations,            // registrations
  kWaiterDrives,             // waiter_drives
  kDroppedImmediates,        // dropped_immediates
  kChannelsFailed,           // channels_failed
  kChecksumFailures,         // checksum_failures
  kLivenessProbes,           // liveness_probes
  kPendingRecvs,             // pending_recvs
  kResponsesPending,         // responses_pending
  kChannels,                 // channels
  kProxies,                  // proxies
  kRecvErrorsByCode,         // recv_errors_by_code
  // A torch.distributed group of the torch backend (python/src/torch), per process.
  kTorchStagedCopies,         // torch_staged_copies
  kTorchStagedBytes,          // torch_staged_bytes
  kTorchLentSends,            // torch_lent_sends
  kTorchLentBytes,            // torch_lent_bytes
  kTorchLandedCopies,         // torch_landed_copies
  kTorchLandedBytes,          // torch_landed_bytes
  kTorchInPlaceRecvs,         // torch_in_place_recvs
  kTorchInPlaceBytes,         // torch_in_place_bytes
  kTorchCollectives,          // torch_collectives
  kTorchCollectivesOnCaller,  // torch_collectives_on_caller
  kTorchSameHostCollectives,  // torch_same_host_collectives
  kTorchFailed,               // torch_failed
  kCount,                     // not a counter: how many there are
};

// Who reports a counter: a task or its channels (GetStats, `tensorverbs stats`), or a torch
// group (tensorverbs.torch.stats, which gives the torch_ names without that prefix). Names are
// unique across the catalog, as Prometheus needs.
enum class CounterScope : uint8_t { kTask, kTorchGroup };

struct CounterInfo {
  Counter key = Counter::kCount;
  CounterScope scope = CounterScope::kTask;
  absl::string_view name;
  absl::string_view help;  // one line, for Prometheus' HELP
  bool gauge = false;      // a value now, rather than a running total
};

// Every counter, in the enum's order. A channel's failed recvs by status code,
// recv_errors_<code>, are one entry: recv_errors_by_code.
absl::Span<const CounterInfo> CounterCatalog();
// The catalog's entry for `key`.
const CounterInfo& CounterInfoOf(Counter key);
// The task-scope entry named `name`; null for a name it lacks (a newer peer's counter).
const CounterInfo* FindCounter(absl::string_view name);

// Appends `key`'s (name, value) to `out`; the second form reads a running total.
void AddCounter(CounterList* out, Counter key, int64_t value);
inline void AddCounter(CounterList* out, Counter key, const std::atomic<int64_t>& total) {
  AddCounter(out, key, total.load(std::memory_order_relaxed));
}

// Atomic totals of the counters from `First` to `Last` (inclusive), added to by key from any
// thread (`set.Add<Counter::kX>(n)`); List() gives them under their catalog names, in the
// enum's order.
template <Counter First, Counter Last>
class CounterSet {
 public:
  static constexpr size_t kSize = static_cast<size_t>(Last) - static_cast<size_t>(First) + 1;

  // The key is a template argument so that one outside [First, Last] fails to compile.
  template <Counter kKey>
  void Add(int64_t n = 1) {
    values_[Index<kKey>()].fetch_add(n, std::memory_order_relaxed);
  }
  template <Counter kKey>
  int64_t Get() const {
    return values_[Index<kKey>()].load(std::memory_order_relaxed);
  }
  CounterList List() const {
    CounterList out;
    out.reserve(kSize);
    for (size_t i = 0; i < kSize; ++i) {
      AddCounter(&out, static_cast<Counter>(static_cast<size_t>(First) + i),
                 values_[i].load(std::memory_order_relaxed));
    }
    return out;
  }

 private:
  template <Counter kKey>
  static constexpr size_t Index() {
    static_assert(kKey >= First && kKey <= Last, "a counter outside this set");
    return static_cast<size_t>(kKey) - static_cast<size_t>(First);
  }
  std::array<std::atomic<int64_t>, kSize> values_{};
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_COUNTERS_H_
