// SendingSide: the sending task's half of a channel (Channel::Role::kAcceptor). It owns what
// only a sender has: one RdmaTensorResponse per REQUEST by request index, the keys the peer
// asked for (parsed and checked once, and the names it defined by index), the set of expired
// responses whose RE_REQUEST may still come, and copy mode's transmit buffers.
//
// The Channel it belongs to creates it and hands it what arrives for a sender: REQUEST
// (OnRequest), RE_REQUEST (OnReRequest), content write completions (OnWriteDone) and the local
// tensors the rendezvous produced (OnLocalTensor). grpc+gdr's releases of lent tensors arrive
// as content immediates on this side too (OnLentReleased). The responses call back into it
// only to finish their record; sending messages, writes and closing are the shared Channel's.
//
// Threading and lifetime: every method runs on the transport's progress thread. A finished
// response leaves its table at once but is freed only at the end of the loop turn (Reap, which
// the Channel schedules), so no response is destroyed inside its own call.
#ifndef TENSORVERBS_PROTOCOL_SENDING_SIDE_H_
#define TENSORVERBS_PROTOCOL_SENDING_SIDE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/common/recurrence_filter.h"
#include "src/protocol/channel_env.h"
#include "src/protocol/copy_mode.h"
#include "src/protocol/message.h"
#include "src/protocol/tensor_response.h"
#include "src/rendezvous/key_table.h"

namespace tensorverbs::protocol {

class Channel;

class SendingSide {
 public:
  explicit SendingSide(Channel* channel);
  ~SendingSide();
  SendingSide(const SendingSide&) = delete;
  SendingSide& operator=(const SendingSide&) = delete;

  Channel* channel() const { return channel_; }

  // What the peer sends a sender.
  void OnRequest(Message& m);          // REQUEST (moved into its response)
  void OnReRequest(const Message& m);  // RE_REQUEST
  // One of a response's content writes completed: its index and the low bits of its serial.
  void OnWriteDone(uint32_t index, uint32_t serial_bits);
  // One of them failed over a lane taken out of the channel, as `status` says.
  void OnWriteFailed(uint32_t index, uint32_t serial_bits, const absl::Status& status);
  // grpc+gdr: the peer released the tensor it read under `tensor_key`.
  void OnLentReleased(uint32_t tensor_key);
  // A local tensor for response `serial` is ready.
  void OnLocalTensor(uint64_t serial, uint32_t index, const absl::Status& status,
                     const Tensor& tensor, bool is_dead);
  // More of response `serial`'s device tensor is staged in host memory (or its staging failed).
  void OnStaged(uint64_t serial, uint32_t index, const absl::Status& status, uint64_t staged_bytes);
  // Ends the responses whose receiver has not asked for the content within
  // env->response_timeout() of their META_DATA_RESPONSE (a faulty receiver would otherwise pin
  // their tensors for the channel's life): ERROR_STATUS, and a late RE_REQUEST is ignored.
  void ExpireResponses(absl::Time now);

  // Responses that hold their tensor and are still sending it.
  size_t responses_in_progress() const;
  size_t responses() const { return responses_.size(); }
  size_t CountResponses(RdmaTensorResponse::State state) const;
  // Whether this end holds anything for its peer (responses, copy buffers).
  bool holds_state_for_peer() const { return !responses_.empty() || !copy_buffers_.empty(); }

  // The channel closes: every response stops waiting for its tensor. The records (which hold
  // the tensors a write in flight reads) are freed at the end of the turn, after the endpoint.
  void Close();
  // Frees the records finished since the last call (end of the loop turn).
  void Reap();

  // For the state machines: takes a finished response out of the table; the record is freed
  // at the end of the turn.
  void FinishResponse(uint32_t index);
  // Copy mode: the sender's pre-registered buffers by tensor name.
  CopyBuffers& copy_buffers() { return copy_buffers_; }

 private:
  static constexpr size_t kMaxCachedKeys = 65536;

  bool closed() const;
  // Response `index` answers with ERROR_STATUS while the receiver's RE_REQUEST may be on its
  // way: that RE_REQUEST is dropped, not taken for a protocol error.
  void ExpectLateReRequest(uint32_t index);
  const std::string& peer_task() const;
  // The key REQUEST `m` names, by name or index (defining the index if it does), or why it
  // names none this task serves. A REQUEST that breaks the indexing rules (an index never
  // defined, a definition out of order) closes the channel.
  absl::StatusOr<KeyRef> RequestedKey(const Message& m);
  // `name` parsed and checked to name a tensor of this task's incarnation.
  absl::StatusOr<KeyRef> ValidKey(const std::string& name);

  Channel* const channel_;
  ChannelEnv* const env_;
  absl::flat_hash_map<uint32_t, std::unique_ptr<RdmaTensorResponse>> responses_;
  // Indexes of expired responses whose RE_REQUEST may still be on its way (it crossed the
  // ERROR_STATUS); forgotten at that RE_REQUEST or the index's next REQUEST.
  absl::flat_hash_set<uint32_t> expired_responses_;
  // Finished this turn, freed by Reap; and finished records kept for reuse.
  std::vector<std::unique_ptr<RdmaTensorResponse>> finished_;
  std::vector<std::unique_ptr<RdmaTensorResponse>> reaping_;  // Reap's batch
  std::vector<std::unique_ptr<RdmaTensorResponse>> spares_;
  uint64_t next_serial_ = 1;
  absl::flat_hash_map<std::string, KeyRef> valid_keys_;
  // What may enter valid_keys_. Small: keys asked for by name more than once are those past
  // the receiver's indexed keys (PushAhead::kMaxKeys), rare.
  RecurrenceFilter seen_names_{8192};
  // By the index the owner defined: the key, or why it is not one this task serves.
  std::vector<absl::StatusOr<KeyRef>> indexed_keys_;
  CopyBuffers copy_buffers_;
};

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_SENDING_SIDE_H_
