// ReceivingSide: the receiving task's half of a channel (Channel::Role::kOwner). It owns what
// only a receiver has: the recvs' requests (RdmaTensorRequest) and grpc+gdr's reads (GdrPull)
// by request index, the names the peer knows keys by, the requests pushed ahead of their recv
// (TENSORVERBS_PUSH), and the grants for large destinations.
//
// The Channel it belongs to creates it and hands it what arrives for a receiver:
// META_DATA_RESPONSE and ERROR_STATUS (OnAnswer), content immediates (OnContent) and read
// completions (OnReadDone). The state machines call back into it to name a key, take or give
// back a large-destination allowance and finish their record. Everything else the requests
// need (sending messages, offering keys, closing) is the shared Channel's.
//
// Threading and lifetime: every method runs on the transport's progress thread. A finished
// request or pull leaves its table at once but is freed only at the end of the loop turn
// (Reap, which the Channel schedules), so no record is destroyed inside its own call, not even
// when a message it sends fails and closes the channel.
#ifndef TENSORVERBS_PROTOCOL_RECEIVING_SIDE_H_
#define TENSORVERBS_PROTOCOL_RECEIVING_SIDE_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "src/protocol/channel_env.h"
#include "src/protocol/copy_mode.h"
#include "src/protocol/gdr_pull.h"
#include "src/protocol/imm.h"
#include "src/protocol/message.h"
#include "src/protocol/push_ahead.h"
#include "src/protocol/remote_tensor.h"
#include "src/protocol/tensor_request.h"
#include "src/rendezvous/key_table.h"

namespace tensorverbs::protocol {

class Channel;

class ReceivingSide {
 public:
  explicit ReceivingSide(Channel* channel);
  ~ReceivingSide();
  ReceivingSide(const ReceivingSide&) = delete;
  ReceivingSide& operator=(const ReceivingSide&) = delete;

  Channel* channel() const { return channel_; }

  // Starts a recv (queued until the channel is ready); `landing`: RecvArgs' into and progress.
  void StartRecv(int64_t step_id, KeyRef key, Allocator* allocator, RecvLanding landing,
                 absl::Time deadline, RecvDoneCallback done);
  // grpc+gdr: reads the tensor `ref` names into `dest`, then releases it at the peer.
  void StartPull(const RemoteTensorRef& ref, Tensor dest, absl::Time deadline, GdrPull::Done done);
  // The channel became ready: starts what was queued meanwhile.
  void OnReady();
  // Fails the step's pending recvs.
  void AbortStep(int64_t step_id, const absl::Status& status);
  // Fails recvs and pulls past their deadline (with the reason that the channel never got
  // ready while it is connecting).
  void ExpireRequests(absl::Time now);

  // What the peer sends a receiver.
  void OnAnswer(const Message& m);  // META_DATA_RESPONSE or ERROR_STATUS
  void OnContent(uint32_t index, size_t lane = 0);  // a content immediate, over `lane`
  // A tensor spread over lanes that began to land and whose segments due on a further lane
  // have not all come, with nothing heard on that lane (Channel::LaneHeard) for `limit`: that
  // lane, else 0. Its writes were taken by the sender's kernel and are lost in a link that went
  // down under them, which the sender cannot see (its writes completed).
  size_t StalledLane(absl::Time now, absl::Duration limit);
  // Lane `lane` and those after it were taken out of the channel (Channel::TakeLanesOut): every
  // recv that was given a key for such a lane ends with `status`. Those whose content was
  // landing over them finish, and their destinations, which the lanes that stay may still
  // write, go to `*memory`; one that has seen nothing land keeps its record and destination
  // until its sender answers, as an ended recv does: the content over the lanes that stay, or
  // ERROR_STATUS once a write over a lane taken out failed there.
  void EndStripedOver(size_t lane, const absl::Status& status, std::vector<Tensor>* memory);
  void OnReadDone(uint32_t index);  // one of a pull's reads completed

  size_t pending_requests() const;
  // Records that hold an index (ended ones the peer may still write included).
  size_t held_indexes() const { return requests_.size() + pulls_.size(); }
  size_t CountRequests(RdmaTensorRequest::State state,
                       std::optional<RdmaTensorRequest::Owner> owner) const;
  size_t CountPulls(GdrPull::State state) const;
  bool awaiting_peer() const { return !requests_.empty() || !pulls_.empty(); }
  // Nothing a caller waits for: at most requests made ahead that no recv took.
  bool idle() const;

  // The channel closes with `status`: every recv and pull ends, landed pushed content goes to
  // the landed store (ChannelEnv::landed), and the memory the peer may still write is added to
  // `*memory`.
  void Close(const absl::Status& status, std::vector<Tensor>* memory);
  // Frees the records finished since the last call (end of the loop turn).
  void Reap();

  // For the state machines.
  // Names `key` in REQUEST `m`: by its index on this channel once the peer knows it, else by
  // the full key, defining the next index while there are indexes left.
  void NameKey(const KeyRef& key, Message* m);
  // Large destinations (ChannelEnv::large_in_flight): whether request `r` may name a
  // destination of `bytes` in its REQUEST (taking the channel's one allowance for that if the
  // destination is large).
  bool MayNameLargeDestination(RdmaTensorRequest& r, uint64_t bytes);
  // Whether `r`, whose sender holds its tensor, may name its destination now: true for small
  // ones, or with a grant taken; false queues it for GrantWaiting.
  bool GrantLargeDestination(RdmaTensorRequest& r);
  // Gives back what `r` holds (its destination will not be written, or it is finished).
  void ReleaseLargeSlot(RdmaTensorRequest& r);
  // Takes a finished request or pull out of its table and frees its index; the record itself
  // is freed at the end of the turn. `why` is the event that ends the request (its machine
  // moves to kDone on it unless it is there).
  void FinishRequest(uint32_t index, RdmaTensorRequest::Event why);
  void FinishPull(uint32_t index);
  // Copy mode: the receiver's pre-registered buffers by tensor name.
  CopyBuffers& copy_buffers() { return copy_buffers_; }

 private:
  bool closed() const;
  const std::string& peer_task() const;
  // After a recv of `key` at `step` completed in place: asks for step + 1 ahead, within the
  // channel's push budget, when no recv of the key is in flight.
  void Push(const KeyRef& key, int64_t step, Allocator* allocator);
  // The recv of (`key`, `step`) takes the pushed request if it is the one; true if it did (and
  // `done` is then the request's). A pushed request for another step stays for its own recv.
  bool AdoptPushed(PushAhead::KeyState* state, int64_t step, RecvDoneCallback& done,
                   bool quick_callback, absl::Time deadline, Allocator* allocator);
  // Finishes request `index`, whose recv completed, and pushes its key's next step if the recv
  // was written in place.
  void FinishDelivered(uint32_t index);
  // Takes pushed request `r` out of its key's slot and the budget (adopted or finished).
  void Unpush(RdmaTensorRequest& r);
  void IssuePull(uint32_t index);
  // Answers the queued requests whose recv ended (no destination needed) and grants the
  // others in order while grants are free. Sends messages, so it runs where a close cannot
  // empty a table from under a loop.
  void GrantWaiting();
  // ResourceExhausted when the channel holds max_pending_recvs recvs and reads.
  absl::Status CheckPendingBound(absl::string_view what) const;
  // Logs the slow-recv warning for `request` once it has waited past
  // env->transfer.slow_recv_warning.
  void WarnIfSlow(RdmaTensorRequest& request, absl::Time now);
  void Retire(std::unique_ptr<RdmaTensorRequest> r);

  Channel* const channel_;
  ChannelEnv* const env_;
  RequestIndexAllocator indexes_;
  absl::flat_hash_map<uint32_t, std::unique_ptr<RdmaTensorRequest>> requests_;
  // Requests spread over lanes whose content began to land and is not all in (StalledLane).
  absl::flat_hash_set<uint32_t> striping_;
  std::vector<uint32_t> queued_;  // started before the channel was ready
  absl::flat_hash_map<uint32_t, std::unique_ptr<GdrPull>> pulls_;  // grpc+gdr reads, by index
  std::vector<uint32_t> queued_pulls_;
  // Per key: its index (in the order first sent), recvs in flight, the pushed request; and the
  // budget of pushed requests.
  PushAhead push_;
  uint32_t next_name_index_ = 0;
  // Large destinations: named in a REQUEST (at most one), granted at META_DATA_RESPONSE (at
  // most large_in_flight), and the requests waiting for a grant, in order.
  int large_in_request_ = 0;
  int large_granted_ = 0;
  std::deque<uint32_t> large_waiting_;
  // Finished this turn, freed by Reap; and finished records kept for reuse.
  std::vector<std::unique_ptr<RdmaTensorRequest>> finished_requests_;
  std::vector<std::unique_ptr<RdmaTensorRequest>> reaping_;  // Reap's batch
  std::vector<std::unique_ptr<GdrPull>> finished_pulls_;
  std::vector<std::unique_ptr<RdmaTensorRequest>> spare_requests_;
  CopyBuffers copy_buffers_;
};

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_RECEIVING_SIDE_H_
