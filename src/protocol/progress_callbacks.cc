// The progress engine's callbacks: how a turn's recv deliveries run, inline on the loop or on
// the executor, and the watcher that moves the loop to a new thread when a callback keeps it
// (see progress_engine.h: recv outcomes).
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/common/logging.h"
#include "src/protocol/progress_engine.h"
#include "src/protocol/progress_engine_internal.h"

namespace tensorverbs::protocol {
namespace {

// How many looks in a row (a limit apart) the watcher lets a callback keep the loop while its
// thread could run (see WatchCallbacks).
constexpr int kRunnableLooks = 50;

// Whether thread `tid` of this process is running or waits only for a core (state R in
// /proc); also true when that cannot be read, so that the caller's patience decides.
bool ThreadCouldRun(pid_t tid) {
  if (tid <= 0) return true;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/self/task/%d/stat", static_cast<int>(tid));
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return true;
  char buf[512];
  const ssize_t n = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (n <= 0) return true;
  buf[n] = '\0';
  // "tid (comm) S ...": the name may hold spaces and parentheses, so the state follows the
  // last ')'.
  const char* end = std::strrchr(buf, ')');
  if (end == nullptr || end[1] != ' ') return true;
  return end[2] == 'R';
}

// The engine whose callbacks the calling thread runs inline, if any.
thread_local const ProgressEngine* inline_callbacks_of = nullptr;

}  // namespace

void ProgressEngine::DeliveryBatch::Release(DeliveryBatch* batch) {
  if (batch->holders.fetch_sub(1, std::memory_order_acq_rel) == 1) SpareBatches::Return(batch);
}

bool ProgressEngine::InInlineCallback() const { return inline_callbacks_of == this; }

void ProgressEngine::DeliverRecv(RecvDelivery delivery) {
  if (OnLoopThread()) {
    deliveries_.push_back(std::move(delivery));
  } else {
    executor_->Schedule(
        [d = std::move(delivery)]() mutable { std::move(d.done)(d.status, d.tensor, d.is_dead); });
  }
}

bool ProgressEngine::HandOffCallbacks(Seat* seat) {
  if (deliveries_.empty()) return true;
  if (executor_->runs_inline()) {
    // A callback may deliver more (into deliveries_), so the turn's run from a vector of their
    // own; deliveries_ keeps its capacity in the swap.
    quick_.swap(deliveries_);
    for (RecvDelivery& d : quick_) std::move(d.done)(d.status, d.tensor, d.is_dead);
    quick_.clear();
    return true;
  }
  // Quick callbacks run here, on whoever drives: they only store an outcome and wake its waiter,
  // which is often this very thread.
  size_t kept = 0;
  for (size_t i = 0; i < deliveries_.size(); ++i) {
    if (deliveries_[i].quick) {
      quick_.push_back(std::move(deliveries_[i]));
    } else {
      if (kept != i) deliveries_[kept] = std::move(deliveries_[i]);
      ++kept;
    }
  }
  deliveries_.erase(deliveries_.begin() + static_cast<ptrdiff_t>(kept), deliveries_.end());
  if (!quick_.empty()) {
    for (RecvDelivery& d : quick_) std::move(d.done)(d.status, d.tensor, d.is_dead);
    quick_.clear();
  }
  if (deliveries_.empty()) return true;
  DeliveryBatch* batch = nullptr;
  if (!spare_batches_->queue.TryPop(&batch)) batch = new DeliveryBatch();
  batch->items.swap(deliveries_);  // deliveries_ takes the batch's empty vector and capacity
  batch->home = spare_batches_;
  if (seat != nullptr && RunsCallbacksInline()) {
    return RunInline(batch, seat);
  }
  // One pointer: stored inside the task itself, with no allocation.
  executor_->Schedule([batch]() {
    batch->RunRest();
    DeliveryBatch::Release(batch);
  });
  return true;
}

bool ProgressEngine::RunInline(DeliveryBatch* batch, Seat* seat) {
  inline_batch_ = batch;
  // While user code runs here this thread is not the loop for anyone: what a callback posts goes
  // through the queue, and nothing it calls touches the loop's state directly, so that the loop
  // can move to another thread in the middle of it.
  loop_thread_id_.store(std::thread::id(), std::memory_order_relaxed);
  seat->step.store(kInCallbacks, std::memory_order_release);
  inline_callbacks_of = this;
  for (size_t i; (i = batch->next.fetch_add(1, std::memory_order_relaxed)) < batch->items.size();) {
    seat->seq.store(seat->seq.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    RecvDelivery& d = batch->items[i];
    std::move(d.done)(d.status, d.tensor, d.is_dead);
    if (seat->step.load(std::memory_order_relaxed) == kLeft) break;
  }
  inline_callbacks_of = nullptr;
  seat->seq.store(seat->seq.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  int step = kInCallbacks;
  if (seat->step.compare_exchange_strong(step, kLooping, std::memory_order_acq_rel)) {
    loop_thread_id_.store(std::this_thread::get_id(), std::memory_order_relaxed);
    DeliveryBatch::Release(batch);
    return true;
  }
  // The loop left this thread (MoveLoop): another thread runs it now, and the executor the
  // callbacks this one did not get to. Nothing of the engine's may be touched from here on: it
  // may be gone already.
  DeliveryBatch::Release(batch);
  return false;
}

void ProgressEngine::WatchCallbacks() {
  prctl(PR_SET_NAME, "tv-cb-watch", 0UL, 0UL, 0UL);
  const absl::Duration limit = options_.inline_callback_limit;
  bool seen_in_callbacks = false;
  uint64_t seen_seq = 0;
  int runnable_looks = 0;  // looks in a row at one callback whose thread could run
  // Looks in a row that found no callback running. Each doubles the next nap, up to the
  // housekeeping interval: a loop whose callbacks are rare or short (most turns run none) is
  // looked at a few dozen times a second, not once per limit, which at 256 tasks on two cores
  // was a fifth of all the CPU time their start took. A callback that blocks after such a
  // quiet spell is noticed up to a housekeeping interval late, once.
  int quiet_looks = 0;
  const absl::Duration longest_nap = std::max(limit, options_.housekeeping_interval);
  std::unique_lock<std::mutex> lock(watch_mu_);
  while (!watch_stop_ && RunsCallbacksInline()) {
    // While the loop sleeps nothing runs inline, so the watcher naps its longest.
    const absl::Duration nap =
        sleeping_.load(std::memory_order_relaxed)
            ? longest_nap
            : std::min(limit * (int64_t{1} << std::min(quiet_looks, 20)), longest_nap);
    watch_cv_.wait_for(lock, absl::ToChronoNanoseconds(nap), [this] { return watch_stop_; });
    if (watch_stop_) break;
    const bool in_callbacks = current_seat_->step.load(std::memory_order_relaxed) == kInCallbacks;
    const uint64_t seq = current_seat_->seq.load(std::memory_order_relaxed);
    quiet_looks = in_callbacks ? 0 : quiet_looks + 1;
    if (in_callbacks && seen_in_callbacks && seq == seen_seq) {
      // The same callback at two looks at least `limit` apart. A thread that could run has
      // been preempted, or computes: on a loaded machine the scheduler takes the core for
      // milliseconds from any thread, and that is no reason to give up inline callbacks. So only
      // a callback that waits (asleep in the kernel: a lock, a condition, I/O) moves the loop at
      // once; one that keeps running does after kRunnableLooks looks.
      if (ThreadCouldRun(current_seat_->tid.load(std::memory_order_relaxed)) &&
          ++runnable_looks < kRunnableLooks) {
        continue;
      }
      lock.unlock();
      MoveLoop();
      lock.lock();
      seen_in_callbacks = false;
      runnable_looks = 0;
      continue;
    }
    runnable_looks = 0;
    seen_in_callbacks = in_callbacks;
    seen_seq = seq;
  }
}

void ProgressEngine::MoveLoop() {
  DeliveryBatch* batch = nullptr;
  std::thread left;
  {
    // Under mu_, so that Stop, which joins the loop's threads, sees the new one.
    MutexLock lock(&mu_);
    int step = kInCallbacks;
    if (!current_seat_->step.compare_exchange_strong(step, kLeft, std::memory_order_acq_rel)) {
      return;  // the callbacks ended meanwhile
    }
    loop_moves_.fetch_add(1, std::memory_order_relaxed);  // callbacks go to the executor now
    batch = inline_batch_;
    batch->holders.fetch_add(1, std::memory_order_relaxed);
    // The thread left behind (unless Stop took it already to join it).
    if (!loops_.empty()) {
      left = std::move(loops_.back());
      loops_.pop_back();
    }
    {
      // The left thread owned progress: the new loop thread, or a waiter, takes it on.
      std::lock_guard<std::mutex> own(own_mu_);
      ReleaseLocked();
    }
    // Even while stopping: the new loop runs what was posted and ends, where the old one could
    // not until the callback returns.
    current_seat_ = std::make_shared<Seat>();
    loops_.emplace_back([this, seat = current_seat_] { Loop(seat); });
  }
  executor_->Schedule([batch]() {
    batch->RunRest();
    DeliveryBatch::Release(batch);
  });
  // The thread left behind is a callback thread now: the executor joins it as one of its own,
  // so that the task's end waits for that callback as it waits for the others.
  if (left.joinable()) executor_->Adopt(std::move(left));
  LOG(WARNING) << options_.name << ": a recv callback kept the progress thread for more than "
               << absl::FormatDuration(options_.inline_callback_limit)
               << "; the loop moved to a new thread, and recv callbacks run on the callback "
                  "threads from now on (TENSORVERBS_INLINE_CALLBACK_US; 0 never runs them on "
                  "the progress thread)";
}

}  // namespace tensorverbs::protocol
