#include "src/rendezvous/device_staging.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/common/mutex.h"

namespace tensorverbs::device_staging {
namespace {

void CountDeviceCopy(TransferStats* stats, CopyDirection direction, const absl::Status& s,
                     size_t bytes) {
  if (stats == nullptr) return;
  if (!s.ok()) {
    stats->device_copy_errors.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  (direction == CopyDirection::kDeviceToHost ? stats->device_to_host : stats->host_to_device)
      .fetch_add(1, std::memory_order_relaxed);
  stats->device_copied_bytes.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  stats->copies.fetch_add(1, std::memory_order_relaxed);
  stats->copied_bytes.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
}

// Counts one device copy in flight (TransferStats::device_copies_in_flight) from its start to
// the end of its completion, so that a stopping task can wait until no copier callback can
// reach it any more. Declared first in a completion, it is destroyed last.
class CopyInFlight {
 public:
  explicit CopyInFlight(TransferStats* stats) : stats_(stats) {
    if (stats_) stats_->device_copies_in_flight.fetch_add(1, std::memory_order_relaxed);
  }
  CopyInFlight(CopyInFlight&& other) noexcept : stats_(std::exchange(other.stats_, nullptr)) {}
  CopyInFlight& operator=(CopyInFlight&&) = delete;
  ~CopyInFlight() {
    if (stats_) stats_->device_copies_in_flight.fetch_sub(1, std::memory_order_release);
  }

 private:
  TransferStats* stats_;
};

// A remote recv into device memory. The tensor arrives in a pool tensor (the proxy) and is
// copied host-to-device into memory of `device_allocator`; one that arrived on that device
// already (the direct path) passes through as it is. Where the transport reports the proxy
// filling up (Landed, from RecvArgs::on_landed), each part that landed goes to the device at
// once, while the next is still on its way: the copies and the transfer overlap, and the last
// copy is only the last part's. `done` runs once, on the callback executor, after every copy
// started has completed: a copy that fails, or a recv that fails, starts no further copy, and
// the recv fails with that error.
//
// Thread-safe: Landed runs on a transport thread (and hands its work to the callback
// executor: allocating device memory may call the GPU runtime), Done on the callback executor,
// copy completions on the copier's thread.
class ProxyToDevice : public std::enable_shared_from_this<ProxyToDevice> {
 public:
  ProxyToDevice(const WorkerEnv* env, std::string key, Allocator* device_allocator,
                RecvDoneCallback done)
      : env_(env), key_(std::move(key)), allocator_(device_allocator), done_(std::move(done)) {}

  // RecvArgs::on_landed: the first `landed_bytes` of the tensor are in `proxy`.
  void Landed(const Tensor& proxy, uint64_t landed_bytes) {
    if (env_->callback_executor == nullptr) {
      CopyLanded(proxy, landed_bytes);
      return;
    }
    env_->callback_executor->Schedule([self = shared_from_this(), proxy, landed_bytes] {
      self->CopyLanded(proxy, landed_bytes);
    });
  }

  // The recv's `done`.
  void Done(const absl::Status& s, const Tensor& proxy, bool is_dead) {
    const MemoryPlacement where = allocator_->Placement();
    if (s.ok() && !is_dead && proxy.placement() == where) {
      Finish({s, proxy, false});  // landed on the device: nothing was copied
      return;
    }
    if (s.ok() && !is_dead && proxy.dtype() == DataType::kString) {
      Fail(absl::InvalidArgumentError(
          absl::StrCat("recv of '", key_, "' into ", where.ToString(),
                       " memory: it is a string tensor, and strings live in host memory "
                       "only; receive it with a host allocator")));
      return;
    }
    if (s.ok() && !is_dead && proxy.TotalBytes() == 0) {
      Finish({s, proxy, false});  // no memory, so nothing to copy: an empty tensor has no placement
      return;
    }
    std::optional<Copy> copy;
    std::optional<Outcome> outcome;
    {
      MutexLock lock(&mu_);
      recv_ended_ = true;
      if (!s.ok()) {
        // The recv's own error: it says more than that of a copy its failure may have caused.
        error_ = s;
      } else if (is_dead) {
        dead_ = true;
      } else {
        copy = PlanCopy(proxy, proxy.TotalBytes());
      }
      if (!copy) outcome = TakeOutcomeIfSettled();
    }
    if (copy) Start(*std::move(copy));
    if (outcome) Finish(*std::move(outcome));
  }

 private:
  struct Copy {
    Tensor proxy;
    uint64_t begin;
    uint64_t end;
  };
  struct Outcome {
    absl::Status status;
    Tensor tensor;
    bool is_dead;
  };

  // The recv fails before any copy: counted as a device copy error.
  void Fail(absl::Status error) {
    if (env_->stats) env_->stats->device_copy_errors.fetch_add(1, std::memory_order_relaxed);
    Finish({std::move(error), Tensor(), false});
  }

  void CopyLanded(const Tensor& proxy, uint64_t landed_bytes) {
    std::optional<Copy> copy;
    {
      MutexLock lock(&mu_);
      if (recv_ended_) return;  // Done copies the rest itself
      copy = PlanCopy(proxy, landed_bytes);
    }
    if (copy) Start(*std::move(copy));
  }

  // The copy of proxy's bytes from copied_ up to `end` into dst_ (allocated first), counted in
  // flight; none when there is nothing new or the transfer already failed.
  std::optional<Copy> PlanCopy(const Tensor& proxy, uint64_t end)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!error_.ok() || dead_ || end <= copied_) return std::nullopt;
    const MemoryPlacement where = allocator_->Placement();
    if (env_->device_copier == nullptr) {
      SetError(absl::FailedPreconditionError(
          absl::StrCat("recv of '", key_,
                       "': it arrived in host memory, and this task has no CUDA runtime to copy "
                       "it to ",
                       where.ToString())));
      return std::nullopt;
    }
    if (!dst_.IsInitialized()) {
      absl::StatusOr<Tensor> dst = Tensor::Allocate(allocator_, proxy.dtype(), proxy.shape());
      if (!dst.ok()) {
        SetError(
            absl::Status(dst.status().code(),
                         absl::StrCat("recv of '", key_, "': allocating ", proxy.TotalBytes(),
                                      " bytes in ", where.ToString(), " memory (",
                                      allocator_->Name(), ") failed: ", dst.status().message())));
        return std::nullopt;
      }
      dst_ = *std::move(dst);
      dst_data_ = static_cast<uint8_t*>(dst_.data());
    }
    Copy copy{proxy, copied_, end};
    copied_ = end;
    ++copies_in_flight_;
    return copy;
  }

  void Start(Copy copy) {
    // Named by its bytes when it is one part of several, so that a failure says which.
    const std::string what =
        copy.begin == 0 && copy.end == copy.proxy.TotalBytes()
            ? key_
            : absl::StrCat(key_, " (bytes ", copy.begin, " to ", copy.end, ")");
    const MemoryPlacement where = allocator_->Placement();
    // dst_data_ is set once, before the first copy is planned, and dst_ lives until the last
    // copy completed.
    uint8_t* dst = dst_data_ + copy.begin;
    const uint8_t* src = static_cast<const uint8_t*>(copy.proxy.data()) + copy.begin;
    env_->device_copier->CopyAsync(
        where.device, dst, src, copy.end - copy.begin, CopyDirection::kHostToDevice, what,
        [in_flight = CopyInFlight(env_->stats), self = shared_from_this(),
         proxy = std::move(copy.proxy)](absl::Status cs) mutable {
          // Everything the completion holds goes before `in_flight` ends.
          const CopyInFlight last = std::move(in_flight);
          proxy.Clear();  // back to the pool before the user's callback runs
          const std::shared_ptr<ProxyToDevice> me = std::move(self);
          me->CopyDone(std::move(cs));
        });
  }

  void CopyDone(absl::Status s) {
    std::optional<Outcome> outcome;
    {
      MutexLock lock(&mu_);
      --copies_in_flight_;
      if (!s.ok() && error_.ok()) SetError(std::move(s));
      outcome = TakeOutcomeIfSettled();
    }
    if (outcome) Finish(*std::move(outcome));
  }

  void SetError(absl::Status s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    error_ = std::move(s);
    if (env_->stats) env_->stats->device_copy_errors.fetch_add(1, std::memory_order_relaxed);
  }

  // Once the recv ended and no copy is in flight: what `done` gets, once.
  std::optional<Outcome> TakeOutcomeIfSettled() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!recv_ended_ || copies_in_flight_ > 0 || settled_) return std::nullopt;
    settled_ = true;
    Outcome outcome{error_, Tensor(), dead_};
    if (error_.ok() && !dead_) {
      outcome.tensor = std::move(dst_);
      // One host-to-device copy of the tensor, however many parts it went in.
      CountDeviceCopy(env_->stats, CopyDirection::kHostToDevice, error_, copied_);
    }
    dst_.Clear();
    return outcome;
  }

  void Finish(Outcome outcome) {
    auto finish = [outcome = std::move(outcome), done = std::move(done_)]() mutable {
      // Nothing here keeps the tensor once `done` returns.
      const Tensor result = std::move(outcome.tensor);
      outcome.tensor.Clear();
      std::move(done)(outcome.status, result, outcome.is_dead);
    };
    if (env_->callback_executor != nullptr) {
      env_->callback_executor->Schedule(std::move(finish));
    } else {
      finish();
    }
  }

  const WorkerEnv* const env_;
  const std::string key_;
  Allocator* const allocator_;
  RecvDoneCallback done_;  // moved out by Finish, which runs once
  Mutex mu_;
  Tensor dst_ ABSL_GUARDED_BY(mu_);
  uint8_t* dst_data_ = nullptr;               // dst_'s bytes, for copies started outside the lock
  uint64_t copied_ ABSL_GUARDED_BY(mu_) = 0;  // bytes whose copy has started
  int copies_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  bool recv_ended_ ABSL_GUARDED_BY(mu_) = false;
  bool dead_ ABSL_GUARDED_BY(mu_) = false;
  bool settled_ ABSL_GUARDED_BY(mu_) = false;
};

// The chunks of one StageToHostInChunks in flight: completions may come in any order, and the
// prefix they make whole is told in order, once each; the first failure ends the telling.
class ChunkedStaging {
 public:
  ChunkedStaging(TransferStats* stats, uint64_t total, uint64_t chunk,
                 RemoteRendezvous::StagedCallback on_staged)
      : stats_(stats),
        total_(total),
        chunk_(chunk),
        done_((total + chunk - 1) / chunk, false),
        on_staged_(std::move(on_staged)) {}

  void ChunkDone(size_t i, absl::Status s) {
    absl::Status failure;
    uint64_t staged = 0;
    bool tell = false;
    {
      MutexLock lock(&mu_);
      if (failed_) return;
      if (!s.ok()) {
        failed_ = true;
        failure = std::move(s);
        if (stats_) stats_->device_copy_errors.fetch_add(1, std::memory_order_relaxed);
      } else {
        done_[i] = true;
        const size_t before = next_;
        while (next_ < done_.size() && done_[next_]) ++next_;
        if (next_ == before) return;
        staged = std::min<uint64_t>(next_ * chunk_, total_);
        tell = true;
        if (staged == total_) CountDeviceCopy(stats_, CopyDirection::kDeviceToHost, s, total_);
      }
    }
    // Told outside the lock, one completion at a time: the copier runs them on its one thread.
    if (!failure.ok()) {
      on_staged_(failure, 0);
    } else if (tell) {
      on_staged_(absl::OkStatus(), staged);
    }
  }

 private:
  TransferStats* const stats_;
  const uint64_t total_;
  const uint64_t chunk_;
  Mutex mu_;
  std::vector<bool> done_ ABSL_GUARDED_BY(mu_);
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;  // chunks staged in order
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  const RemoteRendezvous::StagedCallback on_staged_;
};

}  // namespace

// A device tensor taken from this task's table for a peer, copied into a pool tensor (which
// the fabric writes from without a further copy); `done` gets that copy. Runs `done` on the
// copier's thread, or here when the staging tensor cannot be allocated.
void StageToHost(const WorkerEnv* env, const std::string& key, const Tensor& value,
                 RecvDoneCallback done) {
  absl::StatusOr<Tensor> staged =
      Tensor::Allocate(env->recv_allocator, value.dtype(), value.shape());
  if (!staged.ok()) {
    std::move(done)(
        absl::Status(staged.status().code(),
                     absl::StrCat("staging '", key, "' from ", value.placement().ToString(),
                                  " for a peer: ", staged.status().message())),
        Tensor(), false);
    return;
  }
  const size_t bytes = value.TotalBytes();
  void* dst = staged->data();
  env->device_copier->CopyAsync(
      value.placement().device, dst, value.data(), bytes, CopyDirection::kDeviceToHost, key,
      [in_flight = CopyInFlight(env->stats), stats = env->stats, source = value,
       staged = *std::move(staged), bytes, done = std::move(done)](absl::Status s) mutable {
        // Everything the completion holds goes before `in_flight` ends.
        const CopyInFlight last = std::move(in_flight);
        source.Clear();  // the device memory may go once the copy is done
        Tensor out = std::move(staged);
        RecvDoneCallback callback = std::move(done);
        CountDeviceCopy(stats, CopyDirection::kDeviceToHost, s, bytes);
        if (!s.ok()) out.Clear();
        std::move(callback)(s, out, false);
      });
}

// RecvLocalAsync's `done`, with device tensors staged to host memory first.
RecvDoneCallback StagingDevice(const WorkerEnv* env, std::string key, RecvDoneCallback done) {
  return [env, key = std::move(key), done = std::move(done)](const absl::Status& s, const Tensor& t,
                                                             bool is_dead) mutable {
    if (!s.ok() || is_dead || t.placement().host_accessible()) {
      std::move(done)(s, t, is_dead);
      return;
    }
    StageToHost(env, key, t, std::move(done));
  };
}

// A remote recv's `done` into device memory (ProxyToDevice), and in `args` the progress that
// pipelines its copies where the proxy path moves it in chunks.
RecvDoneCallback CopyingToDevice(const WorkerEnv* env, std::string key, Allocator* device_allocator,
                                 RecvDoneCallback done, RecvArgs* args) {
  auto proxy =
      std::make_shared<ProxyToDevice>(env, std::move(key), device_allocator, std::move(done));
  if (args != nullptr && env->proxy_chunk_bytes > 0 && env->device_copier != nullptr) {
    args->progress_bytes = env->proxy_chunk_bytes;
    args->on_landed = [proxy](const Tensor& landing, uint64_t landed_bytes) {
      proxy->Landed(landing, landed_bytes);
    };
  }
  return [proxy = std::move(proxy)](const absl::Status& s, const Tensor& t, bool is_dead) {
    proxy->Done(s, t, is_dead);
  };
}

absl::StatusOr<Tensor> StageToHostInChunks(const WorkerEnv* env, const std::string& key,
                                           const Tensor& value, uint64_t chunk_bytes,
                                           RemoteRendezvous::StagedCallback on_staged) {
  if (env->device_copier == nullptr || !env->device_copier->Handles(value.placement())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "send of '", key, "': the tensor is in ", value.placement().ToString(),
        " memory the fabric cannot reach, and this task has no CUDA runtime driving that device "
        "to stage it"));
  }
  absl::StatusOr<Tensor> staged =
      Tensor::Allocate(env->recv_allocator, value.dtype(), value.shape());
  if (!staged.ok()) {
    return absl::Status(staged.status().code(),
                        absl::StrCat("staging '", key, "' from ", value.placement().ToString(),
                                     " for a peer: ", staged.status().message()));
  }
  const uint64_t total = value.TotalBytes();
  const uint64_t chunk = std::max<uint64_t>(chunk_bytes, 1);
  auto state = std::make_shared<ChunkedStaging>(env->stats, total, chunk, std::move(on_staged));
  auto* dst = static_cast<uint8_t*>(staged->data());
  const auto* src = static_cast<const uint8_t*>(value.data());
  // Every copy is queued now: the copier runs them one after another on its device-to-host
  // stream, and the first chunk's write need not wait for the last one's copy.
  for (uint64_t begin = 0, i = 0; begin < total; begin += chunk, ++i) {
    const uint64_t end = std::min(total, begin + chunk);
    env->device_copier->CopyAsync(value.placement().device, dst + begin, src + begin, end - begin,
                                  CopyDirection::kDeviceToHost,
                                  absl::StrCat(key, " (bytes ", begin, " to ", end, ")"),
                                  [in_flight = CopyInFlight(env->stats), state, i, source = value,
                                   target = *staged](absl::Status s) mutable {
                                    // Everything the completion holds goes before `in_flight` ends.
                                    const CopyInFlight last = std::move(in_flight);
                                    source.Clear();
                                    target.Clear();
                                    const std::shared_ptr<ChunkedStaging> chunks = std::move(state);
                                    chunks->ChunkDone(static_cast<size_t>(i), std::move(s));
                                  });
  }
  return *std::move(staged);
}

}  // namespace tensorverbs::device_staging
