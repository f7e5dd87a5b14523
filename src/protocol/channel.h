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
// Everything here runs on the transport's progress thread. A request's `done` runs exactly once
// on the worker's callback executor. A request that ends before its content arrives (abort,
// timeout) keeps its index and destination memory until the sender answers or the channel
// closes, so late content never lands in freed memory.
#ifndef TENSORVERBS_PROTOCOL_CHANNEL_H_
#define TENSORVERBS_PROTOCOL_CHANNEL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "src/fabric/fabric.h"
#include "src/protocol/imm.h"
#include "src/protocol/memory_mgr.h"
#include "src/protocol/message_buffer.h"
#include "src/rendezvous/remote_rendezvous.h"
#include "src/rendezvous/rendezvous_mgr.h"
#include "src/transport/grpc/dma.h"

namespace tensorverbs::protocol {

// Counters of one transport, readable from any thread.
struct VerbsStats {
  std::atomic<int64_t> requests{0};           // REQUEST messages sent
  std::atomic<int64_t> meta_cache_hits{0};    // ... of which carried a cached meta-data
  std::atomic<int64_t> meta_responses{0};     // META_DATA_RESPONSE messages sent
  std::atomic<int64_t> re_requests{0};        // RE_REQUEST messages sent
  std::atomic<int64_t> errors_sent{0};        // ERROR_STATUS messages sent
  std::atomic<int64_t> control_messages{0};   // control messages written, of every type
  std::atomic<int64_t> control_slots{0};      // ... in this many slot writes (batching)
  std::atomic<int64_t> content_writes{0};     // content transfers completed by this sender
  std::atomic<int64_t> content_bytes{0};
  std::atomic<int64_t> copies{0};             // tensor copies made by the transport (proxy,
  std::atomic<int64_t> copied_bytes{0};       //   copy strategy, unregistered sources)
  std::atomic<int64_t> transient_registrations{0};
  std::atomic<int64_t> dropped_imms{0};       // unknown or stale request indexes
  std::atomic<int64_t> channel_errors{0};
  std::atomic<int64_t> checksum_failures{0};

  // One copy of `bytes` tensor bytes, counted here and in the worker's TransferStats (if any).
  void CountCopy(uint64_t bytes, TransferStats* worker) {
    copies.fetch_add(1, std::memory_order_relaxed);
    copied_bytes.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
    if (worker != nullptr) {
      worker->copies.fetch_add(1, std::memory_order_relaxed);
      worker->copied_bytes.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
    }
  }
};

// Which design a transport runs; the protocol string picks it.
enum class VerbsMode {
  kZeroCopy,  // grpc+verbs (seed 000): the content is written into the result tensor
  kCopy,      // grpc+verbs-copy (seed 002): per-name pre-registered buffers, a copy each side
  kGdr,       // grpc+gdr: meta-data over gRPC RecvTensor, the content pulled by one RDMA read
};
const char* VerbsModeProtocol(VerbsMode mode);

// What channels share; owned by the transport.
struct ChannelEnv {
  const WorkerEnv* worker = nullptr;
  RendezvousMgr* rendezvous_mgr = nullptr;  // serves requests (acceptor side)
  RdmaMemoryMgr* memory = nullptr;
  fabric::Domain* domain = nullptr;
  VerbsStats* stats = nullptr;
  Registration registration = Registration::kPool;
  VerbsMode mode = VerbsMode::kZeroCopy;
  bool data_validation = false;
  int message_slots = 8;
  int message_batch = 32;  // the most control messages written into one slot
  absl::Duration quarantine = absl::Seconds(10);  // how long a failed channel's memory is kept
  // Runs `task` on the progress thread later, never inline: called on the progress thread, at
  // the end of the completion or task being handled; from another thread, at the loop's next
  // turn.
  std::function<void(absl::AnyInvocable<void() &&>)> post;
  // Runs a user `done` callback on the worker's callback executor; on the progress thread, the
  // callbacks of one turn go to the executor together at the end of the turn.
  std::function<void(absl::AnyInvocable<void() &&>)> deliver;
  // Finds a live channel by id (progress thread); null if it is gone.
  std::function<class Channel*(uint64_t)> find_channel;
  // Keeps memory alive until `until` (progress thread).
  std::function<void(std::vector<Tensor>, absl::Time until)> quarantine_memory;
  // grpc+gdr, sender side: `task` released the tensor it read under `tensor_key`.
  std::function<void(const std::string& task, uint32_t tensor_key)> release_lent;
};

class Channel;

class RdmaTensorRequest {
 public:
  enum class State { kQueued, kRequested, kReRequested, kDone };

  RdmaTensorRequest(Channel* channel, uint32_t index, int64_t step_id, ParsedKey key,
                    Allocator* allocator, absl::Time deadline, RecvDoneCallback done);

  void Start();
  void RecvTensorMetaData(const Message& m);
  void RecvTensorContent();
  // Ends the recv with `status` if it has not ended; the record stays until the sender is done.
  void Fail(const absl::Status& status);

  uint32_t index() const { return index_; }
  int64_t step_id() const { return step_id_; }
  State state() const { return state_; }
  bool finished() const { return !done_; }  // `done` has run
  absl::Time deadline() const { return deadline_; }
  const std::string& key() const { return key_.full_key; }
  // The memory the sender may still write into.
  std::vector<Tensor> TakeMemory();

 private:
  // Allocates the destination for `meta` and returns where the sender writes.
  absl::Status PrepareDestination(const TensorMetaData& meta, uint64_t* addr, std::string* key);
  // Copy mode: makes staging_ (the name's buffer) hold at least `bytes` and returns where the
  // sender writes.
  absl::Status PrepareCopyBuffer(uint64_t bytes, uint64_t* addr, std::string* key);
  void RecvCopyContent();
  void Deliver(const absl::Status& status, const Tensor& tensor, bool is_dead);

  Channel* const channel_;
  const uint32_t index_;
  const int64_t step_id_;
  const ParsedKey key_;
  Allocator* const allocator_;
  const absl::Time deadline_;
  RecvDoneCallback done_;
  State state_ = State::kQueued;
  TensorMetaData meta_;   // what the content will match
  uint64_t checksum_ = 0;
  Tensor result_;         // the destination, when the content lands in place
  Tensor staging_;        // registered proxy (strings, unregistrable destinations, copy mode)
  std::unique_ptr<fabric::MemoryRegion> transient_;  // per-transfer registration
};

class RdmaTensorResponse {
 public:
  enum class State { kWaitTensor, kWaitReRequest, kWriting, kDone };

  RdmaTensorResponse(Channel* channel, uint64_t serial, const Message& request);

  // Asks the local rendezvous for the tensor; Resume runs (on the progress thread) when sent.
  void Start(std::shared_ptr<RemoteRendezvous> rendezvous, const ParsedKey& key);
  void Resume(const absl::Status& status, const Tensor& tensor, bool is_dead);
  void RecvReRequest(const Message& m);
  // One content write completed; true when the response is finished.
  bool OnWriteDone();
  // Stops waiting for the local tensor (channel closing).
  void Cancel();

  uint64_t serial() const { return serial_; }
  uint32_t index() const { return request_.request_index; }
  State state() const { return state_; }

 private:
  absl::Status PrepareSource(const Tensor& tensor);
  // Copy mode: lays the tensor out in the name's registered buffer (the copy in).
  absl::Status PrepareCopySource(const Tensor& tensor, bool is_dead);
  void WriteContent(uint64_t addr, const std::string& key);
  // META_DATA_RESPONSE (in copy mode: the seed's BUFFER_REQUEST), then wait for RE_REQUEST.
  void SendMetaData();
  void SendError(const absl::Status& status);

  Channel* const channel_;
  const uint64_t serial_;
  const Message request_;  // REQUEST as received (name, step, index, target, meta)
  State state_ = State::kWaitTensor;
  std::shared_ptr<RemoteRendezvous> rendezvous_;
  uint64_t token_ = 0;
  TensorMetaData meta_;
  Tensor tensor_;   // keeps the source alive until the writes complete
  Tensor staging_;  // registered copy (strings, unregistered sources, copy mode)
  const void* source_ = nullptr;
  const fabric::MemoryRegion* source_region_ = nullptr;
  std::unique_ptr<fabric::MemoryRegion> transient_;
  int writes_left_ = 0;
};

class Channel {
 public:
  enum class Role { kOwner, kAcceptor };
  enum class State { kConnecting, kReady, kClosed };

  Channel(ChannelEnv* env, Role role, uint64_t id, std::string peer_task);
  ~Channel();

  // Creates the endpoint and message buffer.
  absl::Status Init();
  // Connects to the peer's end.
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
  MessageBuffer* message_buffer() const { return mb_.get(); }
  ChannelEnv* env() const { return env_; }
  std::string Describe() const;

  // Owner side: starts a recv (queued until the channel is ready).
  void StartRecv(int64_t step_id, const ParsedKey& key, Allocator* allocator,
                 absl::Time deadline, RecvDoneCallback done);
  // Owner side, grpc+gdr: reads the tensor `ref` names into `dest` (through a registered proxy
  // if `dest` is not registered), then releases it at the peer; `done` runs once, on the
  // progress thread. Queued until the channel is ready.
  using PullDone = absl::AnyInvocable<void(const absl::Status&) &&>;
  void StartPull(const grpc_transport::RemoteTensorRef& ref, Tensor dest, absl::Time deadline,
                 PullDone done);
  // Owner side: fails the step's pending recvs.
  void AbortStep(int64_t step_id, const absl::Status& status);
  // Owner side: fails recvs past their deadline.
  void ExpireRequests(absl::Time now);
  size_t pending_requests() const;
  // Acceptor side: responses that hold their tensor and are still sending it.
  size_t responses_in_progress() const;
  // Acceptor side: a local tensor for response `serial` is ready.
  void OnLocalTensor(uint64_t serial, uint32_t index, const absl::Status& status,
                     const Tensor& tensor, bool is_dead);

  void OnCompletion(const fabric::Completion& c);
  // Acknowledges, with one write, every control-message slot received since the last call (run
  // once per turn, after acting on them).
  void AcknowledgeMessages();

  // Fails everything pending with `status` and closes the channel (idempotent).
  void Close(const absl::Status& status);

  // Copy mode: the pre-registered buffer kept for a tensor name (empty if none), taken while a
  // transfer uses it and given back after.
  Tensor TakeCopyBuffer(const std::string& name);
  void ReturnCopyBuffer(const std::string& name, Tensor buffer);

  // For the state machines.
  void SendMessage(Message m);
  void FinishRequest(uint32_t index);
  void FinishResponse(uint32_t index);

 private:
  void OnControlMessage();
  void HandleMessage(const Message& m);
  void OnContent(uint32_t index);
  struct Pull {
    grpc_transport::RemoteTensorRef ref;
    Tensor dest;
    Tensor staging;  // registered proxy when dest is not registered
    absl::Time deadline;
    PullDone done;   // null once run
    int reads_left = 0;
  };
  void IssuePull(uint32_t index);
  void OnReadDone(uint32_t index);
  // Runs the pull's `done` (once) with `status`.
  void EndPull(Pull& pull, const absl::Status& status);

  // Acceptor side: `name` parsed and checked to name a tensor of this task's incarnation.
  absl::StatusOr<const ParsedKey*> ValidKey(const std::string& name);

  static constexpr size_t kMaxCachedKeys = 65536;

  ChannelEnv* const env_;
  const Role role_;
  const uint64_t id_;
  const std::string peer_task_;
  uint64_t peer_incarnation_ = 0;
  uint64_t peer_channel_id_ = 0;
  std::string peer_address_;
  absl::Status close_status_;
  State state_ = State::kConnecting;
  std::unique_ptr<fabric::Endpoint> endpoint_;
  std::unique_ptr<MessageBuffer> mb_;

  // Owner side.
  RequestIndexAllocator indexes_;
  absl::flat_hash_map<uint32_t, std::unique_ptr<RdmaTensorRequest>> requests_;
  std::vector<uint32_t> queued_;  // started before the channel was ready
  absl::flat_hash_map<uint32_t, std::unique_ptr<Pull>> pulls_;  // grpc+gdr reads, by index
  std::vector<uint32_t> queued_pulls_;
  // Acceptor side.
  absl::flat_hash_map<uint32_t, std::unique_ptr<RdmaTensorResponse>> responses_;
  uint64_t next_serial_ = 1;
  absl::flat_hash_map<std::string, ParsedKey> valid_keys_;
  // Copy mode: per tensor name, this side's pre-registered buffer (rx on the owner, tx on the
  // acceptor).
  absl::flat_hash_map<std::string, Tensor> copy_buffers_;
};

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_CHANNEL_H_
