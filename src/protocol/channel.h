// Channel: the RDMA connection that carries one task's recvs from one peer task, with the
// seed's two state machines on it.
//
// The receiving task owns the channel (Role::kOwner): it set it up by calling the peer's
// VerbsService.Connect, and runs one RdmaTensorRequest per recv. The peer holds the other end
// (Role::kAcceptor) and runs one RdmaTensorResponse per request. A pair of tasks that receive
// from each other therefore has two channels, one per direction of tensor flow; the seed's
// single bidirectional channel needed a symmetric handshake that races when both tasks connect
// at once, and this way each side of a channel has one job.
//
//   RdmaTensorRequest (owner):   Start -> [REQUEST] -> kRequested
//                                  kRequested  --META_DATA_RESPONSE--> [RE_REQUEST] kReRequested
//                                  kRequested / kReRequested --content imm--> RecvTensorContent
//                                  any --ERROR_STATUS / failure--> done(error)
//   RdmaTensorResponse (acceptor): Start (local recv) -> Resume(tensor)
//                                  meta matches the request's -> write content -> Destroy
//                                  else [META_DATA_RESPONSE] -> kWaitReRequest
//                                  --RE_REQUEST--> write content -> Destroy
//
// The state machines live in tensor_request.h and tensor_response.h, grpc+gdr's reads in
// gdr_pull.h, and what copy mode does differently in copy_mode.h; the channel owns them by
// request index, runs the control-message buffer, dispatches completions and messages to them,
// and fails and quarantines everything when it closes.
//
// Everything here runs on the transport's progress thread (the owner thread of ChannelEnv;
// each public method DCHECKs it). A request's `done` runs exactly once on the worker's callback
// executor. A request that ends before its content arrives (abort, timeout) keeps its index and
// destination memory until the sender answers or the channel closes, so late content never
// lands in freed memory.
#ifndef TENSORVERBS_PROTOCOL_CHANNEL_H_
#define TENSORVERBS_PROTOCOL_CHANNEL_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "src/fabric/fabric.h"
#include "src/protocol/channel_env.h"
#include "src/protocol/copy_mode.h"
#include "src/protocol/gdr_pull.h"
#include "src/protocol/imm.h"
#include "src/protocol/message_buffer.h"
#include "src/protocol/remote_tensor.h"
#include "src/protocol/tensor_request.h"
#include "src/protocol/tensor_response.h"
#include "tensorverbs/parsed_key.h"

namespace tensorverbs::protocol {

// What one channel carried since it opened, for `tensorverbs stats` and metrics. Written on the
// progress thread, readable from any thread.
struct ChannelCounters {
  // Owner side.
  std::atomic<int64_t> tensors_received{0};  // recvs completed OK over this channel
  std::atomic<int64_t> bytes_received{0};
  std::atomic<int64_t> recv_errors{0};  // recvs that failed, all codes
  std::atomic<int64_t> requests{0};     // REQUEST messages sent
  std::atomic<int64_t> re_requests{0};  // RE_REQUEST messages sent
  // Destinations that were a registered proxy (strings, copy mode, memory the fabric cannot
  // reach), so the content was copied once more on arrival.
  std::atomic<int64_t> proxies{0};
  // Acceptor side.
  std::atomic<int64_t> tensors_sent{0};  // content transfers completed
  std::atomic<int64_t> bytes_sent{0};
  std::atomic<int64_t> meta_responses{0};  // META_DATA_RESPONSE messages sent
  std::atomic<int64_t> errors_sent{0};     // ERROR_STATUS messages sent
  // Failed recvs by absl::StatusCode.
  static constexpr int kCodes = 17;
  std::atomic<int64_t> recv_errors_by_code[kCodes] = {};

  void CountRecv(const absl::Status& status, const Tensor& tensor) {
    if (status.ok()) {
      tensors_received.fetch_add(1, std::memory_order_relaxed);
      bytes_received.fetch_add(static_cast<int64_t>(tensor.TotalBytes()),
                               std::memory_order_relaxed);
      return;
    }
    recv_errors.fetch_add(1, std::memory_order_relaxed);
    const int code = static_cast<int>(status.code());
    if (code >= 0 && code < kCodes) {
      recv_errors_by_code[code].fetch_add(1, std::memory_order_relaxed);
    }
  }
};

// A channel as `tensorverbs stats` shows it: taken on the progress thread.
struct ChannelSnapshot {
  std::string peer_task;
  bool receives = false;  // the owner's end: this task receives over it
  std::string state;      // "connecting", "ready", "closed"
  std::string description;
  std::vector<std::pair<std::string, int64_t>> counters;  // by name, in a fixed order
};

class Channel {
 public:
  enum class Role { kOwner, kAcceptor };
  enum class State { kConnecting, kReady, kClosed };

  Channel(ChannelEnv* env, Role role, uint64_t id, std::string peer_task);
  ~Channel();

  // Creates the endpoint and message buffer.
  absl::Status Init();
  // Connects to the peer's end, then starts what was queued meanwhile.
  absl::Status Connect(const std::string& peer_address, uint64_t rx_addr, std::string rx_key,
                       int rx_slots, uint64_t peer_incarnation);

  uint64_t id() const { return id_; }
  Role role() const { return role_; }
  State state() const { return state_; }
  const std::string& peer_task() const { return peer_task_; }
  uint64_t peer_incarnation() const { return peer_incarnation_; }
  // Acceptor side: the owner's id for this channel.
  uint64_t peer_channel_id() const { return peer_channel_id_; }
  void set_peer_channel_id(uint64_t id) { peer_channel_id_ = id; }
  // host:port of the peer's server, for messages.
  void set_peer_address(std::string address) { peer_address_ = std::move(address); }
  // Why the channel closed (OK while open).
  const absl::Status& close_status() const { return close_status_; }
  fabric::Endpoint* endpoint() const { return endpoint_.get(); }
  // This channel's track in the recv trace (TENSORVERBS_TRACE), named on first use; 0 when
  // tracing is off.
  uint64_t trace_track();
  // The key this channel's peer is offered for memory in `region` (RdmaMemoryMgr::
  // RemoteKeyFor): with channel keys, one that only this channel's peer holds and that dies
  // with the channel. FailedPrecondition once the channel closed.
  absl::StatusOr<fabric::RemoteKey> OfferKey(const fabric::MemoryRegion& region);
  MessageBuffer* message_buffer() const { return mb_.get(); }
  ChannelEnv* env() const { return env_; }
  std::string Describe() const;
  ChannelCounters& counters() { return counters_; }
  ChannelSnapshot Snapshot() const;
  const ChannelCounters& counters() const { return counters_; }

  // Owner side: starts a recv (queued until the channel is ready).
  void StartRecv(int64_t step_id, KeyRef key, Allocator* allocator, absl::Time deadline,
                 RecvDoneCallback done);
  // Owner side, grpc+gdr: reads the tensor `ref` names into `dest` (through a registered proxy
  // if `dest` is not registered), then releases it at the peer; `done` runs once, on the
  // progress thread. Queued until the channel is ready.
  void StartPull(const RemoteTensorRef& ref, Tensor dest, absl::Time deadline, GdrPull::Done done);
  // Owner side: fails the step's pending recvs.
  void AbortStep(int64_t step_id, const absl::Status& status);
  // Owner side: fails recvs and pulls past their deadline.
  void ExpireRequests(absl::Time now);
  size_t pending_requests() const;
  // Owner side: requests in `state` (and served by `owner`, when given), for tests and
  // diagnostics of the request state machine.
  size_t CountRequests(RdmaTensorRequest::State state,
                       std::optional<RdmaTensorRequest::Owner> owner = std::nullopt) const;
  // Owner side: requests (recvs, pushed requests, reads) the peer still owes an answer.
  bool awaiting_peer() const { return !requests_.empty() || !pulls_.empty(); }
  // Acceptor side: responses that hold their tensor and are still sending it.
  size_t responses_in_progress() const;
  // Acceptor side: whether this end holds anything for its peer (responses, copy buffers),
  // which a dead peer would otherwise pin until the channel closes.
  bool holds_state_for_peer() const { return !responses_.empty() || !copy_buffers_.empty(); }
  // Acceptor side: ends the responses whose receiver has not asked for the content within
  // env->response_timeout of their META_DATA_RESPONSE (a faulty receiver would otherwise pin
  // their tensors for the channel's life): ERROR_STATUS, and a late RE_REQUEST is ignored.
  void ExpireResponses(absl::Time now);
  // Acceptor side: a local tensor for response `serial` is ready.
  void OnLocalTensor(uint64_t serial, uint32_t index, const absl::Status& status,
                     const Tensor& tensor, bool is_dead);

  void OnCompletion(const fabric::Completion& c);
  // Acknowledges, with one write, every control-message slot received since the last call (run
  // once per turn, after acting on them).
  void AcknowledgeMessages();

  // Fails everything pending with `status` and closes the channel (idempotent).
  void Close(const absl::Status& status);

  // For the state machines.
  void SendMessage(Message m);
  // Owner side: names `key` in REQUEST `m`: by its index on this channel once the peer knows
  // it, else by the full key, defining the next index while there are indexes left.
  void NameKey(const KeyRef& key, Message* m);
  // Owner side, large destinations (ChannelEnv::large_in_flight). Whether request `r` may name
  // a destination of `bytes` in its REQUEST (taking the channel's one allowance for that if
  // the destination is large).
  bool MayNameLargeDestination(RdmaTensorRequest& r, uint64_t bytes);
  // Whether `r`, whose sender holds its tensor (meta_ is set), may name its destination now:
  // true for small ones, or with a grant taken; false queues it for GrantWaiting.
  bool GrantLargeDestination(RdmaTensorRequest& r);
  // Gives back what `r` holds (its destination will not be written, or it is finished).
  void ReleaseLargeSlot(RdmaTensorRequest& r);
  // Forget a finished request, response or pull (deletes it) and free its index.
  void FinishRequest(uint32_t index);
  void FinishResponse(uint32_t index);
  void FinishPull(uint32_t index);
  // Copy mode: this side's pre-registered buffers by tensor name.
  CopyBuffers& copy_buffers() { return copy_buffers_; }

 private:
  // Keep a finished record as a spare (FinishRequest, FinishResponse, a completed write).
  void RetireRequest(std::unique_ptr<RdmaTensorRequest> r);
  void RetireResponse(std::unique_ptr<RdmaTensorResponse> r);
  void AssertOwnerThread() const;
  void OnControlMessage();
  void HandleMessage(Message& m);
  // Owner side: META_DATA_RESPONSE or ERROR_STATUS for a request.
  void HandleAnswer(const Message& m);
  // Acceptor side: a new REQUEST (moved into its response).
  void HandleRequest(Message& m);
  // Acceptor side: the key REQUEST `m` names, by name or index (defining the index if it
  // does), or why it names none this task serves. A REQUEST that breaks the indexing rules
  // (an index never defined, a definition out of order) closes the channel.
  absl::StatusOr<KeyRef> RequestedKey(const Message& m);
  void OnContent(uint32_t index);
  // Owner side: logs the slow-recv warning for `request` once it has waited past
  // env->slow_recv_warning (ExpireRequests).
  void WarnIfSlow(RdmaTensorRequest& request, absl::Time now);
  // Owner side, per key on this channel.
  struct KeyState {
    uint32_t name_index = kNoNameIndex;  // how the peer knows it
    int active = 0;                      // requests of it that a recv owns
    uint32_t pushed = kNoPush;           // the request made ahead for its next step
  };
  static constexpr uint32_t kNoPush = 0xFFFFFFFF;
  // Null past kMaxNameIndexes keys (they are then neither indexed nor pushed).
  KeyState* StateOf(const KeyRef& key);
  // After a recv of `key` at `step` completed in place: asks for step + 1 ahead, within the
  // channel's push budget, when no recv of the key is in flight.
  void Push(const KeyRef& key, int64_t step, Allocator* allocator);
  // The recv of (`key`, `step`) takes the pushed request if it is the one; true if it did (and
  // `done` is then the request's). A pushed request for another step stays for its own recv.
  bool AdoptPushed(KeyState* state, int64_t step, RecvDoneCallback& done, absl::Time deadline,
                   Allocator* allocator);
  // Finishes request `index`, whose recv completed, and pushes its key's next step if the recv
  // was written in place.
  void FinishDelivered(uint32_t index);
  // Takes pushed request `r` out of its key's slot and the budget (adopted or finished).
  void Unpush(RdmaTensorRequest& r);
  void IssuePull(uint32_t index);
  // Owner side: answers the queued requests whose recv ended (no destination needed) and
  // grants the others in order while grants are free. Sends messages, so it runs where a
  // close cannot pull records from under a loop.
  void GrantWaiting();
  // Owner side: ResourceExhausted when the channel holds max_pending_recvs recvs and reads.
  absl::Status CheckPendingBound(absl::string_view what) const;

  // Acceptor side: `name` parsed and checked to name a tensor of this task's incarnation.
  absl::StatusOr<KeyRef> ValidKey(const std::string& name);

  static constexpr size_t kMaxCachedKeys = 65536;
  // Keys a channel names by index; later keys travel by name.
  static constexpr uint32_t kMaxNameIndexes = 65536;
  // Larger tensors are not pushed: their transfer, not the REQUEST round trip, sets their
  // latency, and measured over shm a pushed 1 MiB recv was slower (58-83 us p50 against 49-51).
  static constexpr uint64_t kMaxPushedTensorBytes = uint64_t{256} << 10;

  ChannelEnv* const env_;
  const Role role_;
  const uint64_t id_;
  const std::string peer_task_;
  uint64_t peer_incarnation_ = 0;
  uint64_t peer_channel_id_ = 0;
  std::string peer_address_;
  uint64_t trace_track_ = 0;
  absl::Status close_status_;
  State state_ = State::kConnecting;
  std::unique_ptr<fabric::Endpoint> endpoint_;
  std::unique_ptr<MessageBuffer> mb_;
  std::vector<Message> batch_;  // OnControlMessage's decoded batch, kept for its capacity

  // Owner side.
  RequestIndexAllocator indexes_;
  absl::flat_hash_map<uint32_t, std::unique_ptr<RdmaTensorRequest>> requests_;
  std::vector<uint32_t> queued_;  // started before the channel was ready
  absl::flat_hash_map<uint32_t, std::unique_ptr<GdrPull>> pulls_;  // grpc+gdr reads, by index
  std::vector<uint32_t> queued_pulls_;
  // Per key: its index (in the order first sent), recvs in flight, the pushed request. The
  // table holds the keys, so an entry's pointer is never another key's.
  absl::node_hash_map<KeyRef, KeyState> keys_;
  uint32_t next_name_index_ = 0;
  int pushed_requests_ = 0;    // pushed, not adopted, not finished
  uint64_t pushed_bytes_ = 0;  // their destinations
  // Large destinations: named in a REQUEST (at most one), granted at META_DATA_RESPONSE (at
  // most large_in_flight), and the requests waiting for a grant, in order.
  int large_in_request_ = 0;
  int large_granted_ = 0;
  std::deque<uint32_t> large_waiting_;
  // Acceptor side.
  absl::flat_hash_map<uint32_t, std::unique_ptr<RdmaTensorResponse>> responses_;
  // Indexes of expired responses whose RE_REQUEST may still be on its way (it crossed the
  // ERROR_STATUS); forgotten at that RE_REQUEST or the index's next REQUEST.
  absl::flat_hash_set<uint32_t> expired_responses_;
  // Finished records kept for reuse (see Renew in channel.cc).
  std::vector<std::unique_ptr<RdmaTensorRequest>> spare_requests_;
  std::vector<std::unique_ptr<RdmaTensorResponse>> spare_responses_;
  uint64_t next_serial_ = 1;
  absl::flat_hash_map<std::string, KeyRef> valid_keys_;
  // By the index the owner defined: the key, or why it is not one this task serves.
  std::vector<absl::StatusOr<KeyRef>> indexed_keys_;
  CopyBuffers copy_buffers_;
  ChannelCounters counters_;
};

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_CHANNEL_H_
