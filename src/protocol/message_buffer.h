// MessageBuffer: the control-message buffers of one channel (seed 000, "RDMA components").
//
// Each side owns a registered rx buffer of `rx_slots` slots the peer writes control messages
// into, and a tx buffer of as many slots as the peer's rx buffer has. A slot goes out as one
// RDMA write with immediate kImmControlMessage into the peer's next rx slot; the peer decodes
// the slot and answers with a zero-byte write whose immediate frees that slot and any others it
// decoded since its last ACK (AckImm). A tx slot is reusable when both its local write has
// completed (local idle) and the peer has acknowledged it (remote idle). Slots are used and
// acknowledged in ring order, which the fabric's in-order delivery of writes with immediate
// guarantees (fabric.h); every message carries a 16-bit sequence number and a message that
// arrives out of order is a channel error.
//
// Messages that find no free slot wait in a FIFO queue. When a slot frees up, it carries as
// many queued messages as fit, up to `max_batch` (the sender's choice; a receiver accepts any
// batch that fits a slot). A message that finds a free slot goes at once, alone, so batching
// never delays a message: it only forms while every slot is busy. With one slot and a batch of
// one this is exactly the seed's stop-and-wait buffer; with N slots N writes are in flight.
//
// Used only on the transport's progress thread; the endpoint and domain must outlive it.
#ifndef TENSORVERBS_PROTOCOL_MESSAGE_BUFFER_H_
#define TENSORVERBS_PROTOCOL_MESSAGE_BUFFER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/common/shared_memory.h"
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

// Counters a transport aggregates over its channels' message buffers (read from any thread).
struct MessageCounters {
  std::atomic<int64_t>* slots_written = nullptr;
  std::atomic<int64_t>* messages_written = nullptr;
};

class MessageBuffer {
 public:
  // Allocates and registers the rx buffer (`rx_slots` slots, remotely writable: by the peer of
  // `peer` alone when given, Domain::RegisterMemoryFor). `max_batch` (1 .. kMaxBatch): the most
  // messages this side writes into one slot.
  static absl::StatusOr<std::unique_ptr<MessageBuffer>> Create(fabric::Domain* domain, int rx_slots,
                                                               int max_batch = 1,
                                                               MessageCounters counters = {},
                                                               fabric::Endpoint* peer = nullptr);
  // Each message takes at least a 64-byte header, so no slot holds more.
  static constexpr int kMaxBatch = 128;
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

  // The local completion of a slot write (context tag kMessage, value the slot).
  absl::Status OnMessageWritten(uint64_t slot);
  // The peer acknowledged the `count` oldest unacknowledged slots. DataLoss if fewer are out.
  absl::Status OnAck(uint32_t count = 1);
  // A slot landed: decodes the next rx slot into `out` (cleared first; one message or a batch)
  // and checks each sequence. DataLoss for a malformed or out-of-order message (a channel
  // error); `out` then holds nothing.
  absl::Status OnControlMessage(std::vector<Message>* out);
  // Acknowledges, with one write, every slot decoded since the last call, which frees them for
  // the peer; nothing to acknowledge is not an error. The channel calls it once per turn, after
  // acting on the messages, so that the ACK write does not delay the answers (content writes)
  // the peer is waiting for.
  absl::Status Acknowledge();
  // Slots decoded and not yet acknowledged.
  uint64_t unacknowledged() const { return rx_received_ - rx_acked_; }

  // Messages queued or in slots not yet acknowledged.
  size_t pending() const { return queued() + (tx_sent_ - tx_acked_); }
  // Slots written / received, and messages sent / received, over the buffer's life.
  uint64_t sent() const { return tx_sent_; }
  uint64_t acknowledged() const { return tx_acked_; }
  // Slots whose write has completed here (the rest are still with the endpoint).
  uint64_t written() const { return tx_written_; }
  uint64_t received() const { return rx_received_; }
  uint64_t messages_sent() const { return tx_messages_; }
  // Times messages waited for a free slot (every slot of the peer busy, or this side's copy of
  // the slot still being written): a sign that message_slots is too small for the load.
  uint64_t slot_waits() const { return slot_waits_; }
  uint64_t messages_received() const { return rx_messages_; }

 private:
  // OnControlMessage's work, appending to `out`.
  absl::Status DecodeSlot(std::vector<Message>* out);
  MessageBuffer(fabric::Domain* domain, int rx_slots, int max_batch, MessageCounters counters);
  absl::Status Pump();

  fabric::Domain* const domain_;
  const int rx_slots_;
  const int max_batch_;
  const MessageCounters counters_;
  // rx_slots_ * kMessageSize bytes: in SharedMemory where the fabric maps peers' memory (so a
  // control message is one memcpy), else on the heap.
  std::unique_ptr<SharedMemory> rx_shared_;
  std::vector<uint8_t> rx_heap_;
  uint8_t* rx_memory_ = nullptr;
  size_t rx_bytes_ = 0;
  std::unique_ptr<fabric::MemoryRegion> rx_region_;
  std::vector<uint8_t> tx_memory_;  // remote_slots_ * kMessageSize
  std::unique_ptr<fabric::MemoryRegion> tx_region_;

  fabric::Endpoint* endpoint_ = nullptr;
  uint64_t remote_addr_ = 0;
  fabric::RemoteKey remote_key_;
  int remote_slots_ = 0;

  // Messages waiting for a slot: queue_[queue_head_, end). A vector that is cleared (keeping its
  // capacity) whenever it drains; a deque allocated a node for every two messages.
  std::vector<Message> queue_;
  size_t queue_head_ = 0;
  size_t queued() const { return queue_.size() - queue_head_; }
  void PopQueued(size_t count);
  std::vector<size_t> batch_sizes_;  // Pump's scratch: encoded sizes of the batch being written
  std::vector<bool> tx_local_busy_;  // per tx slot: the write has not completed locally
  uint64_t tx_sent_ = 0;             // slots written; slot = tx_sent_ % remote_slots_
  uint64_t tx_acked_ = 0;            // slots acknowledged by the peer
  uint64_t tx_written_ = 0;          // slots whose write completed locally
  uint64_t slot_waits_ = 0;
  bool waiting_for_slot_ = false;
  uint64_t tx_messages_ = 0;         // messages written (the next one's sequence)
  uint64_t rx_received_ = 0;         // slots decoded; slot = rx_received_ % rx_slots_
  uint64_t rx_acked_ = 0;            // slots acknowledged to the peer
  uint64_t rx_messages_ = 0;         // messages decoded (the next one's expected sequence)
};

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_MESSAGE_BUFFER_H_
