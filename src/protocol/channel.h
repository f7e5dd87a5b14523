// Channel: the RDMA connection that carries one task's recvs from one peer task.
//
// The receiving task owns the channel (Role::kOwner): it set it up by calling the peer's
// VerbsService.Connect, and runs one RdmaTensorRequest per recv. The peer holds the other end
// (Role::kAcceptor) and runs one RdmaTensorResponse per request. A pair of tasks that receive
// from each other therefore has two channels, one per direction of tensor flow; the seed's
// single bidirectional channel needed a symmetric handshake that races when both tasks connect
// at once, and this way each side of a channel has one job.
//
// This class is the part both ends share: the endpoint, the control-message buffer, the
// completion demultiplexer and the sticky close status. What each role owns lives in its side,
// which callers reach directly (receiving(), sending(), or the channel table's FindReceiving and
// FindSending): ReceivingSide (receiving_side.h: recvs, requests, key names, push-ahead,
// large-destination grants, grpc+gdr's reads) or SendingSide (sending_side.h: responses, key
// validation, the expired set, local tensors and staged parts). The state machines are in
// tensor_request.h, tensor_response.h and gdr_pull.h; what copy mode does differently in
// copy_mode.h.
//
// Everything here runs on the transport's progress thread (the owner thread of ChannelEnv;
// each public method DCHECKs it). A request's `done` runs exactly once on the worker's callback
// executor. A request that ends before its content arrives (abort, timeout) keeps its index and
// destination memory until the sender answers or the channel closes, so late content never
// lands in freed memory. Closing marks the channel closed, fails every callback once and moves
// the records out of the tables; they are freed at the end of the loop turn (Reap), never
// inside a call of their own.
#ifndef TENSORVERBS_PROTOCOL_CHANNEL_H_
#define TENSORVERBS_PROTOCOL_CHANNEL_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/fabric/fabric.h"
#include "src/protocol/channel_env.h"
#include "src/protocol/message_buffer.h"
#include "src/protocol/receiving_side.h"
#include "src/protocol/sending_side.h"
#include "src/protocol/tensor_request.h"

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
  // Per lane (0: the channel's own endpoint): content bytes this end posted (sender; a tensor
  // kept to lane 0 counts there), and content segments that landed (receiver). Reported only
  // for a channel with lanes (Channel::Snapshot).
  std::atomic<int64_t> lane_bytes_sent[kMaxLanes] = {};
  std::atomic<int64_t> lane_segments_received[kMaxLanes] = {};
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
  std::string fabric;     // the fabric it runs over: "shmem (shmem)", "ofi (tcp;ofi_rxm)"
  std::string description;
  CounterList counters;  // catalog names (common/counters.h), in a fixed order
};

class Channel {
 public:
  enum class Role { kOwner, kAcceptor };
  // The channel's machine is one table, kChannelTable in channel.cc (state_table.h).
  enum class State { kConnecting, kReady, kClosed };
  static constexpr int kStates = 3;
  enum class Event { kConnected, kClose };
  static constexpr int kEvents = 2;

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
  const std::string& peer_address() const { return peer_address_; }
  void set_peer_address(std::string address) { peer_address_ = std::move(address); }
  // Why the channel closed (OK while open).
  const absl::Status& close_status() const { return close_status_; }
  // Any thread, for a peer's liveness probe answered off the progress thread (ChannelTable::
  // ProbeOwned/ProbeAccepted, under the table's lock, which keeps the channel alive): whether it
  // closed, published after close_status() is final.
  bool ClosedForProbes() const { return closed_for_probes_.load(std::memory_order_acquire); }
  fabric::Endpoint* endpoint() const { return endpoint_.get(); }
  // Lanes (env()->lanes): lane 0 is endpoint(); lanes 1.. have an endpoint each on their own
  // domain, and carry content once the peer agreed on them at set-up. The agreed lanes are the
  // first `lanes()` (1 when there are none beyond lane 0).
  size_t lanes() const { return 1 + lanes_connected_; }
  fabric::Endpoint* lane_endpoint(size_t lane) const {
    return lane == 0 ? endpoint_.get() : lanes_[lane - 1].get();
  }
  // Which lane `endpoint` is (0 when it is none of the further lanes').
  size_t LaneOf(const fabric::Endpoint* endpoint) const;
  // Receiver: when content last came over lane `lane` (InfinitePast: never).
  absl::Time LaneHeard(size_t lane) const { return lane_heard_[lane]; }
  // Probes. A further lane carries a tensor's segments only once it proved itself: the owner,
  // connected, writes a probe over it into the acceptor's probe word (ProbeLanes), and the
  // acceptor writes it back over the same lane into the owner's; a lane counts for striping
  // once its echo came (striping_lanes). A lane whose link is down, or that came back from a
  // failure (ChannelTable::NoteLaneFailed) still broken, never carries a tensor to lose; a
  // probe whose write fails takes the lane out (TakeLanesOut).
  struct LaneProbe {
    uint64_t addr = 0;
    fabric::RemoteKey key;
  };
  // This end's probe word for lane `lane` >= 1, which the peer writes (ChannelEnd.lanes);
  // NotFound when the lane's domain cannot reach it (the lane then never stripes).
  absl::StatusOr<LaneProbe> LaneProbeTarget(size_t lane);
  // The peer's probe words, lane 1 first (from its ChannelEnd; an empty key: none).
  void SetPeerLaneProbes(std::vector<LaneProbe> probes) { peer_probes_ = std::move(probes); }
  // Owner, once connected: writes a probe over each connected further lane.
  void ProbeLanes();
  // Owner: the lanes a tensor may be spread over: lane 0, then the further lanes, in order,
  // whose probe came back.
  size_t striping_lanes() const;
  // Receiver: the rates (bytes per second, lane 0 first; 0: none) a tensor spread over the
  // lanes measured (RdmaTensorRequest::LaneRates), each folded into the lane's running figure.
  void NoteLaneRates(const std::array<double, kMaxLanes>& rates);
  // Receiver: each of the first `lanes` lanes' share of a tensor's segments, in proportion to
  // their running rates (SharesFromRates), the shares in use kept while each is within one of
  // that; all zero (even) until each lane was measured, or where
  // ChannelOptions::stripe_by_rate is off.
  LaneShares StripeShares(size_t lanes);

  // Housekeeping, receiver: a further lane that owes segments of a tensor that began to land
  // and was silent for the peer timeout is taken out (TakeLanesOut), naming it.
  void CheckLanes(absl::Time now);
  // Lane `lane` >= 1 failed (`why`): it and the lanes after it are taken out of this channel,
  // which goes on over the lanes before it, and the channels with this peer leave it out for a
  // while (ChannelTable::NoteLaneFailed). At the receiver their endpoints go, so a link that
  // comes back delivers nothing more, and the tensors that were landing over them end with
  // `why`, their destinations quarantined (ReceivingSide::EndStripedOver). At the sender the
  // endpoints stay until the channel closes, for the writes still queued on them to complete.
  // Nothing for a lane already out.
  void TakeLanesOut(size_t lane, const absl::Status& why);
  // The further lanes' endpoints, for the peer (ChannelEnd.lanes) and the channel table.
  std::vector<fabric::Endpoint*> FurtherLaneEndpoints() const;
  // Those ConnectLanes connected, in order: what an acceptor lists in its answer.
  std::vector<fabric::Endpoint*> AgreedLaneEndpoints() const;
  // Connects the further lanes to the peer's, in order, as many as both have: the lanes the
  // two ends agree on. Before Connect (the owner, from the answer; the acceptor, from the
  // request). A lane that fails to connect ends the list there, logged and noted (the channel
  // goes on with the lanes before it); an error only for a closed channel.
  absl::Status ConnectLanes(const std::vector<std::string>& peer_addresses);
  // The key the peer is offered, on lane `lane` >= 1, for the `bytes` at `addr`: memory that
  // lane's domain has registered (the pool), else NotFound.
  absl::StatusOr<fabric::RemoteKey> OfferLaneKey(size_t lane, const void* addr, uint64_t bytes);
  // The registration of the `bytes` at `addr` on lane `lane` >= 1 (for a write from there),
  // else null.
  const fabric::MemoryRegion* LaneRegion(size_t lane, const void* addr, uint64_t bytes) const;
  // Registers the `bytes` at `addr` (a source outside the pool) with lane `lane` >= 1's domain
  // for one write, as lane 0's RdmaMemoryMgr::RegisterSource does.
  absl::StatusOr<std::unique_ptr<fabric::MemoryRegion>> RegisterLaneSource(size_t lane,
                                                                           const void* addr,
                                                                           uint64_t bytes);
  // Housekeeping: whether the channel has been ready with nothing pending (no recv or response,
  // nothing lent, no operation in flight) and no message either way for its options'
  // idle_close; false while that is zero. Remembered for idle() until the next call.
  bool NoteIdle(absl::Time now);
  bool idle() const { return idle_; }
  // Housekeeping, owner, after NoteIdle: whether the channel should be given back so that a
  // lane it took out comes back: it has fewer lanes than it agreed on at set-up, the channel
  // table lets a new channel with the peer have `further_lanes_allowed` (the back-off after the
  // failure ran out), and nothing has moved on it for kLanesBackQuiet. The next recv then sets
  // up a channel with every lane, each probed before it carries a tensor.
  bool WantsLanesBack(absl::Time now, size_t further_lanes_allowed) const;
  static constexpr absl::Duration kLanesBackQuiet = absl::Milliseconds(100);
  // The watchdog (PeerChannels::PendingPeers, on the loop): whether the peer has written into
  // this channel since the last call: content, on a receiver's channel; anything (requests,
  // ACKs), on a sender's. That says its process and the path to it are alive and the channel
  // moves, so a channel in steady use needs no liveness probe, and one that stops moving is
  // probed at the next round. A receiver's channel whose peer only acknowledged its requests
  // is probed: a peer that closed its end after an error sent an ACK last. At
  // 256 tasks on two cores, a server's round of probes to every worker, each answered by a
  // process with a sliver of a core, was what outlasted the peer timeout.
  bool HeardSinceLastLook() const {
    const bool heard = heard_ != heard_looked_;
    heard_looked_ = heard_;
    return heard;
  }
  // The watchdog (PeerChannels::PendingPeers, on the loop): what the peer owes an
  // acknowledgement for. `slots`: the control-message slots the peer must have decoded (one
  // more than it acknowledged; this side's write of that slot completed); `since`: when it was
  // first seen owed with nothing from the peer since, no earlier than that write completed.
  // nullopt while nothing is owed. A peer's loop acknowledges a message in the turn it lands,
  // so one that a peer's idle poll long after `since` has still not decoded was lost on the
  // way, as over a shared connection that broke under it (PeerWatchdog judges, from the
  // peer's answer to a probe).
  struct AwaitedAck {
    uint64_t slots = 0;
    absl::Time since;
  };
  std::optional<AwaitedAck> AwaitedAcknowledgement(absl::Time now) const;
  // Any thread (a peer's probe answered off the loop): the control-message slots decoded from
  // the peer so far.
  uint64_t MessagesReceivedForProbes() const {
    return received_for_probes_.load(std::memory_order_relaxed);
  }
  // The idle time starts over (its acceptor asked, and the owner keeps the channel).
  void RestartIdle() {
    idle_since_ = absl::InfinitePast();
    idle_ = false;
    quiet_ = false;
  }
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
  // The side of the channel its role makes it: the other one is null. Callers reach a side's
  // operations (recvs, pulls, responses, expiry) through it, or through the channel table's
  // FindReceiving and FindSending; the channel itself only demultiplexes and closes.
  ReceivingSide* receiving() const { return receiving_.get(); }
  SendingSide* sending() const { return sending_.get(); }
  // DCHECKs that the caller is the channel's progress thread (ChannelHost::OnOwnerThread).
  void AssertOwnerThread() const;

  // The completion demultiplexer: control messages and ACKs here, content immediates, reads
  // and content writes to the side they belong to.
  void OnCompletion(const fabric::Completion& c);
  // Acknowledges, with one write, every control-message slot received since the last call (run
  // once per turn, after acting on them).
  void AcknowledgeMessages();

  // Fails everything pending with `status` and closes the channel (idempotent). The records
  // stay allocated until the end of the loop turn, so a state machine whose send failed and
  // closed the channel is not destroyed under its own call.
  void Close(const absl::Status& status);
  // The link is gone (the fabric refused a send, or an operation failed): closes at the end of
  // this loop turn rather than now. The turn's other completions may still carry the content
  // of tensors the peer wrote before it went (a task that stops right after its sends were
  // taken); handled first, they land in their requests, which a closing channel keeps for
  // their recvs. Sends are dropped meanwhile. Without a host, closes now.
  void CloseAfterThisTurn(absl::Status status);
  // A message-buffer failure (a refused post of a queued message, a bad ACK) as a channel
  // error that names the peer.
  absl::Status MessagesFailed(const absl::Status& s) const;

  // For the state machines: sends a control message; a failure closes the channel.
  void SendMessage(Message m);
  // A side finished records: frees them at the end of this loop turn (once per turn).
  void ScheduleReap();
  // Frees the records the sides finished (the task ScheduleReap posts).
  void Reap();

 private:
  // The one place the state changes; checks in debug and sanitizer builds that the move is a
  // row of kChannelTable.
  void TransitionTo(State next, Event event);
  // Lane `lane` cannot serve this channel (no endpoint, no connection): logs it and notes it
  // in the table, so the channels with this peer leave it out for a while.
  void LaneFailed(size_t lane, const absl::Status& status);
  // A probe immediate came over further lane `lane`: the owner counts the lane proven, the
  // acceptor writes it back.
  void OnLaneProbe(size_t lane);
  // Writes the probe immediate over lane `lane` into the peer's probe word; a failure to post
  // takes the lane out.
  void PostLaneProbe(size_t lane);
  void OnControlMessage();
  void HandleMessage(Message& m);

  ChannelEnv* const env_;
  const Role role_;
  const uint64_t id_;
  const std::string peer_task_;
  uint64_t peer_incarnation_ = 0;
  uint64_t peer_channel_id_ = 0;
  std::string peer_address_;
  uint64_t trace_track_ = 0;
  absl::Status close_status_;
  std::atomic<bool> closed_for_probes_{false};
  std::atomic<uint64_t> received_for_probes_{0};  // MessagesReceivedForProbes
  // NoteIdle's view: the traffic it last saw and since when it has not moved.
  uint64_t idle_traffic_ = 0;
  absl::Time idle_since_ = absl::InfinitePast();
  bool idle_ = false;
  bool quiet_ = false;    // NoteIdle saw nothing pending, since idle_since_
  uint64_t heard_ = 0;    // writes from the peer that prove the channel moves (HeardSinceLastLook)
  uint64_t inbound_ = 0;  // every write with immediate from the peer
  mutable uint64_t heard_looked_ = 0;
  // AwaitedAcknowledgement's view: the acknowledged count it last saw, and since when it has
  // not moved with messages outstanding.
  mutable uint64_t ack_watch_count_ = 0;
  mutable uint64_t ack_watch_inbound_ = 0;
  mutable absl::Time ack_watch_since_ = absl::InfinitePast();
  State state_ = State::kConnecting;
  bool reap_posted_ = false;
  absl::Status closing_;  // CloseAfterThisTurn's reason, until the close runs
  std::unique_ptr<fabric::Endpoint> endpoint_;
  std::vector<std::unique_ptr<fabric::Endpoint>> lanes_;  // lanes 1.., one per env_->lanes
  size_t lanes_connected_ = 0;
  size_t lanes_agreed_ = 0;  // lanes_connected_ at set-up, before any was taken out
  // Probes: this end's probe words (16 bytes of the pool: the word the peer writes, then the
  // source of this end's writes), the peer's, and which lanes' echoes came (owner).
  Tensor probe_words_;
  std::vector<LaneProbe> peer_probes_;
  std::array<bool, kMaxLanes> lane_probed_ = {};
  std::array<double, kMaxLanes> lane_rate_ = {};  // NoteLaneRates
  LaneShares stripe_shares_{};                    // StripeShares: those in use
  std::array<absl::Time, kMaxLanes> lane_heard_ = MakeLaneHeard();
  static std::array<absl::Time, kMaxLanes> MakeLaneHeard() {
    std::array<absl::Time, kMaxLanes> never;
    never.fill(absl::InfinitePast());
    return never;
  }
  std::unique_ptr<MessageBuffer> mb_;
  std::vector<Message> batch_;  // OnControlMessage's decoded batch, kept for its capacity
  ChannelCounters counters_;
  // One of the two, by role.
  std::unique_ptr<ReceivingSide> receiving_;
  std::unique_ptr<SendingSide> sending_;
};

// The channel's table, for the diagrams and the tests.
StateTableView ChannelStateTable();

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_CHANNEL_H_
