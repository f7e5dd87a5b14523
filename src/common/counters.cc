#include "src/common/counters.h"

namespace tensorverbs {

absl::Span<const CounterInfo> CounterCatalog() {
  static constexpr CounterInfo kCounters[] = {
      // Every protocol: TransferStats and the receive pool.
      {"tensors_received", "Remote recvs completed OK", false},
      {"bytes_received", "Element bytes of the tensors received", false},
      {"recv_errors", "Remote recvs that failed", false},
      {"copies", "Copies of tensor bytes this task made (zero-copy paths make none)", false},
      {"copied_bytes", "Bytes those copies moved", false},
      {"device_to_host_copies", "Device tensors copied to host memory to be sent", false},
      {"host_to_device_copies", "Recvs into device memory copied from a host proxy", false},
      {"device_copied_bytes", "Bytes those device copies moved", false},
      {"device_copy_errors", "Copies between host and device memory that failed", false},
      {"device_direct_sends", "Device tensors sent from GPU memory with no host copy", false},
      {"device_direct_recvs", "Device tensors received into GPU memory with no host copy", false},
      {"pool_regions", "Regions of the registered receive pool", true},
      {"pool_bytes", "Bytes of the registered receive pool", true},
      {"pool_bytes_in_use", "Bytes of the pool held by live tensors", true},
      {"pool_allocations", "Live tensors in the pool", true},
      // The verbs protocols: protocol::VerbsStats, registrations, channels.
      {"requests", "REQUEST messages sent", false},
      {"meta_cache_hits", "REQUESTs that carried cached meta-data", false},
      {"pushed_requests", "REQUESTs made ahead for a key's next step", false},
      {"push_hits", "Recvs that found their request already made", false},
      {"meta_responses", "META_DATA_RESPONSE messages sent", false},
      {"re_requests", "RE_REQUEST messages sent", false},
      {"errors_sent", "ERROR_STATUS messages sent", false},
      {"control_messages", "Control messages written", false},
      {"control_slots", "Message-slot writes carrying them", false},
      {"slot_waits", "Times control messages waited for a free slot of the peer", false},
      {"tensors_sent", "Tensor contents written to peers", false},
      {"bytes_sent", "Bytes of tensor contents written to peers", false},
      {"transient_registrations", "Memory registered for one transfer", false},
      {"in_place_recvs", "Recvs whose destination was memory their caller gave (into)", false},
      {"content_segments",
       "Content segments that landed before their tensor's last (a recv told of its progress)",
       false},
      {"registered_regions", "Pool regions registered with the fabric", true},
      {"registered_bytes", "Bytes of the pool regions registered with the fabric", true},
      {"channel_registrations",
       "Registrations made for one channel's peer alone (per-channel keys)", true},
      {"channel_registered_bytes", "Bytes of the registrations made for one channel", true},
      {"registrations", "Registrations made for this channel's peer alone", true},
      {"waiter_drives",
       "Times a thread waiting for a recv took the transport's progress over (Task::Wait)", false},
      {"dropped_immediates", "Completions naming no live request (stale or duplicated)", false},
      {"channels_failed", "Channels closed by an error", false},
      {"checksum_failures", "Transfers whose checksum did not match", false},
      {"pending_recvs", "Requests waiting on peers: recvs, reads and requests made ahead", true},
      {"responses_pending", "Requests of the peer this task is answering", true},
      {"channels", "RDMA channels of this task", true},
      {"proxies", "Recvs received through a registered proxy buffer", false},
      {"recv_errors_by_code", "Remote recvs that failed, by status code", false},
  };
  return kCounters;
}

const CounterInfo* FindCounter(absl::string_view name) {
  for (const CounterInfo& info : CounterCatalog()) {
    if (info.name == name) return &info;
  }
  return nullptr;
}

}  // namespace tensorverbs
