#include "src/protocol/progress_engine.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/common/bounded_queue.h"
#include "src/common/coarse_clock.h"
#include "src/common/logging.h"
#include "src/protocol/progress_engine_internal.h"

namespace tensorverbs::protocol {
namespace progress_internal {
constinit thread_local ProgressEngine* quiet_engine = nullptr;
constinit thread_local bool quiet_owed = false;
}  // namespace progress_internal

namespace {

using progress_internal::ClearRevents;
using progress_internal::quiet_engine;
using progress_internal::quiet_owed;

// One gap longer than this counts as this long in the average: a pause between training steps
// should not teach the owner never to spin again.
constexpr double kMaxLearnedGapUs = 2000;

}  // namespace

absl::StatusOr<PollMode> ParsePollMode(absl::string_view name) {
  if (name == "busy") return PollMode::kBusy;
  if (name == "blocking") return PollMode::kBlocking;
  if (name == "adaptive") return PollMode::kAdaptive;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown poll mode '", name,
                   "' (TENSORVERBS_POLL_MODE); expected busy, blocking or adaptive"));
}

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

ProgressEngine::ProgressEngine(fabric::Domain* domain, Executor* executor, Options options,
                               Hooks hooks)
    : domain_(domain),
      executor_(executor),
      options_(options),
      hooks_(std::move(hooks)),
      spare_batches_(std::make_shared<SpareBatches>()),
      inline_first_(options_.inline_callback_limit > absl::ZeroDuration() &&
                    !executor_->runs_inline()) {
  (void)CpuClockCost();  // measured here, not inside the first timed turn
}

ProgressEngine::~ProgressEngine() { Stop(); }

void ProgressEngine::Start() {
  current_seat_ = std::make_shared<Seat>();
  {
    MutexLock lock(&mu_);
    loops_.emplace_back([this, seat = current_seat_] { Loop(seat); });
  }
  last_turn_ns_.store(absl::ToUnixNanos(CoarseNow()), std::memory_order_relaxed);
  started_.store(true);
  if (inline_first_) watcher_ = std::thread([this] { WatchCallbacks(); });
}

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
  const uint64_t turn = turns_.load(std::memory_order_relaxed) + 1;
  turns_.store(turn, std::memory_order_relaxed);
  const bool timed = turn % kIdleSampleEvery == 0;
  // The CPU clock is read outside the wall clock's reads, so the wall time has no part of it.
  const int64_t started_cpu = timed ? ThreadCpuNanos() : 0;
  const auto started =
      timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
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
  // The coarse clock lags the fine one, so this is no later than the poll (IdlePollAge).
  const absl::Time poll_start = CoarseNow();
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
  last_turn_ns_.store(absl::ToUnixNanos(coarse), std::memory_order_relaxed);
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
  if (active) return TurnResult::kActive;
  if (n.ok()) last_idle_poll_ns_.store(absl::ToUnixNanos(poll_start), std::memory_order_relaxed);
  if (timed) {
    const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::steady_clock::now() - started)
                           .count();
    const int64_t cpu_ns = ThreadCpuNanos() - started_cpu - CpuClockCost();
    auto clamp = [](int64_t v) {
      return static_cast<uint32_t>(std::clamp<int64_t>(v, 0, std::numeric_limits<uint32_t>::max()));
    };
    const uint64_t n = restart_idle_samples_.exchange(false, std::memory_order_relaxed)
                           ? 0
                           : idle_turn_samples_.load(std::memory_order_relaxed);
    idle_turn_ns_[n % kIdleSamples].store(clamp(ns), std::memory_order_relaxed);
    idle_turn_cpu_ns_[n % kIdleSamples].store(clamp(cpu_ns), std::memory_order_relaxed);
    idle_turn_samples_.store(n + 1, std::memory_order_release);
  }
  return TurnResult::kIdle;
}

int64_t ProgressEngine::ThreadCpuNanos() {
  timespec ts{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return 0;
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

int64_t ProgressEngine::CpuClockCost() {
  // What the clock's own two reads add to a sample (a system call each, about half a
  // microsecond here, which would otherwise be most of a turn over loopback).
  static const int64_t cost = [] {
    int64_t least = std::numeric_limits<int64_t>::max();
    for (int i = 0; i < 32; ++i) {
      const int64_t a = ThreadCpuNanos();
      least = std::min(least, ThreadCpuNanos() - a);
    }
    return least;
  }();
  return cost;
}

std::optional<ProgressEngine::TurnCost> ProgressEngine::IdleTurnCost() const {
  // Samples from before a restart the loop has not applied yet describe what was to be dropped.
  if (restart_idle_samples_.load(std::memory_order_relaxed)) return std::nullopt;
  const uint64_t n =
      std::min<uint64_t>(idle_turn_samples_.load(std::memory_order_acquire), kIdleSamples);
  if (n == 0) return std::nullopt;
  auto median = [n](const std::atomic<uint32_t>* ring) {
    std::vector<uint32_t> ns(n);
    for (uint64_t i = 0; i < n; ++i) ns[i] = ring[i].load(std::memory_order_relaxed);
    std::nth_element(ns.begin(), ns.begin() + n / 2, ns.end());
    return absl::Nanoseconds(ns[n / 2]);
  };
  return TurnCost{median(idle_turn_ns_), median(idle_turn_cpu_ns_)};
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
      // It yields between polls: the peer that has to move the transfer may be waiting for
      // this core.
      if (hooks_.operations_in_flight()) {
        std::this_thread::yield();
        continue;
      }
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

std::string ProgressEngine::Where() const {
  if (!started_.load() || stopped_.load()) return std::string();
  return absl::StrCat(options_.name, ": the progress thread is in ",
                      phase_.load(std::memory_order_relaxed), " after ",
                      turns_.load(std::memory_order_relaxed), " turns");
}

bool ProgressEngine::TurnedWithin(absl::Duration limit) const {
  if (stop_requested_.load() || stopped_.load()) return false;
  if (!started_.load()) return true;
  const int64_t last = last_turn_ns_.load(std::memory_order_relaxed);
  return CoarseNow() - absl::FromUnixNanos(last) < limit;
}

std::optional<absl::Duration> ProgressEngine::IdlePollAge() const {
  const int64_t ns = last_idle_poll_ns_.load(std::memory_order_relaxed);
  if (ns == 0) return std::nullopt;
  return std::max(absl::Now() - absl::FromUnixNanos(ns), absl::ZeroDuration());
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
