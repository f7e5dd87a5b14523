#include "src/transport/grpc/grpc_rendezvous.h"

#include <grpcpp/impl/codegen/proto_utils.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/worker.pb.h"
#include "src/common/logging.h"
#include "src/transport/grpc/grpc_util.h"
#include "src/transport/grpc/tensor_coding.h"

namespace tensorverbs::grpc_transport {
namespace {

std::atomic<int64_t> next_request_id{1};

}  // namespace

struct GrpcRemoteRendezvous::Call {
  grpc::ClientContext context;
  grpc::ByteBuffer request;
  grpc::ByteBuffer response;
  RecvDoneCallback done;
  Allocator* allocator = nullptr;
  WorkerClient* worker = nullptr;
  std::string key;
};

GrpcRemoteRendezvous::GrpcRemoteRendezvous(const WorkerEnv* env, int64_t step_id,
                                           GrpcWorkerCache* workers, absl::Duration recv_timeout)
    : RemoteRendezvous(env, step_id), workers_(workers), recv_timeout_(recv_timeout) {}

void GrpcRemoteRendezvous::RecvFromRemoteAsync(const ParsedKey& key, const RecvArgs& args,
                                               RecvDoneCallback done) {
  absl::StatusOr<WorkerClient*> worker = workers_->Get(key.src.TaskName());
  if (!worker.ok()) {
    std::move(done)(absl::Status(worker.status().code(),
                                 absl::StrCat("recv of '", key.full_key, "': ",
                                              worker.status().message())),
                    Tensor(), false);
    return;
  }
  auto call = std::make_unique<Call>();
  call->done = std::move(done);
  call->allocator = args.allocator ? args.allocator : env_->recv_allocator;
  call->worker = *worker;
  call->key = key.full_key;
  call->context.set_deadline(absl::ToChronoTime(absl::Now() + recv_timeout_));
  call->context.set_wait_for_ready(true);

  proto::RecvTensorRequest request;
  request.set_step_id(step_id());
  request.set_rendezvous_key(key.full_key);
  request.set_request_id(next_request_id.fetch_add(1, std::memory_order_relaxed));
  bool own_buffer;
  grpc::Status ser = grpc::SerializationTraits<proto::RecvTensorRequest>::Serialize(
      request, &call->request, &own_buffer);
  if (!ser.ok()) {
    std::move(call->done)(FromGrpcStatus(ser), Tensor(), false);
    return;
  }

  Call* raw = call.get();
  bool aborted;
  {
    MutexLock lock(&mu_);
    aborted = aborted_;
    if (!aborted) active_.insert(raw);
  }
  if (aborted) {
    std::move(call->done)(status(), Tensor(), false);
    return;
  }
  call.release();  // owned by the completion below
  workers_->CallStarted();
  raw->worker->RecvTensorAsync(
      &raw->context, &raw->request, &raw->response,
      [self = shared_from_this(), raw](grpc::Status s) {
        std::unique_ptr<Call> call(raw);
        {
          MutexLock lock(&self->mu_);
          self->active_.erase(raw);
        }
        absl::Status status;
        ParsedResponse parsed;
        if (!s.ok()) {
          absl::Status aborted = self->status();
          if (s.error_code() == grpc::StatusCode::CANCELLED && !aborted.ok()) {
            status = aborted;
          } else {
            status = call->worker->CallError("RecvTensor", s, self->recv_timeout_);
            status = absl::Status(status.code(),
                                  absl::StrCat(status.message(), " (key '", call->key, "')"));
          }
        } else {
          status = ParseRecvTensorResponse(&call->response, call->allocator, &parsed);
          if (!status.ok()) {
            status = absl::Status(status.code(), absl::StrCat("from task ", call->worker->task_name(),
                                                              ": ", status.message()));
          }
        }
        // Free gRPC's copy of the bytes before handing the tensor on.
        call->response.Clear();
        Executor* executor = self->env().callback_executor;
        auto finish = [done = std::move(call->done), status, parsed = std::move(parsed)]() mutable {
          std::move(done)(status, parsed.tensor, parsed.is_dead);
        };
        if (executor != nullptr) {
          executor->Schedule(std::move(finish));
        } else {
          finish();
        }
        self->workers_->CallDone();
      });
}

void GrpcRemoteRendezvous::AbortRemote(const absl::Status& status) {
  MutexLock lock(&mu_);
  aborted_ = true;
  // TryCancel is thread-safe; the completion waits for mu_ before freeing the call.
  for (Call* call : active_) call->context.TryCancel();
}

}  // namespace tensorverbs::grpc_transport
