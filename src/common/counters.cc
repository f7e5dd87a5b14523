#include "src/common/counters.h"

namespace tensorverbs {
namespace {

constexpr CounterInfo kCounters[] = {
    {Counter::kTensorsReceived, CounterScope::kTask, "tensors_received",
     "Remote recvs completed OK", false},
    {Counter::kBytesReceived, CounterScope::kTask, "bytes_received",
     "Element bytes of the tensors received", false},
    {Counter::kRecvErrors, CounterScope::kTask, "recv_errors", "Remote recvs that failed", false},
    {Counter::kCopies, CounterScope::kTask, "copies",
     "Copies of tensor bytes this task made (zero-copy paths make none)", false},
    {Counter::kCopiedBytes, CounterScope::kTask, "copied_bytes", "Bytes those copies moved", false},
    {Counter::kDeviceToHostCopies, CounterScope::kTask, "device_to_host_copies",
     "Device tensors copied to host memory to be sent", false},
    {Counter::kHostToDeviceCopies, CounterScope::kTask, "host_to_device_copies",
     "Recvs into device memory copied from a host proxy", false},
    {Counter::kDeviceCopiedBytes, CounterScope::kTask, "device_copied_bytes",
     "Bytes those device copies moved", false},
    {Counter::kDeviceCopyErrors, CounterScope::kTask, "device_copy_errors",
     "Copies between host and device memory that failed", false},
    {Counter::kDeviceDirectSends, CounterScope::kTask, "device_direct_sends",
     "Device tensors sent from GPU memory with no host copy", false},
    {Counter::kDeviceDirectRecvs, CounterScope::kTask, "device_direct_recvs",
     "Device tensors received into GPU memory with no host copy", false},
    {Counter::kPoolRegions, CounterScope::kTask, "pool_regions",
     "Regions of the registered receive pool", true},
    {Counter::kPoolBytes, CounterScope::kTask, "pool_bytes", "Bytes of the registered receive pool",
     true},
    {Counter::kPoolBytesInUse, CounterScope::kTask, "pool_bytes_in_use",
     "Bytes of the pool held by live tensors", true},
    {Counter::kPoolAllocations, CounterScope::kTask, "pool_allocations", "Live tensors in the pool",
     true},
    {Counter::kRequests, CounterScope::kTask, "requests", "REQUEST messages sent", false},
    {Counter::kMetaCacheHits, CounterScope::kTask, "meta_cache_hits",
     "REQUESTs that carried cached meta-data", false},
    {Counter::kPushedRequests, CounterScope::kTask, "pushed_requests",
     "REQUESTs made ahead for a key's next step", false},
    {Counter::kPushHits, CounterScope::kTask, "push_hits",
     "Recvs that found their request already made", false},
    {Counter::kMetaResponses, CounterScope::kTask, "meta_responses",
     "META_DATA_RESPONSE messages sent", false},
    {Counter::kReRequests, CounterScope::kTask, "re_requests", "RE_REQUEST messages sent", false},
    {Counter::kErrorsSent, CounterScope::kTask, "errors_sent", "ERROR_STATUS messages sent", false},
    {Counter::kControlMessages, CounterScope::kTask, "control_messages", "Control messages written",
     false},
    {Counter::kControlSlots, CounterScope::kTask, "control_slots",
     "Message-slot writes carrying them", false},
    {Counter::kSlotWaits, CounterScope::kTask, "slot_waits",
     "Times control messages waited for a free slot of the peer", false},
    {Counter::kTensorsSent, CounterScope::kTask, "tensors_sent", "Tensor contents written to peers",
     false},
    {Counter::kBytesSent, CounterScope::kTask, "bytes_sent",
     "Bytes of tensor contents written to peers", false},
    {Counter::kTransientRegistrations, CounterScope::kTask, "transient_registrations",
     "Memory registered for one transfer", false},
    {Counter::kInPlaceRecvs, CounterScope::kTask, "in_place_recvs",
     "Recvs whose destination was memory their caller gave (into)", false},
    {Counter::kContentSegments, CounterScope::kTask, "content_segments",
     "Content segments that landed before their tensor's last (a recv told of its progress, or "
     "a tensor spread over lanes)",
     false},
    {Counter::kStripedRequests, CounterScope::kTask, "striped_requests",
     "Destinations asked for in segments spread over several lanes (TENSORVERBS_RAILS)", false},
    {Counter::kLanesTakenOut, CounterScope::kTask, "lanes_taken_out",
     "Lanes a channel went on without after they failed (TENSORVERBS_RAILS)", false},
    {Counter::kChannelsRenewedForLanes, CounterScope::kTask, "channels_renewed_for_lanes",
     "Channels given back while quiet, once the back-off after a lane failed ran out, so that "
     "the next recv sets one up with every lane (TENSORVERBS_RAILS)",
     false},
    {Counter::kRegisteredRegions, CounterScope::kTask, "registered_regions",
     "Pool regions registered with the fabric", true},
    {Counter::kRegisteredBytes, CounterScope::kTask, "registered_bytes",
     "Bytes of the pool regions registered with the fabric", true},
    {Counter::kChannelRegistrations, CounterScope::kTask, "channel_registrations",
     "Registrations made for one channel's peer alone (per-channel keys)", true},
    {Counter::kChannelRegisteredBytes, CounterScope::kTask, "channel_registered_bytes",
     "Bytes of the registrations made for one channel", true},
    {Counter::kRegistrations, CounterScope::kTask, "registrations",
     "Registrations made for this channel's peer alone", true},
    {Counter::kWaiterDrives, CounterScope::kTask, "waiter_drives",
     "Times a thread waiting for a recv took the transport's progress over (Task::Wait)", false},
    {Counter::kDroppedImmediates, CounterScope::kTask, "dropped_immediates",
     "Completions naming no live request (stale or duplicated)", false},
    {Counter::kChannelsFailed, CounterScope::kTask, "channels_failed",
     "Channels closed by an error", false},
    {Counter::kChecksumFailures, CounterScope::kTask, "checksum_failures",
     "Transfers whose checksum did not match", false},
    {Counter::kLivenessProbes, CounterScope::kTask, "liveness_probes",
     "Liveness probes sent to peers (a channel its peer wrote into since the last round needs "
     "none)",
     false},
    {Counter::kPendingRecvs, CounterScope::kTask, "pending_recvs",
     "Requests waiting on peers: recvs, reads and requests made ahead", true},
    {Counter::kResponsesPending, CounterScope::kTask, "responses_pending",
     "Requests of the peer this task is answering", true},
    {Counter::kChannels, CounterScope::kTask, "channels", "RDMA channels of this task", true},
    {Counter::kProxies, CounterScope::kTask, "proxies",
     "Recvs received through a registered proxy buffer", false},
    {Counter::kRecvErrorsByCode, CounterScope::kTask, "recv_errors_by_code",
     "Remote recvs that failed, by status code", false},
    {Counter::kTorchStagedCopies, CounterScope::kTorchGroup, "torch_staged_copies",
     "Copies of tensor bytes into the pool for sends", false},
    {Counter::kTorchStagedBytes, CounterScope::kTorchGroup, "torch_staged_bytes",
     "Bytes those copies moved", false},
    {Counter::kTorchLentSends, CounterScope::kTorchGroup, "torch_lent_sends",
     "Sends written from the caller's tensor itself, without a copy", false},
    {Counter::kTorchLentBytes, CounterScope::kTorchGroup, "torch_lent_bytes",
     "Bytes of those sends", false},
    {Counter::kTorchLandedCopies, CounterScope::kTorchGroup, "torch_landed_copies",
     "Copies out of landed messages into the caller's tensors", false},
    {Counter::kTorchLandedBytes, CounterScope::kTorchGroup, "torch_landed_bytes",
     "Bytes of those copies", false},
    {Counter::kTorchInPlaceRecvs, CounterScope::kTorchGroup, "torch_in_place_recvs",
     "Recvs the fabric wrote straight into the caller's tensor", false},
    {Counter::kTorchInPlaceBytes, CounterScope::kTorchGroup, "torch_in_place_bytes",
     "Bytes of those recvs", false},
    {Counter::kTorchCollectives, CounterScope::kTorchGroup, "torch_collectives", "Collectives run",
     false},
    {Counter::kTorchCollectivesOnCaller, CounterScope::kTorchGroup, "torch_collectives_on_caller",
     "Collectives run by the thread that waited for them (Work::wait)", false},
    {Counter::kTorchSameHostCollectives, CounterScope::kTorchGroup, "torch_same_host_collectives",
     "Collectives reduced through the ranks' shared memory (same_host.h)", false},
    {Counter::kTorchFailed, CounterScope::kTorchGroup, "torch_failed", "Operations that failed",
     false},
};
static_assert(sizeof(kCounters) / sizeof(kCounters[0]) == static_cast<size_t>(Counter::kCount),
              "one catalog entry per Counter");
// Each entry sits at its key's index, so a lookup by key is an index.
constexpr bool InEnumOrder() {
  for (size_t i = 0; i < sizeof(kCounters) / sizeof(kCounters[0]); ++i) {
    if (static_cast<size_t>(kCounters[i].key) != i) return false;
  }
  return true;
}
static_assert(InEnumOrder(), "the catalog's entries are in the order of enum Counter");

}  // namespace

absl::Span<const CounterInfo> CounterCatalog() { return kCounters; }

const CounterInfo& CounterInfoOf(Counter key) { return kCounters[static_cast<size_t>(key)]; }

const CounterInfo* FindCounter(absl::string_view name) {
  for (const CounterInfo& info : kCounters) {
    if (info.scope == CounterScope::kTask && info.name == name) return &info;
  }
  return nullptr;
}

void AddCounter(CounterList* out, Counter key, int64_t value) {
  out->emplace_back(std::string(CounterInfoOf(key).name), value);
}

}  // namespace tensorverbs
