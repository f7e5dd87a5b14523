#include "src/transport/grpc/recv_tensor_handler.h"

#include <grpcpp/impl/codegen/proto_utils.h>

#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "src/common/mutex.h"
#include "absl/time/clock.h"
#include "proto/worker.pb.h"
#include "src/common/logging.h"
#include "src/rpc/grpc_util.h"
#include "src/rpc/security.h"
#include "src/transport/grpc/tensor_coding.h"

namespace tensorverbs::grpc_transport {
namespace {

// Owns itself until gRPC calls OnDone. Once Finish has been called the reactor may be deleted
// at any moment, so what the recv callback, Start and OnCancel share lives in a separate State.
class RecvTensorReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit RecvTensorReactor(grpc::ByteBuffer* response)
      : state_(std::make_shared<State>()), response_(response) {}

  // Starts the local recv in `rendezvous`. Touches nothing of `this` after RecvLocalAsync.
  // With a `lender`, a large POD tensor is lent to `requester` instead of sent.
  void Start(std::shared_ptr<RemoteRendezvous> rendezvous, const ParsedKey& key,
             protocol::TensorLender* lender, std::string requester) {
    std::shared_ptr<State> state = state_;
    {
      MutexLock lock(&state->mu);
      state->rendezvous = rendezvous;
    }
    grpc::ByteBuffer* response = response_;
    uint64_t token = rendezvous->RecvLocalAsync(
        key, [this, response, lender, requester = std::move(requester)](
                 const absl::Status& s, const Tensor& tensor, bool is_dead) {
          if (!s.ok()) {
            Finish(rpc::ToGrpcStatus(s));
            return;
          }
          const int64_t micros = absl::ToUnixMicros(absl::Now());
          if (lender == nullptr || is_dead || !tensor.CanMemCopy() ||
              tensor.TotalBytes() <= kDmaMinBytes) {
            EncodeRecvTensorResponse(tensor, is_dead, micros, response);
            Finish(grpc::Status::OK);
            return;
          }
          lender->Lend(requester, tensor,
                       [this, response, tensor, micros](absl::StatusOr<protocol::RemoteTensorRef> ref) {
                         if (ref.ok()) {
                           EncodeRecvTensorResponse(tensor, false, micros, response, &*ref);
                         } else {
                           // The tensor cannot be lent (shutting down, no registrable
                           // memory): it goes inline, as over grpc.
                           EncodeRecvTensorResponse(tensor, false, micros, response);
                         }
                         Finish(grpc::Status::OK);
                       });
        });
    bool cancel_now = false;
    {
      MutexLock lock(&state->mu);
      state->token = token;
      cancel_now = state->cancelled && token != 0;
    }
    // OnCancel ran before the token was known: withdraw the recv now.
    if (cancel_now) CancelRecv(*state, token);
  }

  void FinishNow(const absl::Status& s) { Finish(rpc::ToGrpcStatus(s)); }

  void OnCancel() override {
    std::shared_ptr<State> state = state_;
    uint64_t token;
    {
      MutexLock lock(&state->mu);
      state->cancelled = true;
      token = state->token;
    }
    if (token != 0) CancelRecv(*state, token);
  }

  // The call counts against `budget` for `receiver` until it is done.
  void HoldBudget(std::shared_ptr<RecvTensorBudget> budget, std::string receiver) {
    budget_ = std::move(budget);
    budget_receiver_ = std::move(receiver);
  }

  void OnDone() override {
    if (budget_ != nullptr) budget_->Release(budget_receiver_);
    delete this;
  }

 private:
  struct State {
    Mutex mu;
    std::shared_ptr<RemoteRendezvous> rendezvous ABSL_GUARDED_BY(mu);
    uint64_t token ABSL_GUARDED_BY(mu) = 0;
    bool cancelled ABSL_GUARDED_BY(mu) = false;
  };

  // Runs the recv callback (and so Finish) only if the recv was still waiting.
  static void CancelRecv(State& state, uint64_t token) {
    std::shared_ptr<RemoteRendezvous> r;
    {
      MutexLock lock(&state.mu);
      r = state.rendezvous;
    }
    r->CancelLocalRecv(token, absl::CancelledError("RecvTensor cancelled by the caller"));
  }

  const std::shared_ptr<State> state_;
  grpc::ByteBuffer* const response_;
  std::shared_ptr<RecvTensorBudget> budget_;
  std::string budget_receiver_;
};

}  // namespace

const std::string& RecvTensorBudget::Bucket(const std::string& receiver) const {
  static const std::string* const kOutside = new std::string("(a task outside the cluster)");
  return tasks_.contains(receiver) ? receiver : *kOutside;
}

absl::Status RecvTensorBudget::Acquire(const std::string& receiver) {
  const std::string& bucket = Bucket(receiver);
  MutexLock lock(&mu_);
  int& held = held_[bucket];
  if (held >= max_per_task_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        held, " RecvTensor calls for ", bucket, " are waiting here already (TENSORVERBS_MAX_RESPONSES=",
        max_per_task_, "); send the tensors they wait for, or raise the variable"));
  }
  ++held;
  return absl::OkStatus();
}

void RecvTensorBudget::Release(const std::string& receiver) {
  const std::string& bucket = Bucket(receiver);
  MutexLock lock(&mu_);
  auto it = held_.find(bucket);
  if (it == held_.end()) return;
  if (--it->second <= 0) held_.erase(it);
}

int RecvTensorBudget::Held(const std::string& receiver) const {
  MutexLock lock(&mu_);
  auto it = held_.find(Bucket(receiver));
  return it == held_.end() ? 0 : it->second;
}

grpc::ServerUnaryReactor* HandleRecvTensor(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response, RendezvousMgr* mgr,
                                           const WorkerEnv* env, const std::string& caller,
                                           protocol::TensorLender* lender,
                                           std::shared_ptr<RecvTensorBudget> budget) {
  auto* reactor = new RecvTensorReactor(response);
  proto::RecvTensorRequest req;
  grpc::ByteBuffer copy(*request);  // shares slices; the parser consumes its own reader
  grpc::Status parsed = grpc::SerializationTraits<proto::RecvTensorRequest>::Deserialize(&copy, &req);
  if (!parsed.ok()) {
    reactor->FinishNow(absl::InvalidArgumentError(
        absl::StrCat("RecvTensor on task ", env->task_name, ": unparsable request")));
    return reactor;
  }
  absl::StatusOr<ParsedKey> key = ParsedKey::Parse(req.rendezvous_key());
  if (!key.ok()) {
    reactor->FinishNow(absl::InvalidArgumentError(
        absl::StrCat("RecvTensor on task ", env->task_name, ": ", key.status().message())));
    return reactor;
  }
  if (key->src.TaskName() != env->task_name) {
    reactor->FinishNow(absl::InvalidArgumentError(absl::StrCat(
        "RecvTensor on task ", env->task_name, ": key '", key->full_key,
        "' names source task ", key->src.TaskName(), ", not this one")));
    return reactor;
  }
  if (key->src_incarnation != env->incarnation) {
    reactor->FinishNow(absl::AbortedError(absl::StrFormat(
        "RecvTensor on task %s: key '%s' was made for incarnation %016x of this task, but it now "
        "runs incarnation %016x: the task was probably restarted; rebuild keys from its new "
        "incarnation",
        env->task_name, key->full_key, key->src_incarnation, env->incarnation)));
    return reactor;
  }
  // With authentication on, a task receives only the tensors sent to it.
  if (grpc::Status allowed = rpc::RpcSecurity::CheckCallerIs(
          caller, key->dst.TaskName(), absl::StrCat("receive '", key->full_key, "'"));
      !allowed.ok()) {
    reactor->FinishNow(rpc::FromGrpcStatus(allowed));
    return reactor;
  }
  if (req.dma_ok()) {
    if (grpc::Status allowed = rpc::RpcSecurity::CheckCallerIs(
            caller, req.requester(), "have tensors lent to another task");
        !allowed.ok()) {
      reactor->FinishNow(rpc::FromGrpcStatus(allowed));
      return reactor;
    }
  }
  // Counted before the step is looked up, so a refused call starts no step.
  if (budget != nullptr) {
    const std::string receiver = key->dst.TaskName();
    if (absl::Status s = budget->Acquire(receiver); !s.ok()) {
      reactor->FinishNow(absl::Status(
          s.code(), absl::StrCat("RecvTensor on task ", env->task_name, " for key '",
                                 key->full_key, "': ", s.message())));
      return reactor;
    }
    reactor->HoldBudget(std::move(budget), receiver);  // released when the call is done
  }
  absl::StatusOr<std::shared_ptr<RemoteRendezvous>> r = mgr->FindForPeer(req.step_id());
  if (!r.ok()) {
    reactor->FinishNow(absl::Status(
        r.status().code(), absl::StrCat("RecvTensor on task ", env->task_name, " for key '",
                                        key->full_key, "': ", r.status().message())));
    return reactor;
  }
  VLOG(2) << "RecvTensor step " << req.step_id() << " key " << key->full_key;
  reactor->Start(*std::move(r), *key, req.dma_ok() ? lender : nullptr, req.requester());
  return reactor;
}

}  // namespace tensorverbs::grpc_transport
