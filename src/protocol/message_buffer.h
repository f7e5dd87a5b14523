// MessageBuffer: the control-message buffers of one channel (seed 000, "RDMA components").
//
// Each side owns a registered rx buffer of `rx_slots` slots the peer writes control messages
// into, and a tx buffer of as many slots as the peer's rx buffer has. A message goes out as one
// RDMA write with immediate kImmControlMessage into the peer's next rx slot; the peer decodes
// the slot and answers with a zero-byte write with immediate kImmAck, which frees the slot.
// A tx slot is reusable when both its local write has completed (local idle) and the peer has
// acknowledged it (remote idle). With one slot this is exactly the seed's stop-and-wait buffer;
// with N slots N messages are in flight. Slots are used and acknowledged in ring order, which
// the fabric's in-order delivery of writes with immediate guarantees (fabric.h); every message
// carries a 16-bit sequence number and a message that arrives out of order is a channel error.
//
// Messages that find no free slot wait in a FIFO queue. Used only on the transport's progress
// thread; the endpoint and domain must outlive it.
#ifndef TENSORVERBS_PROTOCOL_MESSAGE_BUFFER_H_
#define TENSORVERBS_PROTOCOL_MESSAGE_BUFFER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/fabric/fabric.h"
#include "src/protocol/message.h"

namespace tensorverbs::protocol {

// Completion contexts of a channel's operations: the tag in the top byte, a value below.
enum class OpTag : uint8_t { kMessage = 1, kAck = 2, kContent = 3, kRead = 4 };
inline uint64_t MakeContext(OpTag tag, uint64_t value) {
  return (static_cast<uint64_t>(tag) << 56) | (value & ((uint64_t{1} << 56) - 1));
}
inline OpTag ContextTag(uint64_t context) { return static_cast<OpTag>(context >> 56); }
inline uint64_t ContextValue(uint64_t context) { return context & ((uint64_t{1} << 56) - 1); }

class MessageBuffer {
 public:
  // Allocates and registers the rx buffer (`rx_slots` slots, remotely writable).
  static absl::StatusOr<std::unique_ptr<MessageBuffer>> Create(fabric::Domain* domain,
                                                               int rx_slots);
  MessageBuffer(const MessageBuffer&) = delete;
  MessageBuffer& operator=(const MessageBuffer&) = delete;
  ~MessageBuffer();

  // What the peer needs to write into this side's rx slots.
  uint64_t rx_addr() const;
  std::string rx_key() const;
  int rx_slots() const { return rx_slots_; }

  // Binds the buffer to a connected endpoint and the peer's rx slots; allocates and registers
  // the tx slots. InvalidArgument for a nonsensical peer description.
  absl::Status Connect(fabric::Endpoint* endpoint, uint64_t remote_addr, std::string remote_key,
                       int remote_slots);

  // A zero-length target in the peer's rx buffer: where content writes of no bytes go.
  fabric::RemoteBuffer EmptyRemoteTarget() const;
  // A zero-length local source in a registered region.
  fabric::LocalBuffer EmptyLocalSource() const;

  // Queues `m` and sends as many queued messages as free slots allow. `m.sequence` is set
  // here. An error is a channel error (the endpoint refused a post).
  absl::Status Send(Message m);

  // The local completion of a message write (context tag kMessage, value the slot).
  absl::Status OnMessageWritten(uint64_t slot);
  // The peer acknowledged the oldest unacknowledged message.
  absl::Status OnAck();
  // A control message landed: decodes the next rx slot and checks its sequence. DataLoss for a
  // malformed or out-of-order message (a channel error).
  absl::StatusOr<Message> OnControlMessage();
  // Acknowledges the oldest decoded message, which frees its slot for the peer. The channel
  // calls it after acting on the message, so that the ACK write does not delay the answer
  // (a content write) that the peer is waiting for.
  absl::Status Acknowledge();

  // Messages queued or not yet acknowledged.
  size_t pending() const { return queue_.size() + (tx_sent_ - tx_acked_); }
  // Messages sent / received over the buffer's life.
  uint64_t sent() const { return tx_sent_; }
  uint64_t received() const { return rx_received_; }

 private:
  MessageBuffer(fabric::Domain* domain, int rx_slots);
  absl::Status Pump();

  fabric::Domain* const domain_;
  const int rx_slots_;
  std::vector<uint8_t> rx_memory_;  // rx_slots_ * kMessageSize
  std::unique_ptr<fabric::MemoryRegion> rx_region_;
  std::vector<uint8_t> tx_memory_;  // remote_slots_ * kMessageSize
  std::unique_ptr<fabric::MemoryRegion> tx_region_;

  fabric::Endpoint* endpoint_ = nullptr;
  uint64_t remote_addr_ = 0;
  std::string remote_key_;
  int remote_slots_ = 0;

  std::deque<Message> queue_;
  std::vector<bool> tx_local_busy_;  // per tx slot: the write has not completed locally
  uint64_t tx_sent_ = 0;             // messages written; slot = tx_sent_ % remote_slots_
  uint64_t tx_acked_ = 0;            // acknowledged by the peer
  uint64_t rx_received_ = 0;         // slot = rx_received_ % rx_slots_
  uint64_t rx_acked_ = 0;            // acknowledged to the peer
};

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_MESSAGE_BUFFER_H_
