#include "src/protocol/message_buffer.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"
#include "src/protocol/imm.h"

namespace tensorverbs::protocol {
MessageBuffer::MessageBuffer(fabric::Domain* domain, int rx_slots, int max_batch,
                             MessageCounters counters)
    : domain_(domain), rx_slots_(rx_slots), max_batch_(max_batch), counters_(counters) {}

MessageBuffer::~MessageBuffer() = default;

absl::StatusOr<std::unique_ptr<MessageBuffer>> MessageBuffer::Create(fabric::Domain* domain,
                                                                     int rx_slots, int max_batch,
                                                                     MessageCounters counters,
                                                                     fabric::Endpoint* peer) {
  if (rx_slots < 1 || rx_slots > static_cast<int>(kMaxAckCount)) {
    return absl::InvalidArgumentError(
        absl::StrCat("message buffer with ", rx_slots, " slots; expected 1..", kMaxAckCount));
  }
  if (max_batch < 1 || max_batch > kMaxBatch) {
    return absl::InvalidArgumentError(
        absl::StrCat("message batch of ", max_batch, "; expected 1..", kMaxBatch));
  }
  auto mb =
      std::unique_ptr<MessageBuffer>(new MessageBuffer(domain, rx_slots, max_batch, counters));
  mb->rx_bytes_ = static_cast<size_t>(rx_slots) * kMessageSize;
  if (domain->capabilities().shared_memory) {
    ASSIGN_OR_RETURN(mb->rx_shared_, SharedMemory::Create(mb->rx_bytes_, "tensorverbs-messages"));
    mb->rx_memory_ = static_cast<uint8_t*>(mb->rx_shared_->data());  // zeroed by the kernel
  } else {
    mb->rx_heap_.assign(mb->rx_bytes_, 0);
    mb->rx_memory_ = mb->rx_heap_.data();
  }
  ASSIGN_OR_RETURN(mb->rx_region_,
                   peer != nullptr ? domain->RegisterMemoryFor(*peer, mb->rx_memory_, mb->rx_bytes_,
                                                               fabric::kAccessRemoteWrite)
                                   : domain->RegisterMemory(mb->rx_memory_, mb->rx_bytes_,
                                                            fabric::kAccessRemoteWrite));
  return mb;
}

uint64_t MessageBuffer::rx_addr() const { return reinterpret_cast<uint64_t>(rx_memory_); }
std::string MessageBuffer::rx_key() const { return rx_region_->PackRemoteKey().ToString(); }

absl::Status MessageBuffer::Connect(fabric::Endpoint* endpoint, uint64_t remote_addr,
                                    std::string remote_key, int remote_slots) {
  if (remote_slots < 1 || remote_slots > static_cast<int>(kMaxAckCount) || remote_addr == 0 ||
      remote_key.empty() || remote_key.size() > fabric::RemoteKey::kCapacity) {
    return absl::InvalidArgumentError(
        absl::StrCat("the peer described its message buffer as ", remote_slots, " slots at 0x",
                     absl::Hex(remote_addr), " with a ", remote_key.size(), "-byte key"));
  }
  endpoint_ = endpoint;
  remote_addr_ = remote_addr;
  remote_key_ = remote_key;
  remote_slots_ = remote_slots;
  tx_memory_.assign(static_cast<size_t>(remote_slots) * kMessageSize, 0);
  ASSIGN_OR_RETURN(tx_region_, domain_->RegisterMemory(tx_memory_.data(), tx_memory_.size(),
                                                       fabric::kAccessLocal));
  tx_local_busy_.assign(remote_slots, false);
  return absl::OkStatus();
}

fabric::RemoteBuffer MessageBuffer::EmptyRemoteTarget() const {
  return fabric::RemoteBuffer{remote_key_, remote_addr_, 0};
}

fabric::LocalBuffer MessageBuffer::EmptyLocalSource() const {
  return fabric::LocalBuffer{rx_region_.get(), rx_memory_, 0};
}

absl::Status MessageBuffer::Send(Message m) {
  m.sequence = static_cast<uint16_t>(tx_messages_ + queued());
  queue_.push_back(std::move(m));
  return Pump();
}

absl::Status MessageBuffer::Pump() {
  if (endpoint_ == nullptr) return absl::OkStatus();  // not connected yet: stay queued
  while (queued() > 0) {
    const uint64_t slot = tx_sent_ % static_cast<uint64_t>(remote_slots_);
    if (tx_sent_ - tx_acked_ >= static_cast<uint64_t>(remote_slots_) ||  // remote busy
        tx_local_busy_[slot]) {                                          // local busy
      if (!waiting_for_slot_) ++slot_waits_;  // once per wait, however often Pump runs
      waiting_for_slot_ = true;
      break;
    }
    waiting_for_slot_ = false;
    // As many queued messages as fit the slot, up to the batch limit; the first always fits.
    size_t length = 0;
    batch_sizes_.clear();
    while (batch_sizes_.size() < std::min(queued(), static_cast<size_t>(max_batch_))) {
      ASSIGN_OR_RETURN(const size_t size, EncodedSize(queue_[queue_head_ + batch_sizes_.size()]));
      if (length + size > kMessageSize) break;
      batch_sizes_.push_back(size);
      length += size;
    }
    const size_t count = batch_sizes_.size();
    uint8_t* out = tx_memory_.data() + slot * kMessageSize;
    size_t offset = 0;
    for (size_t i = 0; i < count; ++i) {
      RETURN_IF_ERROR(EncodeMessage(queue_[queue_head_ + i],
                                    absl::MakeSpan(out + offset, batch_sizes_[i]),
                                    static_cast<uint16_t>(count - 1 - i)));
      offset += batch_sizes_[i];
    }
    RETURN_IF_ERROR(endpoint_->PostWriteWithImm(
        fabric::LocalBuffer{tx_region_.get(), out, length},
        fabric::RemoteBuffer{remote_key_, remote_addr_ + slot * kMessageSize, kMessageSize},
        kImmControlMessage, MakeContext(OpTag::kMessage, slot)));
    tx_local_busy_[slot] = true;
    ++tx_sent_;
    tx_messages_ += count;
    if (counters_.slots_written != nullptr) {
      counters_.slots_written->fetch_add(1, std::memory_order_relaxed);
    }
    if (counters_.messages_written != nullptr) {
      counters_.messages_written->fetch_add(static_cast<int64_t>(count), std::memory_order_relaxed);
    }
    PopQueued(count);
  }
  return absl::OkStatus();
}

void MessageBuffer::PopQueued(size_t count) {
  queue_head_ += count;
  if (queue_head_ == queue_.size()) {
    queue_.clear();
    queue_head_ = 0;
  } else if (queue_head_ >= 64 && queue_head_ * 2 >= queue_.size()) {
    // A backlog that never drains: move the rest to the front now and then.
    queue_.erase(queue_.begin(), queue_.begin() + static_cast<ptrdiff_t>(queue_head_));
    queue_head_ = 0;
  }
}

absl::Status MessageBuffer::OnMessageWritten(uint64_t slot) {
  if (slot >= tx_local_busy_.size() || !tx_local_busy_[slot]) {
    return absl::InternalError(absl::StrCat("completion for idle message slot ", slot));
  }
  tx_local_busy_[slot] = false;
  ++tx_written_;
  return Pump();
}

absl::Status MessageBuffer::OnAck(uint32_t count) {
  if (count == 0 || count > tx_sent_ - tx_acked_) {
    return absl::DataLossError(absl::StrCat("the peer acknowledged ", count,
                                            " control-message slots; ", tx_sent_ - tx_acked_,
                                            " were waiting for an acknowledgement"));
  }
  tx_acked_ += count;
  return Pump();
}

absl::Status MessageBuffer::OnControlMessage(std::vector<Message>* out) {
  out->clear();
  absl::Status s = DecodeSlot(out);
  if (!s.ok()) out->clear();
  return s;
}

absl::Status MessageBuffer::DecodeSlot(std::vector<Message>* out) {
  const uint64_t slot = rx_received_ % static_cast<uint64_t>(rx_slots_);
  uint8_t* in = rx_memory_ + slot * kMessageSize;
  // Decoded straight into the caller's vector, whose capacity a steady channel reuses.
  std::vector<Message>& batch = *out;
  size_t offset = 0;
  uint16_t more = 0;  // of the message just decoded: how many follow it in the slot
  do {
    if (offset >= kMessageSize) {
      return absl::DataLossError(absl::StrCat("a batch announces ", more,
                                              " more control messages past the end of its slot"));
    }
    const absl::Span<const uint8_t> rest = absl::MakeConstSpan(in + offset, kMessageSize - offset);
    const bool first = batch.empty();
    const uint16_t announced = first ? 0 : more - 1;
    absl::StatusOr<Message> m = DecodeMessage(rest, &more);
    if (!m.ok()) {
      if (first) return m.status();
      return absl::DataLossError(
          absl::StrCat("message ", batch.size() + 1, " of a batch: ", m.status().message()));
    }
    const auto expected = static_cast<uint16_t>(rx_messages_ + batch.size());
    if (m->sequence != expected) {
      return absl::DataLossError(absl::StrCat(
          "control message ", m->sequence, " arrived where ", expected,
          " was expected: the fabric delivered writes out of order or the peer wrote a busy "
          "slot"));
    }
    if (!first && more != announced) {
      return absl::DataLossError(absl::StrCat("a batched control message says ", more,
                                              " follow it where ", announced, " were announced"));
    }
    offset += EncodedLength(rest);
    batch.push_back(*std::move(m));
  } while (more > 0);
  // Zero what was used so a stale message can never be decoded again.
  std::memset(in, 0, offset);
  rx_messages_ += batch.size();
  ++rx_received_;
  return absl::OkStatus();
}

absl::Status MessageBuffer::Acknowledge() {
  if (endpoint_ == nullptr) return absl::FailedPreconditionError("message buffer not connected");
  const uint64_t count = rx_received_ - rx_acked_;
  if (count == 0) return absl::OkStatus();
  RETURN_IF_ERROR(endpoint_->PostWriteWithImm(EmptyLocalSource(), EmptyRemoteTarget(),
                                              AckImm(static_cast<uint32_t>(count)),
                                              MakeContext(OpTag::kAck, 0)));
  rx_acked_ = rx_received_;
  return absl::OkStatus();
}

}  // namespace tensorverbs::protocol
