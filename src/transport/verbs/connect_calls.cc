#include "src/transport/verbs/connect_calls.h"

#include <utility>

#include "absl/time/clock.h"
#include "src/common/logging.h"
#include "src/rpc/grpc_util.h"

namespace tensorverbs::verbs {

ConnectCalls::ConnectCalls(absl::Duration connect_timeout, protocol::ProgressEngine* engine,
                           VerbsStubs* stubs)
    : connect_timeout_(connect_timeout), engine_(engine), stubs_(stubs) {}

void ConnectCalls::Connect(const std::string& task, const std::string& address,
                           const proto::ConnectRequest& request,
                           protocol::ChannelHost::ConnectAnswered answered) {
  DCHECK(engine_->OnOwnerThread()) << "a grpc+verbs set-up call made off the progress thread";
  const uint64_t id = request.channel_id();
  std::shared_ptr<proto::VerbsService::Stub> stub = stubs_->Get(task, address);
  auto call = std::make_unique<Call>();
  call->request = request;
  call->answered = std::move(answered);
  call->context.set_deadline(absl::ToChronoTime(absl::Now() + connect_timeout_));
  call->context.set_wait_for_ready(true);
  Call* c = call.get();
  calls_[id] = std::move(call);
  in_flight_.fetch_add(1);
  stub->async()->Connect(&c->context, &c->request, &c->response, [this, id](grpc::Status s) {
    engine_->Post([this, id, s]() mutable { Finish(id, s); });
    in_flight_.fetch_sub(1);
  });
}

void ConnectCalls::Finish(uint64_t id, const grpc::Status& status) {
  auto node = calls_.extract(id);
  if (node.empty()) return;
  std::unique_ptr<Call> call = std::move(node.mapped());
  if (status.ok()) {
    std::move(call->answered)(std::move(call->response));
  } else {
    std::move(call->answered)(rpc::FromGrpcStatus(status));
  }
}

void ConnectCalls::CancelAll() {
  DCHECK(engine_->OnOwnerThread());
  for (auto& [id, call] : calls_) call->context.TryCancel();
}

void ConnectCalls::Shutdown(absl::Duration timeout) {
  // Cancelled calls finish promptly; their callbacks only touch in_flight_ once the engine
  // refuses posts.
  const absl::Time deadline = absl::Now() + timeout;
  while (in_flight_.load() > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  calls_.clear();
}

}  // namespace tensorverbs::verbs
