// LocalTensorInbox: how the tensors a sender's own task sends reach the grpc+verbs responses
// waiting for them on the progress thread.
//
// A response (RdmaTensorResponse, sender side) asks the step's rendezvous for its tensor with a
// callback that may run on any thread: the user's Send, a cancel, an abort. That callback only
// records the outcome here under a ticket, and the progress thread later hands it to the
// response's side (ChannelTable::FindSending, SendingSide::OnLocalTensor), which checks that the
// response still waits. The
// callback holds this inbox and the ticket, 16 bytes that AnyInvocable stores inline, so a
// response costs no heap allocation for it (closures carrying the channel's id, serial and
// index did).
//
// Threading: Open and the draining run on the progress thread (the channels' owner); the
// callbacks run anywhere. Each ticket's callback runs exactly once (the rendezvous guarantees
// it), and its outcome is delivered at most once: not at all if the channel is gone or the
// engine stopped. Owned by the transport, which outlives every rendezvous callback.
#ifndef TENSORVERBS_PROTOCOL_LOCAL_TENSOR_INBOX_H_
#define TENSORVERBS_PROTOCOL_LOCAL_TENSOR_INBOX_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "src/protocol/inbox.h"
#include "src/rendezvous/local_rendezvous.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::protocol {

struct ChannelEnv;

class LocalTensorInbox {
 public:
  // `env`'s host (Post) and channel table (Find) carry the outcomes to the channels.
  explicit LocalTensorInbox(ChannelEnv* env) : env_(env) {}
  LocalTensorInbox(const LocalTensorInbox&) = delete;
  LocalTensorInbox& operator=(const LocalTensorInbox&) = delete;

  // Progress thread: the rendezvous callback for the response `serial` to request `index` on
  // channel `channel_id`.
  RecvDoneCallback Open(uint64_t channel_id, uint32_t index, uint64_t serial);

  // Tickets opened whose outcome has not been handed on yet (progress thread).
  size_t open_tickets() const { return waiting_.size(); }

 private:
  struct Waiting {
    uint64_t channel_id;
    uint64_t serial;
    uint32_t index;
  };
  struct Arrival {
    uint64_t ticket;
    absl::Status status;
    Tensor tensor;
    bool is_dead;
  };

  // Any thread: records an outcome, and posts the drain when it is the first pending one.
  void Arrive(uint64_t ticket, const absl::Status& status, const Tensor& tensor, bool is_dead);
  // Progress thread: hands every recorded outcome to its channel.
  void Drain();

  ChannelEnv* const env_;
  // Progress thread.
  uint64_t next_ticket_ = 1;
  absl::flat_hash_map<uint64_t, Waiting> waiting_;
  Inbox<Arrival> arrivals_;
};

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_LOCAL_TENSOR_INBOX_H_
