// ProgressEngine: the progress of one fabric domain and of everything that uses it (the
// channels, the memory manager's registrations): who drives it, and the turn each driver runs.
//
// A turn runs the tasks other threads posted, polls the domain and hands each completion to
// `Hooks::on_completion`, runs `Hooks::housekeeping` every `housekeeping_interval`, and ends with
// the recv outcomes (user callbacks) completed in the turn. Work posted by the driving thread
// itself (a completion that sets off more work) is deferred to the end of the current step of
// the turn without a lock.
//
// One thread at a time drives: the owner of progress. Two kinds of thread own it in turn:
// - A thread that waits for a recv (DriveUntil, under Task::Wait) drives while it waits: it runs
//   turns itself, so the completion it waits for is polled, handled and delivered on that very
//   thread, with no hand-off to the progress thread and back through a callback thread. While it
//   owns progress, other waiters park; they take over, one at a time, when it leaves.
// - The engine's own thread (`tv-progress`) drives whenever no waiter does: for what nobody waits
//   on (requests of peers, pushed tensors, send completions, asynchronous callbacks). A waiter that
//   arrives while it drives asks for progress and gets it at the end of the thread's turn.
// When the owner is idle it spins `poll_spin` (a wake-up costs about as much), or, while a peer
// owes an answer, about twice as long as answers took after earlier idle turns (between
// `poll_spin` and `awaiting_spin`: the bound is learned), and does not
// sleep while `Hooks::operations_in_flight` says a transfer moves (libfabric's shm and tcp
// providers move data only while the initiator polls); then it sleeps in the domain's wait
// objects. The progress thread sleeps there without owning progress (the domain is armed, then
// released), so a waiter takes progress over from a sleeping progress thread without waking it;
// it takes the arming back (FinishSleep) and, when it leaves with nothing in flight, arms the
// domain for the sleeping thread again. A waiter that owns progress sleeps in the domain itself.
// A Post from another thread interrupts whichever sleep is on duty.
//
// Recv outcomes: a delivery marked `quick` (its callback only stores the result and notifies an
// Event) runs on the driving thread at the end of the turn, whoever drives. Others run on the
// executor, or inline on the progress thread first (`inline_callback_limit` above zero, and an
// executor with threads): the loop runs them itself, which saves the wake-up of a callback thread
// (about 7 us on a 2-vCPU machine, more than a small recv's whole protocol). While it does, the
// thread counts as the loop for nobody (a Post from a callback takes the queue), so that the loop
// can leave it: a watcher thread that sees one callback hold the loop for the limit starts a new
// loop thread, gives the rest of the turn's callbacks to the executor, hands the thread it left to
// the executor (which joins it as one of its own), and from then on every callback goes to the
// executor. So a callback that blocks (on a lock, the GIL, a recv of its own) costs the other
// transfers one stall of about the limit, once, instead of all of them for as long as it blocks.
// A waiter's thread never runs a callback that is not quick: those go to the executor.
//
// Threading: Post, DeliverRecv, AskLoop, DriveUntil and Stop may be called from any thread;
// state reached only through the hooks belongs to the owner of progress, which OnLoopThread()
// identifies (and, after Stop, the thread tearing the owner down: OnOwnerThread()). Stop runs what
// was posted before it, then joins; a waiter that drives when Stop comes leaves the driving to the
// progress thread's last turn. A Post after Stop returns false and leaves the task to its caller,
// so no callback is lost.
#ifndef TENSORVERBS_PROTOCOL_PROGRESS_ENGINE_H_
#define TENSORVERBS_PROTOCOL_PROGRESS_ENGINE_H_

#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "src/common/executor.h"
#include "src/common/mutex.h"
#include "src/fabric/fabric.h"
#include "src/rendezvous/local_rendezvous.h"
#include "tensorverbs/event.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::protocol {

enum class PollMode { kBusy, kBlocking, kAdaptive };
// "busy", "blocking" or "adaptive"; InvalidArgument naming TENSORVERBS_POLL_MODE otherwise.
absl::StatusOr<PollMode> ParsePollMode(absl::string_view name);

class ProgressEngine {
 public:
  using Task = absl::AnyInvocable<void() &&>;

  struct Options {
    PollMode poll_mode = PollMode::kAdaptive;
    // Adaptive mode: how long an idle owner spins before it sleeps, where no peer owes it an
    // answer.
    absl::Duration poll_spin = absl::Microseconds(50);
    // The most it spins while a peer owes this side an answer (it learns the bound, at least
    // poll_spin): on a fabric without a wait object a nap would delay the answer by up to the
    // nap, and with one the wake-up costs about as much as a short round trip.
    absl::Duration awaiting_spin = absl::Milliseconds(1);
    // Whether threads that wait (DriveUntil) drive progress themselves; otherwise they sleep
    // until the progress thread completes what they wait for. The transport sets it from
    // TENSORVERBS_WAITER_PROGRESS.
    bool waiters_drive = true;
    // When set, how long a waiter that owns progress spins while idle before it leaves the
    // fabric to the progress thread, instead of the learned bound (tests pin it).
    std::optional<absl::Duration> waiter_spin;
    absl::Duration housekeeping_interval = absl::Milliseconds(20);
    // What a stall report calls this loop ("grpc+verbs over shmem (shmem)").
    std::string name = "the progress loop";
    // Above zero, with an executor of threads: recv callbacks run on the loop thread until one
    // holds it this long, then on the executor (see above). Zero: always on the executor. The
    // transport sets it from TENSORVERBS_INLINE_CALLBACK_US.
    absl::Duration inline_callback_limit = absl::ZeroDuration();
  };
  struct Hooks {
    std::function<void(const fabric::Completion&)> on_completion;
    std::function<void(absl::Time now)> housekeeping;
    std::function<bool()> operations_in_flight;
    // Whether a peer owes this side something (content for a pending request); may be null.
    std::function<bool()> awaiting_peer;
  };

  // `domain` and `executor` outlive the engine.
  ProgressEngine(fabric::Domain* domain, Executor* executor, Options options, Hooks hooks);
  ProgressEngine(const ProgressEngine&) = delete;
  ProgressEngine& operator=(const ProgressEngine&) = delete;
  ~ProgressEngine();  // Stop()

  void Start();
  // Runs what was posted, stops the loop and joins it (idempotent; on an engine never started,
  // runs what was posted on the calling thread). Never on the loop thread.
  void Stop();

  // Queues `task` for the loop thread; false (and `task` left untouched) after Stop. On the
  // loop thread itself, defers it to later in the current turn.
  bool Post(Task& task);
  bool Post(Task&& task) { return Post(task); }
  // As Post, for a task that the posting thread's own DriveUntil, about to come, runs: nobody
  // is woken for it (the progress thread would only have to hand progress over). Another thread
  // that drives runs it at its next turn; with nobody driving, the progress thread does when it
  // next wakes (its housekeeping interval at the latest). With waiters_drive off, as Post.
  bool PostForWaiter(Task& task);
  // Wakes the thread on duty if it sleeps in the domain, so that it looks at what was posted.
  void Nudge() {
    if (sleeping_.load()) domain_->Interrupt();
  }
  // A burst of work on the calling thread that ends in its own DriveUntil (or the scope's end):
  // while it lives, what the thread posts wakes nobody (as PostForWaiter), and the scope's end
  // wakes the thread on duty if the thread did not drive since. For a collective: its sends and
  // recvs, and the waits between them, all on one thread, with no other thread woken for them.
  class QuietScope {
   public:
    explicit QuietScope(ProgressEngine* engine);
    QuietScope(const QuietScope&) = delete;
    QuietScope& operator=(const QuietScope&) = delete;
    ~QuietScope();

   private:
    ProgressEngine* const engine_;
    ProgressEngine* const outer_;
    const bool outer_owed_;
  };
  // Runs a recv's `done` with its outcome: on the owner of progress, at the end of the turn,
  // with the turn's other recvs (one task for all of them, so a recv costs no heap allocation
  // of its own): a quick one there and then, the others as the engine runs callbacks (above);
  // from any other thread, on the executor at once.
  struct RecvDelivery {
    RecvDoneCallback done;
    absl::Status status;
    Tensor tensor;
    bool is_dead = false;
    // `done` only stores the outcome and notifies (RecvArgs::quick_callback): it may run on
    // whichever thread drives progress, a waiter's included.
    bool quick = false;
  };
  void DeliverRecv(RecvDelivery delivery);

  // Blocks the calling thread until `event` is notified or `deadline` passes, and says whether
  // it was notified. Meanwhile the thread drives progress whenever no other thread does (see
  // above); it only sleeps before Start, after Stop, with `waiters_drive` off, and on a thread
  // that drives already (a quick callback, a posted task) or runs callbacks inline. A waiter that
  // gives up (its deadline) hands progress on; nothing it would have run is lost.
  bool DriveUntil(Event& event, absl::Time deadline);

  bool OnLoopThread() const {
    return std::this_thread::get_id() == loop_thread_id_.load(std::memory_order_relaxed);
  }
  // The loop thread while it runs; any thread once it has stopped (the owner's teardown).
  bool OnOwnerThread() const { return OnLoopThread() || stopped_.load(); }
  // Whether the calling thread is running this engine's recv callbacks inline: the loop's own
  // thread in the callback step of a turn, or a thread the loop left while a callback held it.
  // User code there must not wait for the task's own threads.
  bool InInlineCallback() const;
  // How many times a waiting thread took progress over (DriveUntil), for tests and stats.
  uint64_t waiter_drives() const { return waiter_drives_.load(std::memory_order_relaxed); }
  // Whether recv callbacks still run inline (false once one held the loop for the limit).
  bool RunsCallbacksInline() const {
    return inline_first_ && loop_moves_.load(std::memory_order_relaxed) == 0;
  }
  // How many times a callback held the loop for the limit and the loop moved to a new thread.
  int loop_moves() const { return loop_moves_.load(std::memory_order_relaxed); }

  // A stuck loop, noticed: when the loop has made no turn for `limit` since the previous call
  // that saw it move, the text of a report naming the loop and the call it is in ("polling the
  // fabric", "a posted task", ...), once per stall; nullopt otherwise (also while it never
  // started or after it stopped). A provider call that never returns stops every channel of
  // the task, which nothing else would say. For one watching thread (the peer watchdog).
  std::optional<std::string> StallReport(absl::Duration limit);
  // Any thread, stateless: whether the loop made a turn within `limit` (an idle loop turns at
  // least every housekeeping interval), or never started. False once it is stopping. What a
  // peer's liveness probe is answered from off the loop (ChannelTable::ProbeOwned) stands
  // only while the loop moves: a wedged loop must look as silent as it is.
  bool TurnedWithin(absl::Duration limit) const;
  // Any thread: how long ago a turn last polled the fabric and found nothing to do (at least
  // that long: the time is taken before the poll), or nullopt while none has. Everything that
  // had landed by then was handled, which is how a peer's probe tells a message lost on the way
  // from one this busy loop has not reached (PeerWatchdog).
  std::optional<absl::Duration> IdlePollAge() const;
  // Where the loop is now and how many turns it made ("NAME: the progress thread is in a
  // posted task after 1234 turns"), or empty while it never started or after it stopped. Any
  // thread; it disturbs no StallReport.
  std::string Where() const;

  // What one idle turn (nothing posted, nothing polled, no callback) costs: the medians of the
  // last kIdleSamples sampled idle turns' wall time and of the loop thread's CPU time in them,
  // or nullopt before any. One turn in kIdleSampleEvery is timed, so the hot path pays four
  // clock reads in that many turns. Wall time includes preemption, which the median keeps out
  // only while most turns are not preempted; with many tasks a core, most are, and the CPU time
  // is the turn's own cost (less the CPU clock's reads, measured once). For `bench scale`, which
  // compares them across cluster sizes. Any thread.
  struct TurnCost {
    absl::Duration wall;
    absl::Duration cpu;
  };
  std::optional<TurnCost> IdleTurnCost() const;
  // Starts IdleTurnCost's samples over from the loop's next timed idle turn, so that they
  // describe what follows (`bench scale`'s steady steps, not its start); IdleTurnCost is nullopt
  // until then. Any thread.
  void RestartIdleTurnCost() { restart_idle_samples_.store(true, std::memory_order_relaxed); }
  // Idle turns timed since the start or the last restart. Any thread.
  uint64_t IdleTurnsTimed() const { return idle_turn_samples_.load(std::memory_order_acquire); }

  // Runs `fn` on the loop thread and returns its result; for other threads, which wait.
  // Cancelled after Stop, DeadlineExceeded if the loop does not get to it within `timeout`.
  template <typename T>
  absl::StatusOr<T> AskLoop(absl::AnyInvocable<T()> fn,
                            absl::Duration timeout = absl::InfiniteDuration()) {
    return AskLoop<T>(std::move(fn), timeout, timeout, [] {});
  }
  // The same, calling `while_waiting` (on the asking thread) every `slice` the loop has not
  // answered yet: how a watcher looks at the loop while the loop keeps it waiting.
  template <typename T>
  absl::StatusOr<T> AskLoop(absl::AnyInvocable<T()> fn, absl::Duration timeout,
                            absl::Duration slice, absl::FunctionRef<void()> while_waiting);

 private:
  // This thread's CPU time, in nanoseconds (0 where the clock cannot be read).
  static int64_t ThreadCpuNanos();
  // Two back-to-back reads of the CPU clock, at least (measured once per process).
  static int64_t CpuClockCost();
  // Where a loop thread is in the callback step of its turns, shared with the watcher. The
  // thread the loop left holds it (and the batch it ran) and nothing else of the engine, which
  // may be gone by the time its callback returns.
  enum CallbackStep : int { kLooping, kInCallbacks, kLeft };
  struct Seat {
    // kInCallbacks while the thread runs callbacks inline; the watcher's claim (kLeft) is what
    // tells it that it no longer is the loop.
    std::atomic<int> step{kLooping};
    // Moves with each callback, so that the watcher can tell one callback that ran for the limit
    // from many short ones.
    std::atomic<uint64_t> seq{0};
    // The thread's id in the kernel, for the watcher to see whether it waits or runs.
    std::atomic<pid_t> tid{0};
  };
  void Loop(std::shared_ptr<Seat> seat);
  enum class TurnResult { kIdle, kActive, kStop, kLeft };
  // One turn, on the owner of progress: `seat` is the progress thread's (null for a waiter,
  // which runs only quick callbacks itself). kStop: Stop came and nothing is left to run;
  // kLeft: the loop left this thread while it ran a callback inline (it must return at once).
  TurnResult Turn(Seat* seat);
  // Runs the deferred tasks (and those they defer); true if there were any.
  bool RunDeferred();
  // The turn's recv deliveries: quick ones at once; the rest inline on `seat`'s thread if it is
  // given and the engine still does, otherwise to the executor. False when the calling thread
  // stopped being the loop while it ran them: it must leave the loop at once.
  bool HandOffCallbacks(Seat* seat);
  struct DeliveryBatch;
  bool RunInline(DeliveryBatch* batch, Seat* seat);
  // The watcher of inline callbacks (its own thread), and what it does when one held the loop.
  void WatchCallbacks();
  void MoveLoop();

  // Who owns progress, and where the progress thread is when it does not.
  enum class Owner { kNobody, kLoop, kWaiter };
  struct WaitSlot;
  // The progress thread: takes progress (parking while a waiter owns it) and finishes an
  // arming of its own left behind.
  void TakeForLoop(std::unique_lock<std::mutex>& lock);
  // The progress thread arms the domain (PrepareToSleep) and sleeps on it without owning
  // progress.
  void SleepInDomain();
  // A waiter: takes progress if nobody drives (the progress thread asleep, or gone from it);
  // true when it owns progress.
  bool TakeIdleProgress(WaitSlot* slot);
  // A waiter that just took progress, under own_mu_: takes back an arming the progress thread
  // sleeps on (FinishSleep), leaving the thread asleep.
  void TakeArmingLocked(std::unique_lock<std::mutex>& lock);
  // Runs turns until the event, the deadline or Stop (false), or until it has been idle past its
  // spin (true: the waiter then parks, and the progress thread sleeps in the domain for it).
  bool DriveAsOwner(Event& event, absl::Time deadline);
  // Parks until `event` is notified or `deadline` passes; with `spin`, spins first for the
  // learned bound.
  void ParkUntil(WaitSlot* slot, Event& event, absl::Time deadline, bool spin);
  // With own_mu_ held (released meanwhile) and the domain armed for the progress thread's
  // sleep: takes that arming back.
  void DisarmLocked(std::unique_lock<std::mutex>& lock);
  void ReleaseFromWaiter();
  // With own_mu_ held, by the owner that lets go: nobody owns progress (the progress thread,
  // where it parks for it, is woken to take it).
  void ReleaseLocked();
  // The spin an idle owner allows itself, from the gaps it measured (adaptive mode).
  absl::Duration SpinBound(bool awaiting) const;
  void LearnGap(absl::Duration gap);
  // Whether an owner that lets go leaves something that needs a driver at once.
  bool NeedsDriver() const;

  fabric::Domain* const domain_;
  Executor* const executor_;
  const Options options_;
  const Hooks hooks_;

  Mutex mu_;
  // Vectors, swapped with the loop's own, so that their capacity is reused turn after turn.
  std::vector<Task> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Set with tasks_ (and with stopping_) so that the loop looks at the queue only when there is
  // something to see.
  std::atomic<bool> has_tasks_{false};
  // Set while the thread on duty (the owner, or the progress thread armed without owning)
  // sleeps in the domain, so Post knows to interrupt the wait.
  std::atomic<bool> sleeping_{false};
  std::atomic<std::thread::id> loop_thread_id_{};
  std::atomic<bool> stopped_{false};
  // The coarse clock (ns since the epoch) at the last turn's end (TurnedWithin).
  std::atomic<int64_t> last_turn_ns_{0};
  // The coarse clock (ns since the epoch) before the poll of the last idle turn; 0: none yet.
  std::atomic<int64_t> last_idle_poll_ns_{0};
  std::atomic<bool> started_{false};  // the loop thread exists (StallReport reads it)
  // Written by the loop thread alone (plain stores, no read-modify-write on its hot path): its
  // turn count and where in the turn it is (a string literal), for StallReport.
  std::atomic<uint64_t> turns_{0};
  std::atomic<const char*> phase_{"starting"};
  // Sampled idle turns' wall time in nanoseconds, a ring written by the owner of progress.
  static constexpr int kIdleSamples = 64;
  static constexpr uint64_t kIdleSampleEvery = 16;
  std::atomic<uint32_t> idle_turn_ns_[kIdleSamples] = {};
  std::atomic<uint32_t> idle_turn_cpu_ns_[kIdleSamples] = {};  // the loop thread's CPU time
  std::atomic<uint64_t> idle_turn_samples_{0};
  std::atomic<bool> restart_idle_samples_{false};  // applied by the loop, which writes the ring
  // StallReport's view: the turn count it last saw move, since when, and whether this stall
  // was reported.
  Mutex stall_mu_;
  uint64_t watched_turns_ ABSL_GUARDED_BY(stall_mu_) = 0;
  absl::Time watched_since_ ABSL_GUARDED_BY(stall_mu_) = absl::InfinitePast();
  bool stall_reported_ ABSL_GUARDED_BY(stall_mu_) = false;
  // The owner of progress's: tasks posted on it, run later in the same turn; user callbacks
  // completed in this turn, handed on at its end; the state a turn keeps between turns.
  std::vector<Task> deferred_;
  std::vector<Task> running_;  // RunDeferred's batch, kept for its capacity
  std::vector<RecvDelivery> deliveries_;
  std::vector<RecvDelivery> quick_;  // the turn's quick deliveries while they run
  std::vector<Task> posted_batch_;   // the posted tasks a turn took
  static constexpr size_t kPollBatch = 64;
  fabric::Completion completions_[kPollBatch];
  absl::Time next_housekeeping_ = absl::InfinitePast();
  absl::Status last_poll_error_;
  // The gaps between the first idle turn and the next work, averaged (adaptive mode's spin):
  // written by the owner, read by waiters that spin for their event too.
  std::atomic<double> gap_us_{0};

  // Ownership (see above). own_mu_ orders every change of owner, and so every hand-over of the
  // owner's state above from one thread to the next.
  std::mutex own_mu_;
  Owner owner_ = Owner::kNobody;  // guarded by own_mu_
  // The progress thread sleeps in the domain (ppoll), or is on its way into that sleep.
  bool loop_in_poll_ = false;  // guarded by own_mu_
  // The domain is armed (PrepareToSleep) for the progress thread's sleep, and nobody has
  // finished that arming yet (FinishSleep). Whoever takes progress finishes it.
  bool armed_ = false;               // guarded by own_mu_
  bool loop_parked_ = false;         // guarded by own_mu_
  std::condition_variable loop_cv_;  // the progress thread parks on it
  // The fds the progress thread sleeps on, as armed: written by the owner that arms, read by
  // the waiter that takes the arming back.
  std::vector<pollfd> armed_fds_;
  std::vector<pollfd> sleep_fds_;  // the progress thread's own sleep
  std::vector<pollfd> rearm_fds_;  // a leaving waiter's arming for that sleep
  std::atomic<bool> stop_requested_{false};
  std::atomic<uint64_t> waiter_drives_{0};
  struct SpareBatches;
  const std::shared_ptr<SpareBatches> spare_batches_;
  // The loop's threads: one, and another each time a callback held the loop and it moved on.
  // The thread it left goes to the executor, which joins it as one of its own.
  std::vector<std::thread> loops_ ABSL_GUARDED_BY(mu_);

  // Inline callbacks: configured, and run until the first move of the loop.
  const bool inline_first_;
  std::atomic<int> loop_moves_{0};
  // The seat of the loop's current thread; the watcher's (written by Start before it starts).
  std::shared_ptr<Seat> current_seat_;
  // The batch whose callbacks run inline now; the loop thread writes it before it publishes
  // kInCallbacks, the watcher reads it after its claim.
  DeliveryBatch* inline_batch_ = nullptr;
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  bool watch_stop_ = false;  // guarded by watch_mu_
  std::thread watcher_;
};

template <typename T>
absl::StatusOr<T> ProgressEngine::AskLoop(absl::AnyInvocable<T()> fn, absl::Duration timeout,
                                          absl::Duration slice,
                                          absl::FunctionRef<void()> while_waiting) {
  // Shared: after a timeout the task may still run and must have somewhere to write.
  struct Answer {
    Notification done;
    T value{};
  };
  auto answer = std::make_shared<Answer>();
  Task task = [answer, fn = std::move(fn)]() mutable {
    answer->value = fn();
    answer->done.Notify();
  };
  if (!Post(task)) return absl::CancelledError("the transport is shutting down");
  const absl::Time deadline = absl::Now() + timeout;
  while (!answer->done.WaitForNotificationWithTimeout(std::min(slice, deadline - absl::Now()))) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError("the progress thread did not answer in time");
    }
    while_waiting();
  }
  return std::move(answer->value);
}

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_PROGRESS_ENGINE_H_
