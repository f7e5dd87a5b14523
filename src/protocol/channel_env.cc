#include "src/protocol/channel_env.h"

#include "absl/strings/str_format.h"
#include "src/common/checksum.h"

namespace tensorverbs::protocol {

const char* VerbsModeProtocol(VerbsMode mode) {
  switch (mode) {
    case VerbsMode::kZeroCopy:
      return "grpc+verbs";
    case VerbsMode::kCopy:
      return "grpc+verbs-copy";
    case VerbsMode::kGdr:
      return "grpc+gdr";
  }
  return "?";
}

uint32_t RemoteAccessFor(VerbsMode mode) {
  return mode == VerbsMode::kGdr ? fabric::kAccessRemoteRead : fabric::kAccessRemoteWrite;
}

void VerbsStats::AppendCounters(CounterList* out) const {
  AddCounter(out, Counter::kRequests, requests);
  AddCounter(out, Counter::kMetaCacheHits, meta_cache_hits);
  AddCounter(out, Counter::kPushedRequests, pushed);
  AddCounter(out, Counter::kPushHits, push_hits);
  AddCounter(out, Counter::kMetaResponses, meta_responses);
  AddCounter(out, Counter::kReRequests, re_requests);
  AddCounter(out, Counter::kErrorsSent, errors_sent);
  AddCounter(out, Counter::kControlMessages, control_messages);
  AddCounter(out, Counter::kControlSlots, control_slots);
  AddCounter(out, Counter::kTensorsSent, content_writes);
  AddCounter(out, Counter::kBytesSent, content_bytes);
  AddCounter(out, Counter::kTransientRegistrations, transient_registrations);
  AddCounter(out, Counter::kInPlaceRecvs, in_place_recvs);
  AddCounter(out, Counter::kContentSegments, content_segments);
  AddCounter(out, Counter::kStripedRequests, striped_requests);
  AddCounter(out, Counter::kLanesTakenOut, lanes_taken_out);
  AddCounter(out, Counter::kChannelsRenewedForLanes, channels_renewed_for_lanes);
  AddCounter(out, Counter::kDroppedImmediates, dropped_imms);
  AddCounter(out, Counter::kChannelsFailed, channel_errors);
  AddCounter(out, Counter::kChecksumFailures, checksum_failures);
  AddCounter(out, Counter::kLivenessProbes, liveness_probes);
}

uint64_t ContentChecksum(const void* data, uint64_t bytes) {
  return bytes == 0 ? 0 : Crc32c(data, bytes);
}

absl::StatusOr<const fabric::MemoryRegion*> ChannelEnv::TransferRegion(
    const void* data, uint64_t bytes, std::unique_ptr<fabric::MemoryRegion>* transient) const {
  switch (options.registration) {
    case Registration::kPool:
      return memory->FindRegistered(data, bytes);
    case Registration::kPerTransfer: {
      // A buffer the fabric refuses to register still moves, through a registered proxy.
      absl::StatusOr<std::unique_ptr<fabric::MemoryRegion>> mr =
          memory->RegisterTransient(const_cast<void*>(data), bytes);
      if (!mr.ok()) return nullptr;
      *transient = *std::move(mr);
      stats->transient_registrations.fetch_add(1, std::memory_order_relaxed);
      return transient->get();
    }
    case Registration::kCopy:
      return nullptr;
  }
  return nullptr;
}

absl::Status ChannelEnv::VerifyChecksum(const std::string& key, const std::string& peer_task,
                                        const void* data, uint64_t bytes, uint64_t expected) const {
  const uint64_t sum = ContentChecksum(data, bytes);
  if (sum == expected) return absl::OkStatus();
  stats->checksum_failures.fetch_add(1, std::memory_order_relaxed);
  return absl::DataLossError(absl::StrFormat(
      "recv of '%s' from task %s: checksum mismatch (sent %08x, received %08x) over %d bytes: "
      "the data was corrupted in transit",
      key, peer_task, expected, sum, bytes));
}

}  // namespace tensorverbs::protocol
