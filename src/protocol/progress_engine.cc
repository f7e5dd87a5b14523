#include "src/protocol/progress_engine.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/common/bounded_queue.h"
#include "src/common/coarse_clock.h"
#include "src/common/logging.h"

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

// Whether two sleeps would poll the same fds for the same events.
bool SameFds(const std::vector<pollfd>& a, const std::vector<pollfd>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].fd != b[i].fd || a[i].events != b[i].events) return false;
  }
  return true;
}

// The fds of a sleep that did not happen (or whose wake-ups another thread takes): FinishSleep
// drains nothing for them.
void ClearRevents(std::vector<pollfd>* fds) {
  for (pollfd& f : *fds) f.revents = 0;
}

// How many turns a waiter that leaves runs, at most, while a transfer it set off is still in
// flight (the write of an acknowledgement): each completes within a turn or two, and finishing
// it here spares the progress thread a wake-up.
constexpr int kDrainTurns = 8;
// One gap longer than this counts as this long in the average: a pause between training steps
// should not teach the owner never to spin again.
constexpr double kMaxLearnedGapUs = 2000;
// How often a waiter whose recv another thread drives looks whether progress went idle (and so
// its to take): the driver's sleep arms the domain for the waiter's completion too, so this
// only bounds a wait for a driver that left without anyone to hand progress to.
constexpr absl::Duration kDriverCheck = absl::Milliseconds(20);

}  // namespace

absl::StatusOr<PollMode> ParsePollMode(absl::string_view name) {
  if (name == "busy") return PollMode::kBusy;
  if (name == "blocking") return PollMode::kBlocking;
  if (name == "adaptive") return PollMode::kAdaptive;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown poll mode '", name,
                   "' (TENSORVERBS_POLL_MODE); expected busy, blocking or adaptive"));
}

// A turn's deliveries travel to the executor in a batch that comes back, emptied but with its
// capacity, for a later turn: a fresh vector per turn would cost a malloc per turn and its
// growth. A parked batch holds no reference to the spares, and one in flight holds the spares
// alive, so a batch whose callbacks run after the engine is gone still has a home to go to or
// is freed. Each callback is claimed with `next`, so that when the loop leaves a batch it was
// running inline, the executor runs the rest and each callback still runs exactly once; the last
// of its holders (the thread the loop left, the executor's task) sends it home.
struct ProgressEngine::DeliveryBatch {
  std::vector<RecvDelivery> items;
  std::shared_ptr<SpareBatches> home;  // set only while in flight
  std::atomic<size_t> next{0};
  std::atomic<int> holders{1};

  // Runs the callbacks nobody claimed yet.
  void RunRest() {
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items.size();) {
      RecvDelivery& d = items[i];
      std::move(d.done)(d.status, d.tensor, d.is_dead);
    }
  }
  static void Release(DeliveryBatch* batch);
};

struct ProgressEngine::SpareBatches {
  // A batch that once carried more than this many callbacks is freed, not kept.
  static constexpr size_t kMaxKeptCapacity = 1024;
  BoundedQueue<DeliveryBatch*> queue{8};

  ~SpareBatches() {
    DeliveryBatch* batch = nullptr;
    while (queue.TryPop(&batch)) delete batch;
  }

  static void Return(DeliveryBatch* batch) {
    std::shared_ptr<SpareBatches> home = std::move(batch->home);
    batch->items.clear();
    batch->next.store(0, std::memory_order_relaxed);
    batch->holders.store(1, std::memory_order_relaxed);
    if (batch->items.capacity() > kMaxKeptCapacity || !home->queue.TryPush(batch)) delete batch;
  }
};

void ProgressEngine::DeliveryBatch::Release(DeliveryBatch* batch) {
  if (batch->holders.fetch_sub(1, std::memory_order_acq_rel) == 1) SpareBatches::Return(batch);
}

namespace {
// The engine whose callbacks the calling thread runs inline, if any.
thread_local const ProgressEngine* inline_callbacks_of = nullptr;
// The engine whose posts the calling thread makes quietly (QuietScope), and whether one of them
// still owes a wake-up (nobody has driven since).
thread_local ProgressEngine* quiet_engine = nullptr;
thread_local bool quiet_owed = false;
}  // namespace

ProgressEngine::QuietScope::QuietScope(ProgressEngine* engine)
    : engine_(engine), outer_(quiet_engine), outer_owed_(quiet_owed) {
  quiet_engine = engine_;
  quiet_owed = false;
}

ProgressEngine::QuietScope::~QuietScope() {
  if (quiet_owed && engine_ != nullptr) engine_->Nudge();
  quiet_engine = outer_;
  quiet_owed = outer_owed_;
}

// A thread in DriveUntil: what Notify of its event wakes, and its place among the waiters parked
// for progress.
struct ProgressEngine::WaitSlot final : Event::Waker {
  enum Mode : int { kRunning, kParked };

  WaitSlot() : thread(std::this_thread::get_id()) {}

  void Wake() override {
    // Both sides store, then load (sequentially consistent): either the waiter sees `woken`
    // before it sleeps, or this sees where it sleeps.
    woken.store(true);
    if (mode.load() == kParked) {
      std::lock_guard<std::mutex> lock(mu);
      cv.notify_one();
    }
  }

  const std::thread::id thread;
  std::atomic<int> mode{kRunning};
  std::atomic<bool> woken{false};
  std::mutex mu;  // parks with cv
  std::condition_variable cv;
};

ProgressEngine::ProgressEngine(fabric::Domain* domain, Executor* executor, Options options,
                               Hooks hooks)
    : domain_(domain),
      executor_(executor),
      options_(options),
      hooks_(std::move(hooks)),
      spare_batches_(std::make_shared<SpareBatches>()),
      inline_first_(options_.inline_callback_limit > absl::ZeroDuration() &&
                    !executor_->runs_inline()) {}

ProgressEngine::~ProgressEngine() { Stop(); }

void ProgressEngine::Start() {
  current_seat_ = std::make_shared<Seat>();
  {
    MutexLock lock(&mu_);
    loops_.emplace_back([this, seat = current_seat_] { Loop(seat); });
  }
  started_.store(true);
  if (inline_first_) watcher_ = std::thread([this] { WatchCallbacks(); });
}

bool ProgressEngine::InInlineCallback() const { return inline_callbacks_of == this; }

bool ProgressEngine::Post(Task& task) {
  if (OnLoopThread()) {
    // On the owner of progress (a completion, a task, or a quick callback): no lock and no
    // wake-up, just later in this turn.
    deferred_.push_back(std::move(task));
    return true;
  }
  if (quiet_engine == this) return PostForWaiter(task);
  {
    MutexLock lock(&mu_);
    if (stopping_) return false;
    tasks_.push_back(std::move(task));
    has_tasks_.store(true, std::memory_order_release);
  }
  if (sleeping_.load()) domain_->Interrupt();
  return true;
}

bool ProgressEngine::PostForWaiter(Task& task) {
  if (OnLoopThread()) {
    deferred_.push_back(std::move(task));
    return true;
  }
  {
    MutexLock lock(&mu_);
    if (stopping_) return false;
    tasks_.push_back(std::move(task));
    has_tasks_.store(true, std::memory_order_release);
  }
  if (!options_.waiters_drive) {
    Nudge();
  } else if (quiet_engine == this) {
    quiet_owed = true;  // the scope's end wakes someone unless this thread drives first
  }
  return true;
}

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
  std::unique_lock<std::mutex> lock(watch_mu_);
  while (!watch_stop_ && RunsCallbacksInline()) {
    // While the loop sleeps nothing runs inline, so the watcher naps longer: an idle task pays
    // for a few wake-ups a second, not one per limit. A callback that blocks right after such a
    // nap is noticed a housekeeping interval late, once.
    const absl::Duration nap = sleeping_.load(std::memory_order_relaxed)
                                   ? std::max(limit, options_.housekeeping_interval)
                                   : limit;
    watch_cv_.wait_for(lock, absl::ToChronoNanoseconds(nap), [this] { return watch_stop_; });
    if (watch_stop_) break;
    const bool in_callbacks = current_seat_->step.load(std::memory_order_relaxed) == kInCallbacks;
    const uint64_t seq = current_seat_->seq.load(std::memory_order_relaxed);
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

bool ProgressEngine::RunDeferred() {
  bool ran = false;
  while (!deferred_.empty()) {
    running_.swap(deferred_);  // deferred_ gets the empty vector, with its capacity
    for (Task& task : running_) std::move(task)();
    running_.clear();
    ran = true;
  }
  return ran;
}

ProgressEngine::TurnResult ProgressEngine::Turn(Seat* seat) {
  turns_.store(turns_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  bool active = false;
  auto at = [this](const char* phase) { phase_.store(phase, std::memory_order_relaxed); };
  at("taking posted tasks");
  if (has_tasks_.load(std::memory_order_acquire)) {
    MutexLock lock(&mu_);
    if (tasks_.empty() && stopping_) return TurnResult::kStop;
    posted_batch_.swap(tasks_);
    // While stopping, keep looking until the queue is empty.
    has_tasks_.store(stopping_, std::memory_order_relaxed);
  }
  at("a posted task");
  for (Task& task : posted_batch_) {
    std::move(task)();
    active = true;
  }
  posted_batch_.clear();
  active |= RunDeferred();
  at("polling the fabric (Domain::Poll)");
  absl::StatusOr<size_t> n = domain_->Poll(absl::MakeSpan(completions_));
  if (!n.ok()) {
    if (n.status() != last_poll_error_) {
      LOG(ERROR) << "grpc+verbs: polling failed: " << n.status();
    }
    last_poll_error_ = n.status();
  } else if (*n > 0) {
    active = true;
    at("handling a completion");
    for (size_t i = 0; i < *n; ++i) hooks_.on_completion(completions_[i]);
    RunDeferred();
  }
  const absl::Time coarse = CoarseNow();
  if (coarse >= next_housekeeping_) {
    at("housekeeping (timeouts, reaping)");
    hooks_.housekeeping(absl::Now());
    RunDeferred();
    next_housekeeping_ = coarse + options_.housekeeping_interval;
  }
  if (!deliveries_.empty()) {
    // One hand-off for the turn's callbacks: a wake-up per callback costs more than the
    // protocol's own work on a small tensor. Named, because with inline callbacks the user's
    // code runs here, and a stall report must not blame the step before it.
    at(executor_->runs_inline() || (seat != nullptr && RunsCallbacksInline())
           ? "a recv callback run inline"
           : "handing recv callbacks on");
    if (!HandOffCallbacks(seat)) return TurnResult::kLeft;  // the loop moved on without it
    active = true;
  }
  return active ? TurnResult::kActive : TurnResult::kIdle;
}

absl::Duration ProgressEngine::SpinBound(bool awaiting) const {
  // After any work the owner spins poll_spin: on this machine kind a wake-up costs 10-20 us of
  // CPU and about as much latency, so a spin that catches the next message saves both, and one
  // that does not costs at most that much. While a peer owes an answer it spins on for about
  // twice as long as answers have taken (the gaps it measured between an idle turn and the next
  // work), up to awaiting_spin: long enough for a round trip, not for a pause between steps.
  if (!awaiting) return options_.poll_spin;
  const double gap_us = gap_us_.load(std::memory_order_relaxed);
  const absl::Duration learned =
      gap_us <= 0 ? options_.awaiting_spin : absl::Microseconds(2 * gap_us + 2);
  return std::clamp(learned, options_.poll_spin,
                    std::max(options_.poll_spin, options_.awaiting_spin));
}

void ProgressEngine::LearnGap(absl::Duration gap) {
  const double us = std::min(absl::ToDoubleMicroseconds(gap), kMaxLearnedGapUs);
  const double old = gap_us_.load(std::memory_order_relaxed);
  gap_us_.store(old <= 0 ? us : old + (us - old) / 8, std::memory_order_relaxed);
}

bool ProgressEngine::NeedsDriver() const {
  return has_tasks_.load() || !deferred_.empty() || !deliveries_.empty() ||
         hooks_.operations_in_flight();
}

void ProgressEngine::TakeForLoop(std::unique_lock<std::mutex>& lock) {
  while (owner_ != Owner::kNobody) {
    loop_parked_ = true;
    loop_cv_.wait(lock);
  }
  loop_parked_ = false;
  owner_ = Owner::kLoop;
  loop_thread_id_.store(std::this_thread::get_id(), std::memory_order_relaxed);
  // This thread's own arming, which it slept on and left before anyone took it back.
  if (armed_) DisarmLocked(lock);
}

void ProgressEngine::ReleaseLocked() {
  loop_thread_id_.store(std::thread::id(), std::memory_order_relaxed);
  owner_ = Owner::kNobody;
  if (loop_parked_) loop_cv_.notify_one();
}

void ProgressEngine::SleepInDomain() {
  phase_.store("waiting for the fabric (Domain::Wait)", std::memory_order_relaxed);
  sleep_fds_.clear();
  // Until housekeeping is due by the coarse clock, which lags the fine one that times the wait by
  // up to one grain: a wait that ends on time would find it not yet due and nap again and again
  // in short slices until the clock ticks, which made an idle task wake about 575 times a second
  // instead of 50. Housekeeping runs at most a grain late.
  absl::Duration timeout =
      std::max(next_housekeeping_ - CoarseNow(), absl::ZeroDuration()) + CoarseClockGrain();
  absl::StatusOr<bool> may_sleep = domain_->PrepareToSleep(&sleep_fds_, &timeout);
  if (!may_sleep.ok() || !*may_sleep || timeout <= absl::ZeroDuration()) {
    if (!may_sleep.ok() && may_sleep.status() != last_poll_error_) {
      LOG(ERROR) << "grpc+verbs: waiting for completions failed: " << may_sleep.status();
      last_poll_error_ = may_sleep.status();
    }
    ClearRevents(&sleep_fds_);
    domain_->FinishSleep(sleep_fds_);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(own_mu_);
    if (stop_requested_.load()) {
      ClearRevents(&sleep_fds_);
      domain_->FinishSleep(sleep_fds_);
      return;
    }
    // Armed, and then let go: a waiter that takes progress while this thread sleeps takes the
    // arming back without waking it.
    armed_fds_ = sleep_fds_;
    armed_ = true;
    loop_in_poll_ = true;
    sleeping_.store(true);
    ReleaseLocked();
  }
  bool work;
  {
    MutexLock lock(&mu_);
    work = !tasks_.empty() || stopping_;
  }
  if (work) {
    ClearRevents(&sleep_fds_);
  } else {
    const timespec ts = absl::ToTimespec(timeout);
    if (ppoll(sleep_fds_.data(), sleep_fds_.size(), &ts, nullptr) < 0) {
      ClearRevents(&sleep_fds_);
    }
  }
  std::unique_lock<std::mutex> lock(own_mu_);
  loop_in_poll_ = false;
  if (owner_ == Owner::kNobody && armed_) {
    // Nobody came (or a waiter came, went, and armed the domain again for this sleep).
    armed_ = false;
    sleeping_.store(false);
    owner_ = Owner::kLoop;
    loop_thread_id_.store(std::this_thread::get_id(), std::memory_order_relaxed);
    lock.unlock();
    domain_->FinishSleep(sleep_fds_);
    return;
  }
  // A waiter took progress, and the arming, over (or is about to take the arming): this thread
  // takes progress back once it is free.
  TakeForLoop(lock);
}

void ProgressEngine::Loop(std::shared_ptr<Seat> seat) {
  seat->tid.store(static_cast<pid_t>(syscall(SYS_gettid)), std::memory_order_relaxed);
  // The kernel lets a sleeping thread's timer fire up to its slack late (50 us by default), which
  // doubles a 50 us nap of a provider without a wait object; this thread's naps are meant.
  prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
  prctl(PR_SET_NAME, "tv-progress", 0UL, 0UL, 0UL);  // for top -H, gdb and tests
  {
    std::unique_lock<std::mutex> lock(own_mu_);
    TakeForLoop(lock);
  }
  // The first idle turn after the last activity (adaptive mode); the fine clock is read only
  // on idle turns, so a busy loop pays for no clock reads but the coarse one.
  absl::Time idle_since = absl::InfiniteFuture();
  while (true) {
    const TurnResult result = Turn(seat.get());
    if (result == TurnResult::kLeft) return;  // the loop moved on without this thread
    if (result == TurnResult::kStop) break;
    if (result == TurnResult::kActive) {
      if (idle_since != absl::InfiniteFuture()) LearnGap(absl::Now() - idle_since);
      idle_since = absl::InfiniteFuture();
      continue;
    }
    // An idle spinning turn gives its core to any runnable thread (a callback thread this loop
    // just woke, a worker about to post the next recv): with as many spinning loops as cores,
    // a woken thread otherwise waits for the scheduler's next tick, which costs far more than
    // the transfer it would start.
    if (options_.poll_mode == PollMode::kBusy) {
      std::this_thread::yield();
      continue;
    }
    if (options_.poll_mode == PollMode::kAdaptive) {
      const absl::Time now = absl::Now();
      if (idle_since == absl::InfiniteFuture()) idle_since = now;
      const bool awaiting = hooks_.awaiting_peer && hooks_.awaiting_peer();
      if (now - idle_since < SpinBound(awaiting)) {
        std::this_thread::yield();
        continue;
      }
      // Data progress is manual on libfabric's shm and tcp providers: a transfer in flight
      // moves only while this thread polls, so it does not sleep until its writes complete.
      if (hooks_.operations_in_flight()) continue;
    }
    const uint64_t drives = waiter_drives_.load(std::memory_order_relaxed);
    SleepInDomain();
    // A gap that a waiter's driving filled in teaches nothing about this thread's spin.
    if (waiter_drives_.load(std::memory_order_relaxed) != drives) {
      idle_since = absl::InfiniteFuture();
    }
  }
  // From here on the owner's objects are used by the thread that tears it down; callbacks go
  // to the executor directly. This thread keeps progress: no waiter takes it after Stop.
  stopped_.store(true);
  phase_.store("stopped", std::memory_order_relaxed);
  loop_thread_id_.store(std::thread::id());
  HandOffCallbacks(nullptr);
}

bool ProgressEngine::DriveUntil(Event& event, absl::Time deadline) {
  if (event.HasBeenNotified()) return true;
  // A thread that drives already (a quick callback, a posted task) or runs callbacks inline
  // cannot drive again from inside; it waits as any thread waits without an engine.
  if (!options_.waiters_drive || !started_.load() || stop_requested_.load() || OnLoopThread() ||
      InInlineCallback()) {
    Nudge();  // what this thread posted for its wait (PostForWaiter) is someone else's to run
    if (quiet_engine == this) quiet_owed = false;
    return event.WaitUntil(deadline);
  }
  WaitSlot slot;
  if (!event.AddWaker(&slot)) return true;
  // This wait runs what the thread posted, or nudges whoever drives (AcquireForWaiter).
  if (quiet_engine == this) quiet_owed = false;
  while (!event.HasBeenNotified() && !stop_requested_.load() && absl::Now() < deadline) {
    if (TakeIdleProgress(&slot)) {
      const bool idle = DriveAsOwner(event, deadline);
      ReleaseFromWaiter();
      // Nothing more to do but wait: the completion comes through whoever drives next (the
      // progress thread, woken by the fabric), which runs this thread's quick callback.
      if (idle) ParkUntil(&slot, event, deadline, /*spin=*/false);
    } else {
      // Another thread drives, and runs this thread's quick callback when its completion comes:
      // wait for that, spinning first where it may come soon; the loop takes progress if the
      // other thread lets it go idle meanwhile.
      ParkUntil(&slot, event, std::min(deadline, absl::Now() + kDriverCheck), /*spin=*/true);
    }
  }
  event.RemoveWaker(&slot);
  // Stop came: the recv fails on the teardown's thread, or the deadline ends the wait.
  return event.HasBeenNotified() || event.WaitUntil(deadline);
}

void ProgressEngine::ParkUntil(WaitSlot* slot, Event& event, absl::Time deadline, bool spin) {
  if (spin) {
    const absl::Time spin_end = std::min(deadline, absl::Now() + SpinBound(/*awaiting=*/false));
    while (!event.HasBeenNotified() && absl::Now() < spin_end) std::this_thread::yield();
    if (event.HasBeenNotified()) return;
  }
  std::unique_lock<std::mutex> slot_lock(slot->mu);
  slot->mode.store(WaitSlot::kParked);
  while (!slot->woken.load() && !event.HasBeenNotified()) {
    if (deadline == absl::InfiniteFuture()) {
      slot->cv.wait(slot_lock);
    } else if (slot->cv.wait_until(slot_lock, absl::ToChronoTime(deadline)) ==
               std::cv_status::timeout) {
      break;
    }
  }
  slot->mode.store(WaitSlot::kRunning);
  slot->woken.store(false);
}

bool ProgressEngine::TakeIdleProgress(WaitSlot* slot) {
  std::unique_lock<std::mutex> lock(own_mu_);
  if (stop_requested_.load() || owner_ != Owner::kNobody) return false;
  owner_ = Owner::kWaiter;
  loop_thread_id_.store(slot->thread, std::memory_order_relaxed);
  TakeArmingLocked(lock);
  return true;
}

void ProgressEngine::TakeArmingLocked(std::unique_lock<std::mutex>& lock) {
  waiter_drives_.fetch_add(1, std::memory_order_relaxed);
  // The progress thread sleeps on the arming it made (or is on its way out of that sleep): take
  // it back (nobody needs its wake-ups while this thread polls) and leave the thread asleep.
  if (armed_) DisarmLocked(lock);
}

void ProgressEngine::DisarmLocked(std::unique_lock<std::mutex>& lock) {
  armed_ = false;
  sleeping_.store(false);
  lock.unlock();
  ClearRevents(&armed_fds_);
  domain_->FinishSleep(armed_fds_);
  lock.lock();
}

bool ProgressEngine::DriveAsOwner(Event& event, absl::Time deadline) {
  absl::Time idle_since = absl::InfiniteFuture();
  while (true) {
    const TurnResult result = Turn(nullptr);
    if (result == TurnResult::kStop || event.HasBeenNotified() || stop_requested_.load()) {
      return false;
    }
    if (result == TurnResult::kActive) {
      if (idle_since != absl::InfiniteFuture()) LearnGap(absl::Now() - idle_since);
      idle_since = absl::InfiniteFuture();
      continue;
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) return false;
    if (options_.poll_mode == PollMode::kBusy) {
      std::this_thread::yield();
      continue;
    }
    if (idle_since == absl::InfiniteFuture()) idle_since = now;
    if (options_.waiter_spin.has_value()) {
      if (now - idle_since < *options_.waiter_spin) {
        std::this_thread::yield();
        continue;
      }
    } else if (options_.poll_mode == PollMode::kAdaptive) {
      // While a peer owes an answer the waiter spins as the progress thread would: if it slept,
      // the answer would wake the progress thread, and that thread the waiter, two wake-ups
      // per message (the Python package's 4 B round trip went from 52 to 126-183 us).
      const bool awaiting = hooks_.awaiting_peer && hooks_.awaiting_peer();
      if (now - idle_since < SpinBound(awaiting)) {
        std::this_thread::yield();
        continue;
      }
    }
    // Data progress is manual on libfabric's shm and tcp providers: this thread's writes move
    // only while someone polls, and it is the one that can.
    if (hooks_.operations_in_flight()) continue;
    // Idle past the spin: the progress thread sleeps in the domain for this waiter (a wake-up
    // of one thread when the answer comes, instead of two sleepers on the same doorbell).
    return true;
  }
}

void ProgressEngine::ReleaseFromWaiter() {
  for (int i = 0; i < kDrainTurns && !stop_requested_.load() && hooks_.operations_in_flight();
       ++i) {
    if (Turn(nullptr) == TurnResult::kStop) break;
  }
  // Where work has come soon after idle turns (a peer's requests in a conversation), the
  // progress thread is woken to spin rather than left asleep: the next request, which arrives
  // while this thread is back in the caller's code, would otherwise pay its wake-up on the
  // critical path (the Python package's 4 B round trip: 126-149 us asleep, 83-104 us so).
  const double gap_us = gap_us_.load(std::memory_order_relaxed);
  const bool conversing =
      options_.poll_mode == PollMode::kAdaptive && gap_us > 0 &&
      gap_us < absl::ToDoubleMicroseconds(std::max(options_.poll_spin, options_.awaiting_spin));
  const bool needs_driver = NeedsDriver() || conversing;
  std::unique_lock<std::mutex> lock(own_mu_);
  auto may_rearm = [&] {
    return !needs_driver && !loop_parked_ && loop_in_poll_ && !armed_ && !stop_requested_.load();
  };
  if (may_rearm()) {
    // The progress thread still sleeps on the fds it armed: arm the domain for that sleep
    // again, so that it wakes for what comes next and not before.
    lock.unlock();
    rearm_fds_.clear();
    absl::Duration timeout = options_.housekeeping_interval;
    absl::StatusOr<bool> may_sleep = domain_->PrepareToSleep(&rearm_fds_, &timeout);
    const bool armed = may_sleep.ok() && *may_sleep;
    const bool same =
        armed && SameFds(rearm_fds_, armed_fds_) && timeout >= options_.housekeeping_interval;
    lock.lock();
    if (same && may_rearm()) {
      armed_ = true;
      sleeping_.store(true);
      owner_ = Owner::kNobody;
      loop_thread_id_.store(std::thread::id(), std::memory_order_relaxed);
      lock.unlock();
      // A Post that found nobody asleep before the store above must still be seen.
      if (has_tasks_.load()) domain_->Interrupt();
      return;
    }
    // It could not be armed for that sleep as it is: undo, and wake the thread instead.
    lock.unlock();
    ClearRevents(&rearm_fds_);
    domain_->FinishSleep(rearm_fds_);
    lock.lock();
  }
  ReleaseLocked();
  // The progress thread asleep on a sleep that no longer wakes it drives from here on.
  const bool wake_loop = !loop_parked_ && loop_in_poll_;
  lock.unlock();
  if (wake_loop) domain_->Interrupt();
}

std::string ProgressEngine::Where() const {
  if (!started_.load() || stopped_.load()) return std::string();
  return absl::StrCat(options_.name, ": the progress thread is in ",
                      phase_.load(std::memory_order_relaxed), " after ",
                      turns_.load(std::memory_order_relaxed), " turns");
}

std::optional<std::string> ProgressEngine::StallReport(absl::Duration limit) {
  if (!started_.load() || stopped_.load()) return std::nullopt;
  const uint64_t turns = turns_.load(std::memory_order_relaxed);
  const char* phase = phase_.load(std::memory_order_relaxed);
  const absl::Time now = absl::Now();
  MutexLock lock(&stall_mu_);
  if (turns != watched_turns_ || watched_since_ == absl::InfinitePast()) {
    watched_turns_ = turns;
    watched_since_ = now;
    stall_reported_ = false;
    return std::nullopt;
  }
  const absl::Duration stalled = now - watched_since_;
  if (stall_reported_ || stalled < limit) return std::nullopt;
  stall_reported_ = true;
  return absl::StrCat(options_.name, ": the progress thread has made no turn for at least ",
                      absl::FormatDuration(absl::Trunc(stalled, absl::Milliseconds(1))),
                      "; it is in ", phase,
                      ". Every channel of this task waits for it: a fabric provider call that "
                      "does not return, or a callback that blocks the loop");
}

void ProgressEngine::Stop() {
  std::vector<Task> never_run;
  bool never_started = false;
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    stop_requested_.store(true);
    has_tasks_.store(true, std::memory_order_release);  // the owner looks, and sees it stop
    if (loops_.empty()) {
      // Never started: what was posted runs here, on the thread that now owns everything.
      never_started = true;
      stopped_.store(true);
      never_run.swap(tasks_);
    }
  }
  if (never_started) {
    for (Task& task : never_run) std::move(task)();
    HandOffCallbacks(nullptr);
    return;
  }
  domain_->Interrupt();
  // A callback that holds the loop while it stops may still move it to a new thread, which
  // then winds the loop down: so the threads are joined until no new one came.
  while (true) {
    std::vector<std::thread> loops;
    {
      MutexLock lock(&mu_);
      loops.swap(loops_);
    }
    if (loops.empty()) break;
    for (std::thread& loop : loops) loop.join();
  }
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    watch_stop_ = true;
  }
  watch_cv_.notify_all();
  if (watcher_.joinable()) watcher_.join();
}

}  // namespace tensorverbs::protocol
