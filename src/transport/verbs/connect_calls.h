// ConnectCalls: the channel set-up calls (VerbsService.Connect) this task has in flight. The
// protocol decides everything about a channel (protocol/peer_channels.h: which fabric, the
// request, what the answer means); the transport carries its request to the peer here, through
// its ChannelHost::Connect, and posts the answer back to the progress thread.
//
// Threading: Connect and CancelAll run on the progress thread, which owns the calls; gRPC's
// completion callbacks only post to the engine. Shutdown runs after the engine stopped, on the
// thread that tears the transport down, which outlives this object and destroys it last.
#ifndef TENSORVERBS_TRANSPORT_VERBS_CONNECT_CALLS_H_
#define TENSORVERBS_TRANSPORT_VERBS_CONNECT_CALLS_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "proto/verbs.grpc.pb.h"
#include "src/protocol/channel_env.h"
#include "src/protocol/progress_engine.h"
#include "src/transport/verbs/verbs_stubs.h"

namespace tensorverbs::verbs {

class ConnectCalls {
 public:
  // Each call waits for its peer's server (wait-for-ready) up to `connect_timeout`.
  ConnectCalls(absl::Duration connect_timeout, protocol::ProgressEngine* engine, VerbsStubs* stubs);
  ConnectCalls(const ConnectCalls&) = delete;
  ConnectCalls& operator=(const ConnectCalls&) = delete;

  // Progress thread: ChannelHost::Connect.
  void Connect(const std::string& task, const std::string& address,
               const proto::ConnectRequest& request,
               protocol::ChannelHost::ConnectAnswered answered);
  // Progress thread: cancels the calls in flight (the transport is shutting down).
  void CancelAll();
  // After the engine stopped: waits (up to `timeout`) for calls still in flight, whose
  // callbacks refer to this object, and drops their answers.
  void Shutdown(absl::Duration timeout);

 private:
  struct Call {
    grpc::ClientContext context;
    proto::ConnectRequest request;
    proto::ConnectResponse response;
    protocol::ChannelHost::ConnectAnswered answered;
  };
  // Progress thread: the call of channel `id` ended with `status`.
  void Finish(uint64_t id, const grpc::Status& status);

  const absl::Duration connect_timeout_;
  protocol::ProgressEngine* const engine_;
  VerbsStubs* const stubs_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Call>> calls_;  // progress thread, by channel id
  std::atomic<int> in_flight_{0};
};

}  // namespace tensorverbs::verbs

#endif  // TENSORVERBS_TRANSPORT_VERBS_CONNECT_CALLS_H_
