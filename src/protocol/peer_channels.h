// PeerChannels: one transport's grpc+verbs channels, by peer task. It finds the channel that
// receives from a task and makes it when there is none: it picks the fabric context (with a
// same-host fabric beside the network one, a peer of Options::same_host_tasks gets the first),
// creates and initializes the channel, and hands this task's end to the transport
// (ChannelHost::Connect), whose answer comes back here. It is also the acceptor's side of that
// handshake and of the owner's liveness probes, and where a recv starts: a tensor that already
// landed ahead (TENSORVERBS_PUSH) is delivered at once; otherwise the caller's expected
// meta-data is cached for the channel's fabric and the recv goes to the channel. It keeps the
// landed store (every context's env points at it) and ends a step on every channel.
//
// Both ends check that they share the host (fabric::ThisHostIdentity) before a same-host
// channel stands; where they do not, the acceptor refuses the fabric (ConnectResponse::refused),
// and the owner logs it once and sets the channel up again over the network fabric.
//
// The transport owns it beside the channel table and the fabric contexts, which outlive it.
// Threading: everything but ConnectPeers and PeerWritesDevice runs on the progress thread (the
// engine's owner thread), which owns the channels. ConnectPeers waits on another thread.
#ifndef TENSORVERBS_PROTOCOL_PEER_CHANNELS_H_
#define TENSORVERBS_PROTOCOL_PEER_CHANNELS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/verbs.pb.h"
#include "src/common/mutex.h"
#include "src/protocol/channel.h"
#include "src/protocol/channel_table.h"
#include "src/protocol/fabric_contexts.h"
#include "src/protocol/progress_engine.h"
#include "src/protocol/push_ahead.h"
#include "src/rendezvous/key_table.h"
#include "src/rendezvous/remote_rendezvous.h"

namespace tensorverbs::protocol {

// A recv on its way from the caller's thread to the progress thread.
struct RecvStart {
  std::shared_ptr<RemoteRendezvous> rendezvous;
  KeyRef key;
  Allocator* allocator = nullptr;
  absl::Time deadline;
  RecvDoneCallback done;
  DataType expected_dtype = DataType::kInvalid;
  TensorShape expected_shape;
  RecvLanding landing;
};

class PeerChannels {
 public:
  struct Options {
    absl::flat_hash_map<std::string, std::string> task_addresses;  // every task of the cluster
    // The peers whose channels this task sets up over the same-host fabric (when it has one).
    absl::flat_hash_set<std::string> same_host_tasks;
    // The tasks this task holds something else for (grpc+gdr's lent tensors): their accepted
    // channels are then probed too. Null: none.
    std::function<absl::flat_hash_set<std::string>()> lent_to;
    // `task` stopped answering the probes of the channel it owns towards this one: what this
    // task keeps for it alone (lent tensors) can go. Null: nothing to do.
    std::function<void(const std::string& task)> peer_gone;
  };

  // `fabrics` (built, not empty), `table` and `engine` outlive this object; the channels reach
  // the transport through their env's host.
  PeerChannels(Options options, FabricContexts* fabrics, ChannelTable* table,
               ProgressEngine* engine);
  PeerChannels(const PeerChannels&) = delete;
  PeerChannels& operator=(const PeerChannels&) = delete;

  // Progress thread.
  // Starts `r`: delivered from the landed store, failed (the step was aborted, no channel can
  // be made), or handed to the channel that receives from its source task. `r.done` runs once.
  void StartRecv(RecvStart r);
  // Ends `step_id`: its tensors that landed ahead are dropped, and its pending recvs (pushed
  // requests included) on every channel fail with `status`.
  void AbortStep(int64_t step_id, const absl::Status& status);
  // Drops landed tensors past their time (the transport's housekeeping).
  void Expire(absl::Time now);
  // Where channels keep tensors that landed in pushed requests after the channel closed
  // (ChannelEnv::landed); the transport points every context's env here before it starts.
  LandedStore* landed() { return &landed_; }
  // The ready or connecting channel that receives from `task`, set up now if there is none.
  absl::StatusOr<Channel*> OwnerChannel(const std::string& task);
  // The acceptor's side of Connect.
  absl::Status Accept(const proto::ConnectRequest& request, proto::ConnectResponse* response);
  // Whether the set-up call for channel `id` is still unanswered (its answer names it by id,
  // so the table keeps it even closed).
  bool SettingUp(uint64_t id) const { return connecting_.contains(id); }
  // What the watchdog probes: owner channels with recvs or reads pending (one still being set up
  // too, `connecting`, for whether its peer answers at all), and accepted channels that hold
  // something for their peer (`accepting`), so a receiver that died does not pin it. A ready
  // channel whose peer wrote into it since the last call is left out (that was proof of life)
  // when `spare_heard`; a task stopping its traffic asks about every one (LastRound).
  struct Probe {
    std::string task;
    std::string address;
    uint64_t incarnation;
    uint64_t channel_id;  // this task's id of the channel
    bool connecting = false;
    // An accepted channel that holds something for its peer: probed for whether the peer's
    // own end (`peer_channel_id`) still stands.
    bool accepting = false;
    uint64_t peer_channel_id = 0;
    // An accepted channel that is idle (ChannelOptions::idle_close): its owner's end gone is a
    // give-back, not an error. `idle_only`: probed for that alone, so silence says nothing (a
    // slow owner keeps it).
    bool idle = false;
    bool idle_only = false;
    // What the peer owes this end an acknowledgement for, if anything (MessageLost).
    std::optional<Channel::AwaitedAck> awaited = std::nullopt;
  };
  std::vector<Probe> PendingPeers(bool spare_heard = true) const;
  // Whether a probe's answer shows a control message this end wrote lost on the way: the
  // peer's end has decoded fewer than `awaited.slots`, yet the peer's loop found nothing to do
  // at a poll (`idle_poll_age` before its answer, which came after `probe_sent`) at least
  // `margin` after `awaited.since`, by when the write had long landed. A peer too busy to have
  // reached the message has polled nothing idle since, and keeps its channel.
  static bool MessageLost(const Channel::AwaitedAck& awaited, uint64_t peer_received,
                          std::optional<absl::Duration> idle_poll_age, absl::Time probe_sent,
                          absl::Duration margin);
  // A probe found `task` silent: see Options::peer_gone.
  void PeerGone(const std::string& task) {
    if (options_.peer_gone) options_.peer_gone(task);
  }

  // Any thread.
  // The answer to a peer's liveness probe of a channel between the two (ChannelTable::
  // ProbeOwned, ProbeAccepted): read under the table's lock, not on the progress thread.
  void CheckChannel(const proto::CheckChannelRequest& request,
                    proto::CheckChannelResponse* response) const;
  // Whether the last channel set up to receive from `task` found that it writes GPU memory
  // directly (its ChannelEnd's device_writes); before any, what its probe said (NoteProbedPeer).
  bool PeerWritesDevice(const std::string& task) const;
  // What `task` said of itself when probed (Server::WaitForPeers): whether it writes GPU memory
  // directly. A channel's answer, once there is one, takes precedence.
  void NoteProbedPeer(const std::string& task, bool device_writes);
  // Any thread but the progress thread: sets up channels to every peer task, waiting up to
  // `timeout`. The error names the tasks whose channel could not be set up and why.
  absl::Status ConnectPeers(absl::Duration timeout);

 private:
  void AssertOnLoop() const;
  // The answer to channel `id`'s Connect (an error: the call failed).
  void OnConnectAnswer(uint64_t id, absl::StatusOr<proto::ConnectResponse> answer);
  // FailedPrecondition naming both tasks when `task`'s control messages use another layout.
  absl::Status CheckWireVersion(const std::string& task, uint32_t version) const;
  void RecordConnectResult(const std::string& task, const absl::Status& status);
  // The fabric a new channel to `task` uses: the same-host one for a task of same_host_tasks
  // that has not turned out to be elsewhere, else the one that reaches every peer.
  FabricContext& ContextFor(const std::string& task) const;

  const Options options_;
  FabricContexts* const fabrics_;
  // The primary context's env: what every channel shares (the worker, the mode, the host).
  ChannelEnv* const env_;
  ChannelTable* const table_;
  ProgressEngine* const engine_;

  // Progress-thread state.
  LandedStore landed_;
  // Owner channels whose Connect has not been answered.
  absl::flat_hash_set<uint64_t> connecting_;
  // Tasks of same_host_tasks whose end refused the same-host fabric (another host after all):
  // their channels go over the network fabric from then on.
  absl::flat_hash_set<std::string> elsewhere_;

  // Set-up results for ConnectPeers, written by the progress thread.
  mutable Mutex connect_mu_;
  absl::flat_hash_map<std::string, absl::Status> connect_results_ ABSL_GUARDED_BY(connect_mu_);
  // Whether a task writes GPU memory directly: what its probe said until a channel to receive
  // from it has been set up (or tried), then what that channel's answer said.
  struct PeerWrites {
    bool device = false;
    bool channeled = false;
  };
  absl::flat_hash_map<std::string, PeerWrites> peer_writes_ ABSL_GUARDED_BY(connect_mu_);
};

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_PEER_CHANNELS_H_
