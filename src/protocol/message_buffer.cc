#include "src/protocol/message_buffer.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"
#include "src/protocol/imm.h"

namespace tensorverbs::protocol {
MessageBuffer::MessageBuffer(fabric::Domain* domain, int rx_slots)
    : domain_(domain), rx_slots_(rx_slots) {}

MessageBuffer::~MessageBuffer() = default;

absl::StatusOr<std::unique_ptr<MessageBuffer>> MessageBuffer::Create(fabric::Domain* domain,
                                                                     int rx_slots) {
  if (rx_slots < 1 || rx_slots > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("message buffer with ", rx_slots, " slots; expected 1..1024"));
  }
  auto mb = std::unique_ptr<MessageBuffer>(new MessageBuffer(domain, rx_slots));
  mb->rx_memory_.assign(static_cast<size_t>(rx_slots) * kMessageSize, 0);
  ASSIGN_OR_RETURN(mb->rx_region_,
                   domain->RegisterMemory(mb->rx_memory_.data(), mb->rx_memory_.size(),
                                          fabric::kAccessRemoteWrite));
  return mb;
}

uint64_t MessageBuffer::rx_addr() const { return reinterpret_cast<uint64_t>(rx_memory_.data()); }
std::string MessageBuffer::rx_key() const { return rx_region_->PackRemoteKey(); }

absl::Status MessageBuffer::Connect(fabric::Endpoint* endpoint, uint64_t remote_addr,
                                    std::string remote_key, int remote_slots) {
  if (remote_slots < 1 || remote_slots > 1024 || remote_addr == 0 || remote_key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the peer described its message buffer as ", remote_slots, " slots at 0x", absl::Hex(remote_addr),
        " with a ", remote_key.size(), "-byte key"));
  }
  endpoint_ = endpoint;
  remote_addr_ = remote_addr;
  remote_key_ = std::move(remote_key);
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
  return fabric::LocalBuffer{rx_region_.get(), const_cast<uint8_t*>(rx_memory_.data()), 0};
}

absl::Status MessageBuffer::Send(Message m) {
  m.sequence = static_cast<uint16_t>(tx_sent_ + queue_.size());
  queue_.push_back(std::move(m));
  return Pump();
}

absl::Status MessageBuffer::Pump() {
  if (endpoint_ == nullptr) return absl::OkStatus();  // not connected yet: stay queued
  while (!queue_.empty()) {
    const uint64_t slot = tx_sent_ % static_cast<uint64_t>(remote_slots_);
    if (tx_sent_ - tx_acked_ >= static_cast<uint64_t>(remote_slots_)) break;  // remote busy
    if (tx_local_busy_[slot]) break;                                           // local busy
    uint8_t* out = tx_memory_.data() + slot * kMessageSize;
    RETURN_IF_ERROR(EncodeMessage(queue_.front(), absl::MakeSpan(out, kMessageSize)));
    const size_t length = EncodedLength(absl::MakeConstSpan(out, kMessageSize));
    RETURN_IF_ERROR(endpoint_->PostWriteWithImm(
        fabric::LocalBuffer{tx_region_.get(), out, length},
        fabric::RemoteBuffer{remote_key_, remote_addr_ + slot * kMessageSize, kMessageSize},
        kImmControlMessage, MakeContext(OpTag::kMessage, slot)));
    tx_local_busy_[slot] = true;
    ++tx_sent_;
    queue_.pop_front();
  }
  return absl::OkStatus();
}

absl::Status MessageBuffer::OnMessageWritten(uint64_t slot) {
  if (slot >= tx_local_busy_.size() || !tx_local_busy_[slot]) {
    return absl::InternalError(absl::StrCat("completion for idle message slot ", slot));
  }
  tx_local_busy_[slot] = false;
  return Pump();
}

absl::Status MessageBuffer::OnAck() {
  if (tx_acked_ == tx_sent_) {
    return absl::DataLossError("the peer acknowledged a control message that was never sent");
  }
  ++tx_acked_;
  return Pump();
}

absl::StatusOr<Message> MessageBuffer::OnControlMessage() {
  const uint64_t slot = rx_received_ % static_cast<uint64_t>(rx_slots_);
  uint8_t* in = rx_memory_.data() + slot * kMessageSize;
  absl::StatusOr<Message> m = DecodeMessage(absl::MakeConstSpan(in, kMessageSize));
  const size_t length = EncodedLength(absl::MakeConstSpan(in, kMessageSize));
  if (!m.ok()) return m.status();
  if (m->sequence != static_cast<uint16_t>(rx_received_)) {
    return absl::DataLossError(absl::StrCat(
        "control message ", m->sequence, " arrived where ", static_cast<uint16_t>(rx_received_),
        " was expected: the fabric delivered writes out of order or the peer wrote a busy slot"));
  }
  // Zero what was used so a stale message can never be decoded again.
  std::memset(in, 0, length);
  ++rx_received_;
  return m;
}

absl::Status MessageBuffer::Acknowledge() {
  if (endpoint_ == nullptr) return absl::FailedPreconditionError("message buffer not connected");
  if (rx_acked_ == rx_received_) {
    return absl::InternalError("acknowledging a control message that was not received");
  }
  RETURN_IF_ERROR(endpoint_->PostWriteWithImm(EmptyLocalSource(), EmptyRemoteTarget(), kImmAck,
                                              MakeContext(OpTag::kAck, 0)));
  ++rx_acked_;
  return absl::OkStatus();
}

}  // namespace tensorverbs::protocol
