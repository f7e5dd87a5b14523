// VerbsServiceImpl: the gRPC service a grpc+verbs task serves on its port for its peers:
// Connect (channel set-up) and CheckChannel (liveness probes). Each call runs on a gRPC
// callback thread. Connect only posts the work to the progress thread (PeerChannels owns the
// channels there) and returns; CheckChannel is answered on the callback thread from the
// channel table while the loop moves, and posted like Connect when it does not; the reactor
// finishes once, with the answer, or with Unavailable when the transport is shutting down.
// Registered on the server's builder before it starts; outlives the gRPC server's shutdown.
#ifndef TENSORVERBS_TRANSPORT_VERBS_VERBS_SERVICE_H_
#define TENSORVERBS_TRANSPORT_VERBS_VERBS_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include "proto/verbs.grpc.pb.h"
#include "src/protocol/peer_channels.h"
#include "src/protocol/progress_engine.h"
#include "src/rpc/security.h"

namespace tensorverbs::verbs {

class VerbsServiceImpl final : public proto::VerbsService::CallbackService {
 public:
  // Every call is authenticated with `security` first (rpc/security.h). A liveness probe is
  // answered off the progress loop while the loop made a turn within `probe_answer_limit`
  // (half the peer timeout), on it otherwise.
  VerbsServiceImpl(protocol::ProgressEngine* engine, protocol::PeerChannels* channels,
                   std::shared_ptr<const rpc::RpcSecurity> security,
                   absl::Duration probe_answer_limit)
      : engine_(engine),
        channels_(channels),
        security_(std::move(security)),
        probe_answer_limit_(probe_answer_limit) {}

  grpc::ServerUnaryReactor* Connect(grpc::CallbackServerContext* context,
                                    const proto::ConnectRequest* request,
                                    proto::ConnectResponse* response) override;
  grpc::ServerUnaryReactor* CheckChannel(grpc::CallbackServerContext* context,
                                         const proto::CheckChannelRequest* request,
                                         proto::CheckChannelResponse* response) override;

 private:
  protocol::ProgressEngine* const engine_;
  protocol::PeerChannels* const channels_;
  const std::shared_ptr<const rpc::RpcSecurity> security_;
  const absl::Duration probe_answer_limit_;
};

}  // namespace tensorverbs::verbs

#endif  // TENSORVERBS_TRANSPORT_VERBS_VERBS_SERVICE_H_
