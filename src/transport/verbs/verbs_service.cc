#include "src/transport/verbs/verbs_service.h"

#include "src/rpc/grpc_util.h"

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
  protocol::ProgressEngine::Task task = [this, request, response, reactor]() mutable {
    channels_->CheckChannel(*request, response);
    reactor->Finish(grpc::Status::OK);
  };
  if (!engine_->Post(task)) reactor->Finish(ShuttingDown());
  return reactor;
}

}  // namespace tensorverbs::verbs
