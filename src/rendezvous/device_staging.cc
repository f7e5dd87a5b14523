#include "src/rendezvous/device_staging.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/common/on_demand_loop.h"
#include "src/common/state_table.h"

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

// The machines of this file as tables (state_table.h); ProxyStateTable and StagingStateTable
// hand them to the diagrams and the tests.
constexpr const char* kProxyStates[] = {"landing", "draining", "done"};
constexpr const char* kProxyEvents[] = {"Landed", "RecvEnded", "CopyDone"};
constexpr StateRow<ProxyState, ProxyEvent> kProxyRows[] = {
    {ProxyState::kLanding, ProxyEvent::kLanded, "", ProxyState::kLanding,
     "copy the new bytes to the device (allocating it first), unless a copy failed"},
    {ProxyState::kLanding, ProxyEvent::kCopyDone, "", ProxyState::kLanding, "keep the first error"},
    {ProxyState::kLanding, ProxyEvent::kRecvEnded, "copies in flight (the rest's included)",
     ProxyState::kDraining, "copy the rest, unless the recv or a copy failed"},
    {ProxyState::kLanding, ProxyEvent::kRecvEnded, "", ProxyState::kDone,
     "done: the tensor (on the device already, or empty), or the error"},
    {ProxyState::kDraining, ProxyEvent::kCopyDone, "more in flight", ProxyState::kDraining,
     "keep the first error"},
    {ProxyState::kDraining, ProxyEvent::kCopyDone, "the last in flight", ProxyState::kDone,
     "done: the tensor on the device, or the first error"},
    {ProxyState::kDraining, ProxyEvent::kLanded, "", ProxyState::kDraining,
     "nothing: the recv's end copies the rest"},
    {ProxyState::kDone, ProxyEvent::kLanded, "", ProxyState::kDone, "nothing"},
};
constexpr StateTable kProxyTable("ProxyToDevice", kProxyStates, kProxyEvents, ProxyState::kLanding,
                                 kProxyRows);

constexpr const char* kStagingStates[] = {"staging", "staged", "failed"};
constexpr const char* kStagingEvents[] = {"ChunkDone"};
constexpr StateRow<StagingState, StagingEvent> kStagingRows[] = {
    {StagingState::kStaging, StagingEvent::kChunkDone, "it succeeded, and bytes are still to come",
     StagingState::kStaging, "tell the prefix made whole, if it grew"},
    {StagingState::kStaging, StagingEvent::kChunkDone, "it succeeded, and every chunk is staged",
     StagingState::kStaged, "tell the whole, count one copy"},
    {StagingState::kStaging, StagingEvent::kChunkDone, "it failed", StagingState::kFailed,
     "tell the failure"},
    {StagingState::kFailed, StagingEvent::kChunkDone, "", StagingState::kFailed,
     "nothing more is told"},
};
constexpr StateTable kStagingTable("ChunkedStaging", kStagingStates, kStagingEvents,
                                   StagingState::kStaging, kStagingRows);

// A remote recv into device memory. The tensor arrives in a pool tensor (the proxy) and is
// copied host-to-device into memory of `device_allocator`; one that arrived on that device
// already (the direct path) passes through as it is. Where the transport reports the proxy
// filling up (Landed, from RecvArgs::on_landed), each part that landed goes to the device at
// once, while the next is still on its way: the copies and the transfer overlap, and the last
// copy is only the last part's. `done` runs once, on the callback executor, after every copy
// started has completed: a copy that fails, or a recv that fails, starts no further copy, and
// the recv fails with that error.
//
// Its machine is kProxyTable (ProxyStateTable): landing while the recv goes on, draining once
// it ended and copies are in flight, done once `done` is on its way. Its events come from three
// threads (a part landed: the transport's, through the callback executor, since allocating
// device memory may call the GPU runtime; the recv's end: the callback executor; a copy's
// completion: the copier's) and each is posted to the recv's own loop (OnDemandLoop), where the
// machine advances one event at a time: its fields need no lock.
class ProxyToDevice : public std::enable_shared_from_this<ProxyToDevice> {
 public:
  using State = ProxyState;
  using Event = ProxyEvent;

  ProxyToDevice(const WorkerEnv* env, std::string key, Allocator* device_allocator,
                RecvDoneCallback done)
      : env_(env), key_(std::move(key)), allocator_(device_allocator), done_(std::move(done)) {}

  // RecvArgs::on_landed: the first `landed_bytes` of the tensor are in `proxy`.
  void Landed(const Tensor& proxy, uint64_t landed_bytes) {
    auto post = [self = shared_from_this(), proxy, landed_bytes] {
      self->loop_.Post([self, proxy, landed_bytes] { self->OnLanded(proxy, landed_bytes); });
    };
    if (env_->callback_executor == nullptr) {
      post();
    } else {
      env_->callback_executor->Schedule(std::move(post));
    }
  }

  // The recv's `done`.
  void Done(const absl::Status& s, const Tensor& proxy, bool is_dead) {
    std::shared_ptr<ProxyToDevice> self = shared_from_this();
    loop_.Post([self, s, proxy, is_dead] { self->OnRecvEnded(s, proxy, is_dead); });
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

  void MoveTo(State next, Event event) {
    kProxyTable.Move(&state_, event, next, [&] { return absl::StrCat("recv of '", key_, "'"); });
  }

  void OnLanded(const Tensor& proxy, uint64_t landed_bytes) {
    if (state_ != State::kLanding) {
      MoveTo(state_, Event::kLanded);  // the recv's end copied the rest
      return;
    }
    std::optional<Copy> copy = PlanCopy(proxy, landed_bytes);
    MoveTo(State::kLanding, Event::kLanded);
    if (copy) Start(*std::move(copy));
  }

  void OnRecvEnded(const absl::Status& s, const Tensor& proxy, bool is_dead) {
    const MemoryPlacement where = allocator_->Placement();
    if (s.ok() && !is_dead && proxy.placement() == where) {
      // Landed on the device: nothing was copied.
      return End(Event::kRecvEnded, {s, proxy, false});
    }
    if (s.ok() && !is_dead && proxy.dtype() == DataType::kString) {
      SetError(absl::InvalidArgumentError(
          absl::StrCat("recv of '", key_, "' into ", where.ToString(),
                       " memory: it is a string tensor, and strings live in host memory "
                       "only; receive it with a host allocator")));
      return End(Event::kRecvEnded, {error_, Tensor(), false});
    }
    if (s.ok() && !is_dead && proxy.TotalBytes() == 0) {
      // No memory, so nothing to copy: an empty tensor has no placement.
      return End(Event::kRecvEnded, {s, proxy, false});
    }
    std::optional<Copy> copy;
    if (!s.ok()) {
      // The recv's own error: it says more than that of a copy its failure may have caused.
      error_ = s;
    } else if (is_dead) {
      dead_ = true;
    } else {
      copy = PlanCopy(proxy, proxy.TotalBytes());
    }
    if (copies_in_flight_ == 0) return End(Event::kRecvEnded, TakeOutcome());
    MoveTo(State::kDraining, Event::kRecvEnded);
    if (copy) Start(*std::move(copy));
  }

  void OnCopyDone(absl::Status s) {
    --copies_in_flight_;
    if (!s.ok() && error_.ok()) SetError(std::move(s));
    if (state_ == State::kDraining && copies_in_flight_ == 0) {
      return End(Event::kCopyDone, TakeOutcome());
    }
    MoveTo(state_, Event::kCopyDone);
  }

  // The copy of proxy's bytes from copied_ up to `end` into dst_ (allocated first), counted in
  // flight; none when there is nothing new or the transfer already failed.
  std::optional<Copy> PlanCopy(const Tensor& proxy, uint64_t end) {
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
    // dst_ lives until the last copy completed: only the machine's end takes it.
    uint8_t* dst = static_cast<uint8_t*>(dst_.data()) + copy.begin;
    const uint8_t* src = static_cast<const uint8_t*>(copy.proxy.data()) + copy.begin;
    env_->device_copier->CopyAsync(
        where.device, dst, src, copy.end - copy.begin, CopyDirection::kHostToDevice, what,
        [in_flight = CopyInFlight(env_->stats), self = shared_from_this(),
         proxy = std::move(copy.proxy)](absl::Status cs) mutable {
          // Everything the completion holds goes before `in_flight` ends.
          const CopyInFlight last = std::move(in_flight);
          proxy.Clear();  // back to the pool before the user's callback runs
          const std::shared_ptr<ProxyToDevice> me = std::move(self);
          me->loop_.Post([me, cs = std::move(cs)]() mutable { me->OnCopyDone(std::move(cs)); });
        });
  }

  void SetError(absl::Status s) {
    error_ = std::move(s);
    if (env_->stats) env_->stats->device_copy_errors.fetch_add(1, std::memory_order_relaxed);
  }

  // What `done` gets once the recv ended and no copy is in flight.
  Outcome TakeOutcome() {
    Outcome outcome{error_, Tensor(), dead_};
    if (error_.ok() && !dead_) {
      outcome.tensor = std::move(dst_);
      // One host-to-device copy of the tensor, however many parts it went in.
      CountDeviceCopy(env_->stats, CopyDirection::kHostToDevice, error_, copied_);
    }
    dst_.Clear();
    return outcome;
  }

  // The machine's end on `event`: `done` gets `outcome`, on the callback executor.
  void End(Event event, Outcome outcome) {
    MoveTo(State::kDone, event);
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
  OnDemandLoop loop_;
  // Touched in the loop's tasks only.
  State state_ = State::kLanding;
  RecvDoneCallback done_;  // moved out by End, which runs once
  Tensor dst_;
  uint64_t copied_ = 0;  // bytes whose copy has started
  int copies_in_flight_ = 0;
  absl::Status error_;
  bool dead_ = false;
};

// The chunks of one StageToHostInChunks in flight: completions may come in any order, and the
// prefix they make whole is told in order, once each; the first failure ends the telling. Its
// machine is kStagingTable (StagingStateTable); completions come from the copier's thread and
// each is posted to the staging's own loop, where the machine advances.
class ChunkedStaging : public std::enable_shared_from_this<ChunkedStaging> {
 public:
  using State = StagingState;
  using Event = StagingEvent;

  ChunkedStaging(TransferStats* stats, uint64_t total, uint64_t chunk,
                 RemoteRendezvous::StagedCallback on_staged)
      : stats_(stats),
        total_(total),
        chunk_(chunk),
        done_((total + chunk - 1) / chunk, false),
        on_staged_(std::move(on_staged)) {}

  void ChunkDone(size_t i, absl::Status s) {
    std::shared_ptr<ChunkedStaging> self = shared_from_this();
    loop_.Post([self, i, s = std::move(s)]() mutable { self->OnChunkDone(i, std::move(s)); });
  }

 private:
  void MoveTo(State next) {
    kStagingTable.Move(&state_, Event::kChunkDone, next,
                       [&] { return absl::StrCat("staging of ", total_, " bytes"); });
  }

  void OnChunkDone(size_t i, absl::Status s) {
    if (state_ != State::kStaging) return MoveTo(state_);  // nothing more is told
    if (!s.ok()) {
      if (stats_) stats_->device_copy_errors.fetch_add(1, std::memory_order_relaxed);
      MoveTo(State::kFailed);
      on_staged_(s, 0);
      return;
    }
    done_[i] = true;
    const size_t before = next_;
    while (next_ < done_.size() && done_[next_]) ++next_;
    const uint64_t staged = std::min<uint64_t>(next_ * chunk_, total_);
    if (staged == total_) {
      CountDeviceCopy(stats_, CopyDirection::kDeviceToHost, s, total_);
      MoveTo(State::kStaged);
    } else {
      MoveTo(State::kStaging);
    }
    if (next_ > before) on_staged_(absl::OkStatus(), staged);
  }

  TransferStats* const stats_;
  const uint64_t total_;
  const uint64_t chunk_;
  OnDemandLoop loop_;
  // Touched in the loop's tasks only.
  State state_ = State::kStaging;
  std::vector<bool> done_;
  size_t next_ = 0;  // chunks staged in order
  const RemoteRendezvous::StagedCallback on_staged_;
};

}  // namespace

StateTableView ProxyStateTable() { return kProxyTable.View(); }
StateTableView StagingStateTable() { return kStagingTable.View(); }

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
