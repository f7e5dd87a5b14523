// The progress engine's waiters: how a thread that waits for an event drives progress itself,
// parks behind another driver, and hands progress back when it leaves (see progress_engine.h:
// the owner of progress).
#include <algorithm>
#include <utility>

#include "absl/time/clock.h"
#include "src/common/logging.h"
#include "src/protocol/progress_engine.h"
#include "src/protocol/progress_engine_internal.h"

namespace tensorverbs::protocol {
namespace {

using progress_internal::ClearRevents;
using progress_internal::quiet_engine;
using progress_internal::quiet_owed;

// Whether two sleeps would poll the same fds for the same events.
bool SameFds(const std::vector<pollfd>& a, const std::vector<pollfd>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].fd != b[i].fd || a[i].events != b[i].events) return false;
  }
  return true;
}

// How many turns a waiter that leaves runs, at most, while a transfer it set off is still in
// flight (the write of an acknowledgement): each completes within a turn or two, and finishing
// it here spares the progress thread a wake-up.
constexpr int kDrainTurns = 8;
// How often a waiter whose recv another thread drives looks whether progress went idle (and so
// its to take): the driver's sleep arms the domain for the waiter's completion too, so this
// only bounds a wait for a driver that left without anyone to hand progress to.
constexpr absl::Duration kDriverCheck = absl::Milliseconds(20);

}  // namespace

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
    // only while someone polls, and it is the one that can; it yields between polls to the
    // peer that may have to move them.
    if (hooks_.operations_in_flight()) {
      std::this_thread::yield();
      continue;
    }
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

}  // namespace tensorverbs::protocol
