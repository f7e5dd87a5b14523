#include "src/transport/grpc/worker_client.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "src/common/logging.h"
#include "src/rendezvous/remote_rendezvous.h"
#include "src/rpc/grpc_util.h"

namespace tensorverbs::grpc_transport {
namespace {

// Whether this process can open no more descriptors (EMFILE, or ENFILE system-wide).
bool OutOfDescriptors() {
  const int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    close(fd);
    return false;
  }
  return errno == EMFILE || errno == ENFILE;
}

}  // namespace

WorkerClient::WorkerClient(std::string task_name, std::string address,
                           const rpc::RpcSecurity& security, uint64_t max_answer_bytes,
                           absl::Duration peer_timeout)
    : task_name_(std::move(task_name)), address_(std::move(address)) {
  rpc::PinGrpcCallbackQueue();
  channel_ =
      security.NewChannel(address_, rpc::ClientChannelArguments(max_answer_bytes, peer_timeout));
  stub_ = proto::WorkerService::NewStub(channel_);
  generic_stub_ = std::make_unique<grpc::GenericStub>(channel_);
}

void WorkerClient::RecvTensorAsync(std::shared_ptr<grpc::ClientContext> context,
                                   const grpc::ByteBuffer* request, grpc::ByteBuffer* response,
                                   std::string key, int64_t step_id,
                                   std::function<void(grpc::Status)> done) {
  grpc::ClientContext* const raw = context.get();
  {
    MutexLock lock(&waiting_mu_);
    waiting_.emplace(raw, Waiting{std::move(context), absl::Now(), std::move(key), step_id});
  }
  generic_stub_->UnaryCall(
      raw, "/tensorverbs.proto.WorkerService/RecvTensor", grpc::StubOptions(), request, response,
      [this, raw, done = std::move(done)](grpc::Status status) {
        bool unreachable = false, out_of_descriptors = false;
        std::shared_ptr<grpc::ClientContext> held;  // released after `done`
        {
          MutexLock lock(&waiting_mu_);
          auto it = waiting_.find(raw);
          if (it != waiting_.end()) {
            unreachable = it->second.unreachable;
            out_of_descriptors = it->second.out_of_descriptors;
            held = std::move(it->second.context);
            waiting_.erase(it);
          }
        }
        if (unreachable && status.error_code() == grpc::StatusCode::CANCELLED) {
          // gRPC keeps why it could not connect to itself; a local cause worth naming is this
          // process running out of descriptors, where the peer is blameless.
          status = grpc::Status(
              grpc::StatusCode::UNAVAILABLE,
              out_of_descriptors
                  ? "no connection to the task within TENSORVERBS_PEER_TIMEOUT_MS, while this "
                    "process had no file descriptor left (raise `ulimit -n`)"
                  : "no connection to the task within TENSORVERBS_PEER_TIMEOUT_MS");
        }
        done(status);
      });
}

int WorkerClient::CancelIfUnreachable(absl::Time now, absl::Duration peer_timeout) {
  const bool ready = channel_->GetState(/*try_to_connect=*/false) == GRPC_CHANNEL_READY;
  std::vector<std::shared_ptr<grpc::ClientContext>> cancel;
  bool checked_descriptors = false, out_of_descriptors = false;
  {
    MutexLock lock(&waiting_mu_);
    if (ready) last_ready_ = now;
    if (ready) return 0;
    for (auto& [raw, waiting] : waiting_) {
      // Each call gets the whole peer timeout from its start, or from the last time the
      // connection was seen ready, whichever is later.
      if (waiting.unreachable || now - std::max(waiting.started, last_ready_) < peer_timeout) {
        continue;
      }
      waiting.unreachable = true;
      if (!checked_descriptors) {
        checked_descriptors = true;
        out_of_descriptors = OutOfDescriptors();
      }
      waiting.out_of_descriptors = out_of_descriptors;
      cancel.push_back(waiting.context);
    }
  }
  // Outside the lock: gRPC may run the call's callback inside TryCancel. The shared pointers
  // keep each context alive however its call ends meanwhile.
  for (const auto& context : cancel) context->TryCancel();
  return static_cast<int>(cancel.size());
}

void WorkerClient::WarnSlowRecvs(absl::Time now, absl::Duration threshold) {
  std::vector<std::string> warnings;
  {
    MutexLock lock(&waiting_mu_);
    for (auto& [raw, waiting] : waiting_) {
      if (waiting.slow_warned || now - waiting.started < threshold) continue;
      waiting.slow_warned = true;
      warnings.push_back(SlowRecvWarning(waiting.key, waiting.step_id, task_name_,
                                         now - waiting.started, threshold));
    }
  }
  for (const std::string& w : warnings) LOG(WARNING) << w;
}

absl::Status WorkerClient::CallError(absl::string_view method, const grpc::Status& status,
                                     absl::Duration timeout) {
  const std::string who = absl::StrCat(method, " to task ", task_name_, " at ", address_);
  switch (status.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
      return absl::UnavailableError(absl::StrCat(who, " failed: the task is unavailable (",
                                                 status.error_message(),
                                                 "); check that it is running and reachable"));
    case grpc::StatusCode::DEADLINE_EXCEEDED: {
      grpc_connectivity_state state = channel_->GetState(/*try_to_connect=*/false);
      if (state != GRPC_CHANNEL_READY) {
        return absl::UnavailableError(absl::StrCat(who, " failed: could not reach the task within ",
                                                   absl::FormatDuration(timeout),
                                                   "; check that it is running and reachable"));
      }
      return absl::DeadlineExceededError(
          absl::StrCat(who, " did not complete within ", absl::FormatDuration(timeout)));
    }
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      if (absl::StrContains(status.error_message(), "larger than max")) {
        return absl::ResourceExhaustedError(absl::StrCat(
            who, ": ", status.error_message(),
            ": the answer is larger than this task accepts; raise TENSORVERBS_MAX_TENSOR_MB if "
            "tensors this large are expected"));
      }
      [[fallthrough]];
    default:
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          absl::StrCat(who, ": ", status.error_message()));
  }
}

absl::StatusOr<proto::GetStatusResponse> WorkerClient::GetStatus(absl::Duration timeout) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  context.set_wait_for_ready(true);
  proto::GetStatusResponse response;
  grpc::Status s = stub_->GetStatus(&context, proto::GetStatusRequest(), &response);
  if (!s.ok()) return CallError("GetStatus", s, timeout);
  return response;
}

absl::Status WorkerClient::CleanupStep(int64_t step_id, absl::Duration timeout) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  proto::CleanupStepRequest request;
  request.set_step_id(step_id);
  proto::CleanupStepResponse response;
  grpc::Status s = stub_->CleanupStep(&context, request, &response);
  if (!s.ok()) return CallError("CleanupStep", s, timeout);
  return absl::OkStatus();
}

GrpcWorkerCache::GrpcWorkerCache(absl::flat_hash_map<std::string, std::string> addresses,
                                 std::shared_ptr<const rpc::RpcSecurity> security,
                                 uint64_t max_tensor_bytes, absl::Duration peer_timeout,
                                 absl::Duration slow_recv_warning)
    : addresses_(std::move(addresses)),
      security_(std::move(security)),
      max_tensor_bytes_(max_tensor_bytes),
      peer_timeout_(peer_timeout),
      slow_recv_warning_(slow_recv_warning) {
  if (peer_timeout_ > absl::ZeroDuration()) watch_ = std::thread([this] { Watch(); });
}

GrpcWorkerCache::~GrpcWorkerCache() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (watch_.joinable()) watch_.join();
}

void GrpcWorkerCache::Watch() {
  // A quarter of the timeout between looks: an unreachable peer fails its calls within 1.25
  // peer timeouts.
  const absl::Duration period =
      std::clamp(peer_timeout_ / 4, absl::Milliseconds(25), absl::Seconds(1));
  MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; },
                               period)) {
    const absl::Time now = absl::Now();
    for (auto& [task, client] : clients_) {
      if (slow_recv_warning_ > absl::ZeroDuration()) {
        client->WarnSlowRecvs(now, slow_recv_warning_);
      }
      if (int n = client->CancelIfUnreachable(now, peer_timeout_); n > 0) {
        LOG(WARNING) << "task " << task << " at " << client->address()
                     << " has not been reachable for " << absl::FormatDuration(peer_timeout_)
                     << " (TENSORVERBS_PEER_TIMEOUT_MS); failing " << n << " waiting recv(s)";
      }
    }
  }
}

absl::StatusOr<WorkerClient*> GrpcWorkerCache::Get(const std::string& task_name) {
  MutexLock lock(&mu_);
  auto it = clients_.find(task_name);
  if (it != clients_.end()) return it->second.get();
  auto addr = addresses_.find(task_name);
  if (addr == addresses_.end()) {
    return absl::NotFoundError(absl::StrCat("task ", task_name, " is not in the cluster spec"));
  }
  auto client =
      std::make_unique<WorkerClient>(task_name, addr->second, *security_,
                                     rpc::TensorAnswerLimit(max_tensor_bytes_), peer_timeout_);
  WorkerClient* raw = client.get();
  clients_.emplace(task_name, std::move(client));
  return raw;
}

void GrpcWorkerCache::CallStarted() {
  MutexLock lock(&calls_mu_);
  ++calls_;
}

void GrpcWorkerCache::CallDone() {
  MutexLock lock(&calls_mu_);
  --calls_;
}

void GrpcWorkerCache::AddDraining(std::weak_ptr<grpc::ClientContext> context) {
  MutexLock lock(&calls_mu_);
  // Those that finished since go first, so the list stays as long as the calls in flight.
  draining_.erase(std::remove_if(draining_.begin(), draining_.end(),
                                 [](const std::weak_ptr<grpc::ClientContext>& c) {
                                   return c.expired();
                                 }),
                  draining_.end());
  draining_.push_back(std::move(context));
}

void GrpcWorkerCache::CancelDraining() {
  std::vector<std::shared_ptr<grpc::ClientContext>> live;
  {
    MutexLock lock(&calls_mu_);
    for (const std::weak_ptr<grpc::ClientContext>& c : draining_) {
      if (std::shared_ptr<grpc::ClientContext> context = c.lock()) live.push_back(context);
    }
    draining_.clear();
  }
  // Outside the lock: gRPC may run the call's completion (which ends in CallDone) inside.
  for (const std::shared_ptr<grpc::ClientContext>& context : live) context->TryCancel();
}

bool GrpcWorkerCache::WaitForNoCalls(absl::Duration timeout) {
  MutexLock lock(&calls_mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(calls_mu_) { return calls_ == 0; };
  return calls_mu_.AwaitWithTimeout(idle, timeout);
}

}  // namespace tensorverbs::grpc_transport
