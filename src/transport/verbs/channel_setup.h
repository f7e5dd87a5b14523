// ChannelSetup: how the grpc+verbs transport's channels are set up, over gRPC. The channels
// themselves are in the protocol layer's ChannelTable (protocol/channel_table.h), which the
// transport owns; this adds the channels it sets up there.
//
// The receiving task owns a channel per peer it receives from. OwnerChannel creates it on first
// use and calls the peer's VerbsService.Connect with its endpoint address and message-buffer
// key; the answer connects it (OnConnectDone). The peer's Accept checks fabric, protocol, wire
// version and incarnation, replaces any older channel from that task, and answers with its own
// end. Each channel's fabric context (protocol/fabric_contexts.h) is chosen here, per peer: with a
// same-host fabric beside the network one, a peer of Options::same_host_tasks gets the first. Both
// ends check that they share the host (fabric::ThisHostIdentity) before a same-host channel stands;
// where they do not, the acceptor refuses the fabric (ConnectResponse::refused), and the owner logs
// it once and sets the channel up again over the network fabric. CheckChannel answers the owner's
// liveness probes, from the table (which keeps why an accepted channel closed, so the owner's probe
// learns it).
//
// Threading: everything but ConnectPeers and WaitForCallbacks runs on the transport's progress
// thread (the engine's owner thread), which owns the channels. ConnectPeers waits on another
// thread; gRPC completion callbacks only post to the engine. The owner (VerbsTransport) outlives
// it and destroys it after the engine stopped.
#ifndef TENSORVERBS_TRANSPORT_VERBS_CHANNEL_SETUP_H_
#define TENSORVERBS_TRANSPORT_VERBS_CHANNEL_SETUP_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/verbs.grpc.pb.h"
#include "src/common/mutex.h"
#include "src/protocol/channel.h"
#include "src/protocol/channel_table.h"
#include "src/protocol/fabric_contexts.h"
#include "src/protocol/progress_engine.h"
#include "src/transport/verbs/verbs_stubs.h"

namespace tensorverbs::verbs {

class ChannelSetup {
 public:
  struct Options {
    absl::flat_hash_map<std::string, std::string> task_addresses;  // every task of the cluster
    absl::Duration connect_timeout = absl::Seconds(60);
    // The peers whose channels this task sets up over the same-host fabric (when it has one).
    absl::flat_hash_set<std::string> same_host_tasks;
    // The tasks this task holds something else for (grpc+gdr's lent tensors): their accepted
    // channels are then probed too. Null: none.
    std::function<absl::flat_hash_set<std::string>()> lent_to;
    // `task` stopped answering the probes of the channel it owns towards this one: what this
    // task keeps for it alone (lent tensors) can go. Null: nothing to do.
    std::function<void(const std::string& task)> peer_gone;
  };

  // `fabrics`: the transport's open fabrics, whose envs the channels use (built, not empty).
  ChannelSetup(Options options, protocol::FabricContexts* fabrics, protocol::ChannelTable* table,
               protocol::ProgressEngine* engine, VerbsStubs* stubs);
  ChannelSetup(const ChannelSetup&) = delete;
  ChannelSetup& operator=(const ChannelSetup&) = delete;

  // Progress thread.
  // The ready or connecting channel that receives from `task`, set up now if there is none.
  absl::StatusOr<protocol::Channel*> OwnerChannel(const std::string& task);
  // The acceptor's side of Connect.
  absl::Status Accept(const proto::ConnectRequest& request, proto::ConnectResponse* response);
  // The acceptor's side of a liveness probe.
  void CheckChannel(const proto::CheckChannelRequest& request,
                    proto::CheckChannelResponse* response);
  // Whether a set-up call for channel `id` is still in flight (its callback names it by id,
  // so the table keeps it even closed).
  bool SettingUp(uint64_t id) const { return connecting_.contains(id); }
  // Cancels the set-up calls in flight (the transport is shutting down).
  void CancelConnects();
  // What the watchdog probes: owner channels with recvs or reads pending (one still being set up
  // too, `connecting`, for whether its peer answers at all), and accepted channels that hold
  // something for their peer (`accepting`), so a receiver that died does not pin it.
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
  };
  std::vector<Probe> PendingPeers() const;
  // A probe found `task` silent: see Options::peer_gone.
  void PeerGone(const std::string& task) {
    if (options_.peer_gone) options_.peer_gone(task);
  }
  // Whether the last channel set up to receive from `task` found that it writes GPU memory
  // directly (its ChannelEnd's device_writes). Any thread.
  bool PeerWritesDevice(const std::string& task) const;

  // Any thread but the progress thread: sets up channels to every peer task, waiting up to
  // `timeout`. The error names the tasks whose channel could not be set up and why.
  absl::Status ConnectPeers(const std::string& self, absl::Duration timeout);
  // After the engine stopped: waits (up to `timeout`) for set-up calls still in flight, whose
  // callbacks refer to this object.
  void Shutdown(absl::Duration timeout);

 private:
  void AssertOnLoop() const;
  void OnConnectDone(uint64_t channel_id, const grpc::Status& status);
  // FailedPrecondition naming both tasks when `task`'s control messages use another layout.
  absl::Status CheckWireVersion(const std::string& task, uint32_t version) const;
  void RecordConnectResult(const std::string& task, const absl::Status& status);

  // The fabric a new channel to `task` uses: the same-host one for a task of same_host_tasks
  // that has not turned out to be elsewhere, else the one that reaches every peer.
  protocol::FabricContext& ContextFor(const std::string& task) const;

  const Options options_;
  protocol::FabricContexts* const fabrics_;
  // The primary context's env: what every channel shares (the worker, the mode).
  const protocol::ChannelEnv* const env_;
  protocol::ChannelTable* const table_;
  protocol::ProgressEngine* const engine_;
  VerbsStubs* const stubs_;

  // Progress-thread state.
  struct Connecting {
    grpc::ClientContext context;
    proto::ConnectRequest request;
    proto::ConnectResponse response;
  };
  absl::flat_hash_map<uint64_t, std::unique_ptr<Connecting>> connecting_;
  // Tasks of same_host_tasks whose end refused the same-host fabric (another host after all):
  // their channels go over the network fabric from then on.
  absl::flat_hash_set<std::string> elsewhere_;

  std::atomic<int> connects_in_flight_{0};
  // Set-up results for ConnectPeers, written by the progress thread.
  mutable Mutex connect_mu_;
  absl::flat_hash_map<std::string, absl::Status> connect_results_ ABSL_GUARDED_BY(connect_mu_);
  absl::flat_hash_map<std::string, bool> peer_device_writes_ ABSL_GUARDED_BY(connect_mu_);
};

}  // namespace tensorverbs::verbs

#endif  // TENSORVERBS_TRANSPORT_VERBS_CHANNEL_SETUP_H_
