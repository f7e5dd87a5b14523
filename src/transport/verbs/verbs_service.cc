#include "src/transport/verbs/verbs_service.h"

#include "src/rpc/grpc_util.h"
#include "src/rpc/security.h"

namespace tensorverbs::verbs {
namespace {

const grpc::Status& ShuttingDown() {
  static const grpc::Status* status =
      new grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down");
  return *status;
}

}  // namespace

grpc::ServerUnaryReactor* VerbsServiceImpl::Connect(grpc::CallbackServerContext* context,
                                                    const proto::ConnectRequest* request,
                                                    proto::ConnectResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // With authentication on, a task connects only as itself.
  std::string caller;
  grpc::Status allowed = security_->Authenticate(*context, &caller);
  if (allowed.ok()) {
    allowed =
        rpc::RpcSecurity::CheckCallerIs(caller, request->task_name(), "connect as another task");
  }
  if (!allowed.ok()) {
    reactor->Finish(allowed);
    return reactor;
  }
  protocol::ProgressEngine::Task task = [this, request, response, reactor]() mutable {
    reactor->Finish(rpc::ToGrpcStatus(channels_->Accept(*request, response)));
  };
  if (!engine_->Post(task)) reactor->Finish(ShuttingDown());
  return reactor;
}

grpc::ServerUnaryReactor* VerbsServiceImpl::CheckChannel(grpc::CallbackServerContext* context,
                                                         const proto::CheckChannelRequest* request,
                                                         proto::CheckChannelResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  std::string caller;
  grpc::Status allowed = security_->Authenticate(*context, &caller);
  if (allowed.ok()) {
    allowed = rpc::RpcSecurity::CheckCallerIs(caller, request->task_name(),
                                              "probe another task's channel");
  }
  if (!allowed.ok()) {
    reactor->Finish(allowed);
    return reactor;
  }
  if (request->reachable_only()) {
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  // Answered here, from the channel table, while the progress loop moves: a loop busy with
  // hundreds of peers (256 tasks on two cores) answered probes queued behind its work past the
  // peer timeout, and the prober closed a live channel. A loop that stopped turning is asked
  // on the loop itself, where the probe goes unanswered as a wedged task should.
  if (engine_->TurnedWithin(probe_answer_limit_)) {
    channels_->CheckChannel(*request, response);
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  protocol::ProgressEngine::Task task = [this, request, response, reactor]() mutable {
    channels_->CheckChannel(*request, response);
    reactor->Finish(grpc::Status::OK);
  };
  if (!engine_->Post(task)) reactor->Finish(ShuttingDown());
  return reactor;
}

}  // namespace tensorverbs::verbs
