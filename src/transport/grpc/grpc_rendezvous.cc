#include "src/transport/grpc/grpc_rendezvous.h"

#include <grpcpp/impl/codegen/proto_utils.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/worker.pb.h"
#include "src/common/logging.h"
#include "src/common/trace.h"
#include "src/protocol/remote_tensor.h"
#include "src/rpc/grpc_util.h"
#include "src/transport/grpc/tensor_coding.h"

namespace tensorverbs::grpc_transport {
namespace {

std::atomic<int64_t> next_request_id{1};

// Runs a user callback on the worker's executor, or inline where there is none.
void RunCallback(Executor* executor, absl::AnyInvocable<void() &&> callback) {
  if (executor != nullptr) {
    executor->Schedule(std::move(callback));
  } else {
    std::move(callback)();
  }
}

}  // namespace

struct GrpcRemoteRendezvous::Call {
  grpc::ClientContext context;
  grpc::ByteBuffer request;
  grpc::ByteBuffer response;
  RecvDoneCallback done;
  Allocator* allocator = nullptr;
  WorkerClient* worker = nullptr;
  std::string key;
  RecvTrace trace;  // TENSORVERBS_TRACE
};

GrpcRemoteRendezvous::GrpcRemoteRendezvous(const WorkerEnv* env, int64_t step_id,
                                           GrpcWorkerCache* workers, absl::Duration recv_timeout,
                                           protocol::TensorPuller* puller)
    : RemoteRendezvous(env, step_id),
      workers_(workers),
      recv_timeout_(recv_timeout),
      puller_(puller) {}

void GrpcRemoteRendezvous::RecvFromRemoteAsync(const ParsedKey& key, const RecvArgs& args,
                                               RecvDoneCallback done) {
  absl::StatusOr<WorkerClient*> worker = workers_->Get(key.src.TaskName());
  if (!worker.ok()) {
    std::move(done)(
        absl::Status(worker.status().code(),
                     absl::StrCat("recv of '", key.full_key, "': ", worker.status().message())),
        Tensor(), false);
    return;
  }
  auto call = std::make_shared<Call>();
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
  if (puller_ != nullptr) {
    request.set_dma_ok(true);
    request.set_requester(env_->task_name);
  }
  bool own_buffer;
  grpc::Status ser = grpc::SerializationTraits<proto::RecvTensorRequest>::Serialize(
      request, &call->request, &own_buffer);
  if (!ser.ok()) {
    std::move(call->done)(rpc::FromGrpcStatus(ser), Tensor(), false);
    return;
  }

  bool aborted;
  {
    MutexLock lock(&mu_);
    aborted = aborted_;
    if (!aborted) active_.emplace(call.get(), call);
  }
  if (aborted) {
    std::move(call->done)(status(), Tensor(), false);
    return;
  }
  workers_->CallStarted();
  if (TraceEnabled()) {
    const char* protocol = puller_ != nullptr ? "grpc+gdr" : "grpc";
    call->trace = RecvTrace::Begin(
        TraceTrack(
            absl::StrCat(env_->task_name, " <- ", call->worker->task_name(), " (", protocol, ")")),
        call->key, step_id(), call->worker->task_name(), protocol, "awaiting response");
  }
  Call* raw = call.get();
  // The client holds the context, and through it the call, until the callback has run.
  std::shared_ptr<grpc::ClientContext> context(call, &call->context);
  raw->worker->RecvTensorAsync(
      std::move(context), &raw->request, &raw->response, raw->key, step_id(),
      [self = shared_from_this(), call = std::move(call)](grpc::Status s) mutable {
        RecvDoneCallback done;
        {
          MutexLock lock(&self->mu_);
          self->active_.erase(call.get());
          done = std::move(call->done);
          call->done = nullptr;
        }
        if (done == nullptr) {
          self->ReleaseDrained(*call, s);
          call.reset();
          self->workers_->CallDone();
          return;
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
          status = ParseRecvTensorResponse(&call->response, call->allocator,
                                           self->env().max_tensor_bytes, &parsed);
          if (status.ok() && parsed.has_remote && self->puller_ == nullptr) {
            status = absl::DataLossError("a remote tensor in answer to a request without dma_ok");
          }
          // The element bytes were copied once, out of gRPC's buffers into the tensor.
          if (status.ok() && !parsed.has_remote && parsed.tensor.TotalBytes() > 0) {
            if (TransferStats* stats = self->env().stats) {
              stats->copies.fetch_add(1, std::memory_order_relaxed);
              stats->copied_bytes.fetch_add(static_cast<int64_t>(parsed.tensor.TotalBytes()),
                                            std::memory_order_relaxed);
            }
          }
          if (!status.ok()) {
            status = absl::Status(status.code(),
                                  absl::StrCat("recv of '", call->key, "' from task ",
                                               call->worker->task_name(), ": ", status.message()));
            // Refused (too large, no memory, inconsistent): the sender lent the tensor for this
            // recv and is told at once to drop it.
            self->ReleaseUnread(*call, parsed);
          }
        }
        // Free gRPC's copy of the bytes before handing the tensor on.
        call->response.Clear();
        if (status.ok() && parsed.has_remote) {
          // grpc+gdr: the bytes wait at the sender; read them into the destination.
          const std::string task = call->worker->task_name();
          call->trace.Phase("reading");
          Tensor dest = parsed.tensor;
          std::string key = call->key;
          self->puller_->Pull(
              task, parsed.remote, dest,
              [self, done = std::move(done), dest, key,
               trace = std::move(call->trace)](const absl::Status& s) mutable {
                // A step aborted while the read was in flight still ends with the abort.
                absl::Status result = self->status().ok() ? s : self->status();
                if (!result.ok() && result.message().find(key) == absl::string_view::npos) {
                  result = absl::Status(result.code(),
                                        absl::StrCat(result.message(), " (key '", key, "')"));
                }
                trace.Phase("callback");
                RunCallback(self->env().callback_executor,
                            [done = EndTraceAfter(std::move(trace), std::move(done)), result,
                             dest]() mutable {
                              std::move(done)(result, result.ok() ? dest : Tensor(), false);
                            });
              });
          call.reset();
          self->workers_->CallDone();
          return;
        }
        call->trace.Phase("callback");
        RunCallback(self->env().callback_executor,
                    [done = EndTraceAfter(std::move(call->trace), std::move(done)), status,
                     parsed = std::move(parsed)]() mutable {
                      std::move(done)(status, parsed.tensor, parsed.is_dead);
                    });
        // Release the call (and its ClientContext) here, as gRPC expects, rather than whenever
        // gRPC destroys this functor: the context holds the call that owns the functor.
        call.reset();
        self->workers_->CallDone();
      });
}

void GrpcRemoteRendezvous::AbortRemote(const absl::Status& status) {
  std::vector<std::shared_ptr<Call>> cancel, draining;
  std::vector<RecvDoneCallback> ended;
  {
    MutexLock lock(&mu_);
    const bool again = aborted_;
    aborted_ = true;
    for (auto& [raw, call] : active_) {
      if (puller_ == nullptr || again) {
        cancel.push_back(call);
        continue;
      }
      // grpc+gdr: the sender may already have lent the tensor for this call, and only its
      // answer says under which key. Cancelling would lose that answer and pin the tensor at
      // the sender until its lease expires, so the recv ends now and the call drains: its
      // answer is released unread (ReleaseDrained). A second abort (the step's cleanup, or
      // shutdown through CancelDraining) cancels what still drains.
      if (call->done != nullptr) {
        ended.push_back(std::move(call->done));
        call->done = nullptr;
      }
      draining.push_back(call);
    }
  }
  for (const std::shared_ptr<Call>& call : draining) {
    workers_->AddDraining(std::shared_ptr<grpc::ClientContext>(call, &call->context));
  }
  for (RecvDoneCallback& done : ended) {
    RunCallback(env().callback_executor, [done = std::move(done), status]() mutable {
      std::move(done)(status, Tensor(), false);
    });
  }
  // Outside the lock: gRPC may run a call's completion (which takes mu_) inside TryCancel. The
  // shared_ptr keeps each call alive until its TryCancel has returned.
  for (const std::shared_ptr<Call>& call : cancel) call->context.TryCancel();
}

void GrpcRemoteRendezvous::ReleaseDrained(Call& call, const grpc::Status& s) {
  if (!s.ok()) return;  // no answer: nothing was lent for it
  ParsedResponse parsed;
  (void)ParseRecvTensorResponse(&call.response, call.allocator, env().max_tensor_bytes, &parsed);
  call.response.Clear();
  ReleaseUnread(call, parsed);
}

void GrpcRemoteRendezvous::ReleaseUnread(const Call& call, const ParsedResponse& parsed) {
  // Only a reference the sender could have made: anything else names no lease of this task's.
  if (puller_ == nullptr || !parsed.has_remote || parsed.remote.key.empty() ||
      parsed.remote.tensor_key > protocol::kMaxTensorKey) {
    return;
  }
  puller_->Pull(call.worker->task_name(), parsed.remote, Tensor(), [](const absl::Status&) {});
}

}  // namespace tensorverbs::grpc_transport
