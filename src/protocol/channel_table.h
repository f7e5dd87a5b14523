// ChannelTable: one transport's channels, found by id (tasks posted for a channel), by endpoint
// (completions), and by peer task (the channel that receives from it, the accepted ones it
// set up). It dispatches completions, runs the channels' timers, and drops closed channels,
// remembering (bounded) why accepted ones closed, so a peer's liveness probe can learn it.
//
// The transport owns it beside its ProgressEngine and hands it to the channels (ChannelEnv::
// channels) and to PeerChannels (peer_channels.h), which creates the channels and adds them
// here. Every method runs on the progress thread (the engine's owner
// thread), which owns the channels, except ProbeOwned and ProbeAccepted: a peer's liveness probe
// is answered from any thread, under a lock the progress thread takes only to add and drop
// channels, so that a loop busy with hundreds of peers does not make this task look dead. The
// table outlives every task that names a channel by id.
#ifndef TENSORVERBS_PROTOCOL_CHANNEL_TABLE_H_
#define TENSORVERBS_PROTOCOL_CHANNEL_TABLE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "src/common/mutex.h"
#include "src/fabric/fabric.h"
#include "src/protocol/channel.h"

namespace tensorverbs::protocol {

class ChannelTable {
 public:
  // `on_owner_thread` tells whether the caller is on the progress thread (DCHECKed; null: not
  // checked).
  explicit ChannelTable(std::function<bool()> on_owner_thread = nullptr);
  ChannelTable(const ChannelTable&) = delete;
  ChannelTable& operator=(const ChannelTable&) = delete;

  // An id for the next channel.
  uint64_t NextId() { return next_id_++; }
  // Takes `channel` (initialized: its endpoint exists); an owner channel becomes the one that
  // receives from its peer task.
  Channel* Add(std::unique_ptr<Channel> channel);
  // The channel with `id`, closed or not; null once it was dropped.
  Channel* Find(uint64_t id) const;
  // The side of channel `id`, or null when there is no such channel or it has the other role:
  // what events posted to the loop for one side (a local tensor, a staged part, a recv) act on.
  ReceivingSide* FindReceiving(uint64_t id) const;
  SendingSide* FindSending(uint64_t id) const;
  // The owner channel that receives from `task`, unless it closed; null if none.
  Channel* OwnerFor(const std::string& task) const;
  // The accepted channel `task` set up as its channel `peer_channel_id`; null if none.
  Channel* AcceptedFrom(const std::string& task, uint64_t peer_channel_id) const;
  // Why the accepted channel `task` set up as `peer_channel_id` closed, if it was dropped
  // recently; null if not known.
  const absl::Status* WhyAcceptedClosed(const std::string& task, uint64_t peer_channel_id) const;
  // Any thread: what a peer's liveness probe learns of a channel (open, or the reason it
  // closed).
  struct ProbeAnswer {
    bool open = false;
    std::string reason;
    bool routine = false;  // closed with Cancelled (given back, replaced), not an error
    uint64_t messages_received = 0;  // control-message slots this end decoded
  };
  // Of the channel `id` this task owns towards `task`.
  ProbeAnswer ProbeOwned(const std::string& task, uint64_t id) const;
  // Of the channel `task` set up as its `peer_channel_id` and this task accepted.
  ProbeAnswer ProbeAccepted(const std::string& task, uint64_t peer_channel_id) const;
  // Closes every accepted channel of `task` but `keep`: `task` set up a new one, so it restarted
  // (when its incarnation differs from `incarnation`) or gave the old one up.
  void CloseAcceptedFrom(const std::string& task, uint64_t incarnation, const Channel* keep);

  // Hands a completion to the channel of its endpoint.
  void Dispatch(const fabric::Completion& c);
  // A channel let go of `endpoint` (a lane it took out): its completions go nowhere from now on,
  // and a new endpoint at the same address maps to its own channel.
  void ForgetEndpoint(const fabric::Endpoint* endpoint) {
    by_endpoint_.erase(const_cast<fabric::Endpoint*>(endpoint));
  }
  // Lane `lane` (>= 1) of a channel with `task` failed at `now`: the channels set up with it
  // for a while keep to the lanes before it (both ends agree on as many as both list), from
  // twice `base` after a first failure, doubling on each repeat while it keeps failing, up to
  // kLaneBackoffLimit. Then the next channel tries every lane again.
  void NoteLaneFailed(const std::string& task, size_t lane, absl::Time now, absl::Duration base);
  // How many further lanes a channel with `task` set up at `now` may list (`lanes`, the
  // transport's count, unless one failed lately).
  size_t FurtherLanesFor(const std::string& task, size_t lanes, absl::Time now) const;
  static constexpr absl::Duration kLaneBackoffLimit = absl::Minutes(10);
  // Expires recvs and responses past their time, and drops closed channels, except those
  // `pinned` names (a set-up call still refers to them by id).
  void Housekeeping(absl::Time now, const std::function<bool(uint64_t id)>& pinned);
  // Fails every owner channel's recvs of `step_id`.
  void AbortStep(int64_t step_id, const absl::Status& status);
  void CloseAll(const absl::Status& status);
  // Drops every channel (after the loop stopped).
  void Clear();

  // Whether any endpoint has operations posted and not completed.
  bool OperationsInFlight() const;
  // Whether a response still holds a tensor a peer took.
  bool ResponsesInProgress() const;
  // Whether a ready channel has requests its peer still owes content or an answer.
  bool AwaitingPeers() const;
  size_t NumReady() const;
  // Whether a channel with `task`, of either role, is connecting or ready.
  bool HasOpenChannelWith(const std::string& task) const;
  // Every channel, as `tensorverbs stats` shows it, by peer task.
  std::vector<ChannelSnapshot> Snapshot() const;
  // Runs `fn` on every channel.
  template <typename Fn>
  void ForEach(Fn fn) const {
    AssertOnLoop();
    for (const auto& [id, channel] : channels_) fn(*channel);
  }

 private:
  void AssertOnLoop() const;
  // AcceptedFrom's lookup, for the progress thread or a holder of probe_mu_.
  Channel* FindAccepted(const std::string& task, uint64_t peer_channel_id) const;

  const std::function<bool()> on_owner_thread_;
  uint64_t next_id_ = 1;
  // Held by the progress thread while it changes channels_ or closed_accepted_, and by a probe
  // reading them from another thread; the progress thread reads them without it (it is their
  // only writer).
  mutable Mutex probe_mu_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Channel>> channels_;
  absl::flat_hash_map<fabric::Endpoint*, Channel*> by_endpoint_;
  absl::flat_hash_map<std::string, uint64_t> owner_by_task_;
  // Why recently dropped accepted channels closed, by (owner task, owner's channel id).
  absl::flat_hash_map<std::pair<std::string, uint64_t>, absl::Status> closed_accepted_;
  static constexpr size_t kMaxClosedAccepted = 1024;
  // Peers whose lanes failed lately (NoteLaneFailed): the lanes their channels keep to, until
  // when, and the back-off the next failure doubles.
  struct LaneLimit {
    size_t further_lanes = 0;
    absl::Time until;
    absl::Duration backoff;
  };
  absl::flat_hash_map<std::string, LaneLimit> lane_limits_;
};

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_CHANNEL_TABLE_H_
