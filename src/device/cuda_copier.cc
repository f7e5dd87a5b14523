#include "src/device/cuda_copier.h"

#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/common/logging.h"

namespace tensorverbs::device {

CudaCopier::CudaCopier(const CudaRuntime* runtime)
    : runtime_(runtime), thread_([this] { Loop(); }) {}

CudaCopier::~CudaCopier() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    cv_.notify_all();
  }
  // The loop ends once every copy has completed and no host function can still touch this
  // object.
  thread_.join();
  for (auto& [lane, stream] : streams_) runtime_->StreamDestroy(lane.first, stream);
  for (auto& [device, events] : free_events_) {
    for (void* e : events) runtime_->EventDestroy(device, e);
  }
}

std::string CudaCopier::Name() const {
  return absl::StrCat("CUDA streams (", runtime_->library(), ", ", runtime_->device_count(), " GPU",
                      runtime_->device_count() == 1 ? "" : "s", ")");
}

bool CudaCopier::Handles(const MemoryPlacement& placement) const {
  return placement.kind == MemoryPlacement::Kind::kCudaDevice && placement.device >= 0 &&
         placement.device < runtime_->device_count();
}

void CudaCopier::WakeFromRuntime(void* self) {
  // On a runtime thread: no runtime calls here, only the hand-off.
  auto* copier = static_cast<CudaCopier*>(self);
  std::lock_guard<std::mutex> lock(copier->mu_);
  --copier->host_funcs_;
  copier->woken_ = true;
  copier->cv_.notify_all();  // under the lock: the destructor cannot free cv_ meanwhile
}

void CudaCopier::CopyAsync(int device, void* dst, const void* src, size_t bytes,
                           CopyDirection direction, absl::string_view key, DoneCallback done) {
  auto copy = std::make_unique<Copy>();
  copy->device = device;
  copy->dst = dst;
  copy->src = src;
  copy->bytes = bytes;
  copy->direction = direction;
  copy->key = std::string(key);
  copy->done = std::move(done);
  std::lock_guard<std::mutex> lock(mu_);
  queued_.push_back(std::move(copy));
  woken_ = true;
  cv_.notify_all();
}

absl::StatusOr<void*> CudaCopier::Stream(int device, CopyDirection direction) {
  const std::pair<int, int> lane(device, static_cast<int>(direction));
  auto it = streams_.find(lane);
  if (it != streams_.end()) return it->second;
  absl::StatusOr<void*> made = runtime_->StreamCreate(device);
  if (!made.ok()) return made.status();
  streams_.emplace(lane, *made);
  return *made;
}

absl::StatusOr<void*> CudaCopier::TakeEvent(int device) {
  std::vector<void*>& events = free_events_[device];
  if (events.empty()) return runtime_->EventCreate(device);
  void* e = events.back();
  events.pop_back();
  return e;
}

void CudaCopier::Issue(Copy& copy) {
  if (copy.bytes == 0) return;  // complete: nothing to move
  absl::StatusOr<void*> stream = Stream(copy.device, copy.direction);
  absl::StatusOr<void*> event = stream.ok() ? TakeEvent(copy.device) : stream.status();
  if (!event.ok()) {
    copy.status = event.status();
    return;
  }
  absl::Status s = runtime_->MemcpyAsync(copy.device, copy.dst, copy.src, copy.bytes,
                                         copy.direction, *stream, copy.key);
  if (s.ok()) s = runtime_->EventRecord(copy.device, *event, *stream);
  if (!s.ok()) {
    free_events_[copy.device].push_back(*event);  // never recorded: free for the next copy
    copy.status = std::move(s);
    return;
  }
  copy.event = *event;
  {
    // Counted before the launch: the host function may run before the launch returns.
    std::lock_guard<std::mutex> lock(mu_);
    ++host_funcs_;
  }
  if (!runtime_->LaunchHostFunc(copy.device, *stream, &CudaCopier::WakeFromRuntime, this).ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    --host_funcs_;  // the backstop poll finds the event instead
  }
}

void CudaCopier::Loop() {
  absl::Time spin_until = absl::InfinitePast();
  std::vector<std::unique_ptr<Copy>> fresh;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (queued_.empty() && in_flight_.empty()) {
        if (stopping_ && host_funcs_ == 0) return;
        cv_.wait(lock, [this] { return !queued_.empty() || (stopping_ && host_funcs_ == 0); });
        if (queued_.empty()) return;
      } else if (queued_.empty() && absl::Now() >= spin_until) {
        cv_.wait_for(lock, absl::ToChronoMilliseconds(kBackstopPoll), [this] { return woken_; });
      }
      woken_ = false;
      fresh.swap(queued_);
    }
    if (!fresh.empty()) spin_until = absl::Now() + kSpin;
    for (std::unique_ptr<Copy>& c : fresh) {
      Issue(*c);
      in_flight_.push_back(std::move(c));
    }
    fresh.clear();
    // Completed copies, in the order they were issued per stream; the rest wait.
    size_t kept = 0;
    bool any = false;
    for (size_t i = 0; i < in_flight_.size(); ++i) {
      std::unique_ptr<Copy>& c = in_flight_[i];
      if (c->event != nullptr) {
        absl::Status s = runtime_->EventQuery(c->device, c->event, c->key);
        if (absl::IsUnavailable(s)) {
          if (kept != i) in_flight_[kept] = std::move(c);
          ++kept;
          continue;
        }
        // A failed copy's event may be broken with its device: it is not reused.
        if (s.ok()) free_events_[c->device].push_back(c->event);
        c->status = std::move(s);
      }
      any = true;
      completed_.fetch_add(1, std::memory_order_relaxed);
      std::move(c->done)(c->status);
    }
    in_flight_.resize(kept);
    if (any) spin_until = absl::Now() + kSpin;
    if (!in_flight_.empty() && absl::Now() < spin_until) std::this_thread::yield();
  }
}

}  // namespace tensorverbs::device
