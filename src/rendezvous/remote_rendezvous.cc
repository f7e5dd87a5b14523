#include "src/rendezvous/remote_rendezvous.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/common/mutex.h"
#include "src/rendezvous/device_staging.h"

namespace tensorverbs {

void TransferStats::AppendCounters(CounterList* out) const {
  AddCounter(out, Counter::kTensorsReceived, tensors);
  AddCounter(out, Counter::kBytesReceived, bytes);
  AddCounter(out, Counter::kRecvErrors, errors);
  AddCounter(out, Counter::kCopies, copies);
  AddCounter(out, Counter::kCopiedBytes, copied_bytes);
  AddCounter(out, Counter::kDeviceToHostCopies, device_to_host);
  AddCounter(out, Counter::kHostToDeviceCopies, host_to_device);
  AddCounter(out, Counter::kDeviceCopiedBytes, device_copied_bytes);
  AddCounter(out, Counter::kDeviceCopyErrors, device_copy_errors);
  AddCounter(out, Counter::kDeviceDirectSends, device_direct_sends);
  AddCounter(out, Counter::kDeviceDirectRecvs, device_direct_recvs);
}

absl::Status CheckReceivedTensorBytes(uint64_t bytes, uint64_t max_bytes) {
  if (bytes <= max_bytes) return absl::OkStatus();
  const std::string limit = max_bytes % (uint64_t{1} << 20) == 0
                                ? absl::StrCat(max_bytes >> 20, " MiB")
                                : absl::StrCat(max_bytes, " bytes");
  return absl::ResourceExhaustedError(absl::StrCat(
      "the peer announced a tensor of ", bytes, " bytes, more than this task accepts (", limit,
      "); raise TENSORVERBS_MAX_TENSOR_MB if tensors this large are expected"));
}

RemoteRendezvous::RemoteRendezvous(const WorkerEnv* env, int64_t step_id)
    : env_(env), step_id_(step_id), local_(env->keys, env->step_sizes) {}

std::string SlowRecvWarning(absl::string_view key, int64_t step_id, absl::string_view peer,
                            absl::Duration waited, absl::Duration threshold) {
  return absl::StrCat("recv of '", key, "' in step ", step_id, " from task ", peer, " has waited ",
                      absl::FormatDuration(absl::Trunc(waited, absl::Milliseconds(1))),
                      " (TENSORVERBS_SLOW_RECV_MS=", absl::ToInt64Milliseconds(threshold),
                      "): the task has not sent it yet, or cannot; it fails at "
                      "TENSORVERBS_RECV_TIMEOUT_MS");
}

absl::Status RemoteRendezvous::Send(const ParsedKey& key, const Tensor& value, bool is_dead) {
  if (!key.src.IsOnTask(env_->task_name)) {
    return absl::InvalidArgumentError(absl::StrCat("send of key '", key.full_key, "' on task ",
                                                   env_->task_name,
                                                   ": its source device is on another task"));
  }
  if (!key.dst.IsOnTask(env_->task_name) && !value.placement().host_accessible() &&
      (env_->device_copier == nullptr || !env_->device_copier->Handles(value.placement()))) {
    // Every protocol reads a sent tensor's bytes from host memory, which the copier stages it
    // into; without one a device pointer would crash the task that serves the request, later,
    // far from this call.
    return absl::FailedPreconditionError(absl::StrCat(
        "send of key '", key.full_key, "': the tensor is in ", value.placement().ToString(),
        " memory, and this task has no CUDA runtime driving that device to stage it for "
        "another task (`tensorverbs info` says why); copy it to the host first"));
  }
  return local_.Send(key, value, is_dead);
}

void RemoteRendezvous::RecvAsync(const ParsedKey& key, const RecvArgs& args,
                                 RecvDoneCallback done) {
  if (!key.dst.IsOnTask(env_->task_name)) {
    std::move(done)(absl::InvalidArgumentError(
                        absl::StrCat("recv of key '", key.full_key, "' on task ", env_->task_name,
                                     ": its destination device is on another task")),
                    Tensor(), false);
    return;
  }
  if (key.src.IsOnTask(env_->task_name)) {
    local_.RecvAsync(key, std::move(done));
    return;
  }
  absl::Status s = local_.status();
  if (!s.ok()) {
    std::move(done)(s, Tensor(), false);
    return;
  }
  if (args.allocator != nullptr && !args.allocator->Placement().host_accessible()) {
    if (LandsOnDevice(key, args.allocator)) {
      if (env_->stats) env_->stats->device_direct_recvs.fetch_add(1, std::memory_order_relaxed);
      // Lands in the device pool; one that landed in host memory after all (a destination
      // pushed ahead before the direct path was known) is copied over.
      // The copy to the device starts in the callback: not a quick one any more.
      RecvArgs direct_args = args;
      direct_args.quick_callback = false;
      RecvFromRemoteAsyncCounted(
          key, direct_args,
          device_staging::CopyingToDevice(env_, key.full_key, args.allocator, std::move(done)));
      return;
    }
    if (env_->device_copier == nullptr ||
        !env_->device_copier->Handles(args.allocator->Placement())) {
      std::move(done)(
          absl::FailedPreconditionError(absl::StrCat(
              "recv of key '", key.full_key, "': its allocator ", args.allocator->Name(),
              " hands out ", args.allocator->Placement().ToString(),
              " memory, and this task has no CUDA runtime driving that device (`tensorverbs "
              "info` says why); receive into host memory")),
          Tensor(), false);
      return;
    }
    // The proxy path: the protocol lands the tensor in the pool, then it goes to the device.
    RecvArgs proxy_args = args;
    proxy_args.allocator = nullptr;
    proxy_args.quick_callback = false;
    RecvDoneCallback copying = device_staging::CopyingToDevice(env_, key.full_key, args.allocator,
                                                               std::move(done), &proxy_args);
    RecvFromRemoteAsyncCounted(key, proxy_args, std::move(copying));
    return;
  }
  RecvFromRemoteAsyncCounted(key, args, std::move(done));
}

void RemoteRendezvous::RecvFromRemoteAsyncCounted(const ParsedKey& key, const RecvArgs& args,
                                                  RecvDoneCallback done) {
  if (env_->stats == nullptr || CountsOwnRecvs()) {
    RecvFromRemoteAsync(key, args, std::move(done));
    return;
  }
  TransferStats* stats = env_->stats;
  RecvFromRemoteAsync(key, args,
                      [stats, done = std::move(done)](const absl::Status& s, const Tensor& t,
                                                      bool is_dead) mutable {
                        stats->CountRecv(s, t);
                        std::move(done)(s, t, is_dead);
                      });
}

uint64_t RemoteRendezvous::RecvLocalAsync(const ParsedKey& key, RecvDoneCallback done) {
  if (env_->device_copier != nullptr)
    done = device_staging::StagingDevice(env_, key.full_key, std::move(done));
  return local_.RecvAsync(key, std::move(done));
}

void RemoteRendezvous::StageToHostAsync(const std::string& key, const Tensor& value,
                                        RecvDoneCallback done) {
  if (env_->device_copier == nullptr || !env_->device_copier->Handles(value.placement())) {
    std::move(done)(absl::FailedPreconditionError(absl::StrCat(
                        "send of '", key, "': the tensor is in ", value.placement().ToString(),
                        " memory the fabric cannot reach, and this task has no CUDA runtime "
                        "driving that device to stage it")),
                    Tensor(), false);
    return;
  }
  device_staging::StageToHost(env_, key, value, std::move(done));
}

absl::StatusOr<Tensor> RemoteRendezvous::StageToHostInChunks(const std::string& key,
                                                             const Tensor& value,
                                                             uint64_t chunk_bytes,
                                                             StagedCallback on_staged) {
  return device_staging::StageToHostInChunks(env_, key, value, chunk_bytes, std::move(on_staged));
}

uint64_t RemoteRendezvous::RecvLocalAsync(KeyRef key, RecvDoneCallback done, bool keep_device) {
  if (env_->device_copier != nullptr && !keep_device) {
    done = device_staging::StagingDevice(env_, key->key.full_key, std::move(done));
  }
  return local_.RecvAsync(std::move(key), std::move(done));
}

bool RemoteRendezvous::CancelLocalRecv(uint64_t token, const absl::Status& status) {
  return local_.CancelRecv(token, status);
}

void RemoteRendezvous::StartAbort(const absl::Status& status) {
  local_.StartAbort(status);
  AbortRemote(local_.status());
}

absl::StatusOr<std::vector<Tensor>> RecvAll(RemoteRendezvous& rendezvous,
                                            const std::vector<ParsedKey>& keys,
                                            const RecvArgs& args) {
  struct State {
    Mutex mu;
    size_t pending;
    absl::Status status;
    std::vector<Tensor> tensors;
  };
  auto state = std::make_shared<State>();
  state->pending = keys.size();
  state->tensors.resize(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    rendezvous.RecvAsync(keys[i], args,
                         [state, i](const absl::Status& s, const Tensor& t, bool is_dead) {
                           MutexLock lock(&state->mu);
                           if (s.ok()) {
                             state->tensors[i] = t;
                           } else if (state->status.ok()) {
                             state->status = s;
                           }
                           --state->pending;
                         });
  }
  MutexLock lock(&state->mu);
  auto all_done = [&state]()
                      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state->mu) { return state->pending == 0; };
  state->mu.Await(all_done);
  if (!state->status.ok()) return state->status;
  return std::move(state->tensors);
}

}  // namespace tensorverbs
