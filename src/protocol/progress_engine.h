// ProgressEngine: the one thread that owns a fabric domain and everything that uses it (the
// channels, the memory manager's registrations), and the loop it runs.
//
// Each turn the loop runs the tasks other threads posted, polls the domain and hands each
// completion to `Hooks::on_completion`, runs `Hooks::housekeeping` every
// `housekeeping_interval`, and gives the recv outcomes (user callbacks) completed in the turn
// to the executor in one hand-off. Work posted from the loop thread itself (a completion that
// sets off more work) is deferred to the end of the current step of the turn without a lock.
// When idle it waits according to the poll mode: busy never sleeps; blocking sleeps in
// Domain::Wait as soon as nothing is ready; adaptive spins for `poll_spin` after the last
// activity and does not sleep while `Hooks::operations_in_flight` says a transfer is moving
// (libfabric's shm and tcp providers move data only while the initiator polls). A Post from
// another thread interrupts the sleep.
//
// Callbacks run inline first (`inline_callback_limit` above zero, and an executor with threads):
// the loop runs the turn's callbacks itself, which saves the wake-up of a callback thread (about
// 7 us on a 2-vCPU machine, more than a small recv's whole protocol). While it does, the thread
// counts as the loop for nobody (a Post from a callback takes the queue), so that the loop can
// leave it: a watcher thread that sees one callback hold the loop for the limit starts a new
// loop thread, gives the rest of the turn's callbacks to the executor, hands the thread it left
// to the executor (which joins it as one of its own), and from then on every callback goes to
// the executor. So a callback that blocks (on a lock, the GIL, a recv of its own) costs the
// other transfers one stall of about the limit, once, instead of all of them for as long as it
// blocks.
//
// Threading: Post, DeliverRecv, AskLoop and Stop may be called from any thread; state
// reached only through the hooks belongs to the loop thread, which OnOwnerThread() identifies
// (and, after Stop, the thread tearing the owner down). Stop runs what was posted before it,
// then joins; a Post after Stop returns false and leaves the task to its caller, so no callback
// is lost.
#ifndef TENSORVERBS_PROTOCOL_PROGRESS_ENGINE_H_
#define TENSORVERBS_PROTOCOL_PROGRESS_ENGINE_H_

#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
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
    absl::Duration poll_spin = absl::Microseconds(50);
    // Adaptive mode spins this long (if longer than poll_spin) while a peer owes this side an
    // answer: on a fabric without a wait object a nap would delay it by up to the nap.
    absl::Duration awaiting_spin = absl::Milliseconds(1);
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
  // Runs a recv's `done` with its outcome on the executor: on the loop thread, with the turn's
  // other recvs at the end of the turn (one task for all of them, so a recv costs no heap
  // allocation of its own); elsewhere at once.
  struct RecvDelivery {
    RecvDoneCallback done;
    absl::Status status;
    Tensor tensor;
    bool is_dead = false;
  };
  void DeliverRecv(RecvDelivery delivery);

  bool OnLoopThread() const {
    return std::this_thread::get_id() == loop_thread_id_.load(std::memory_order_relaxed);
  }
  // The loop thread while it runs; any thread once it has stopped (the owner's teardown).
  bool OnOwnerThread() const { return OnLoopThread() || stopped_.load(); }
  // Whether the calling thread is running this engine's recv callbacks inline: the loop's own
  // thread in the callback step of a turn, or a thread the loop left while a callback held it.
  // User code there must not wait for the task's own threads.
  bool InInlineCallback() const;
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
  // Where the loop is now and how many turns it made ("NAME: the progress thread is in a
  // posted task after 1234 turns"), or empty while it never started or after it stopped. Any
  // thread; it disturbs no StallReport.
  std::string Where() const;

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
  // Runs the deferred tasks (and those they defer); true if there were any.
  bool RunDeferred();
  // The turn's recv deliveries: run inline on `seat`'s thread if it is given and the engine
  // still does, otherwise to the executor (loop thread, or the stopping one). False when the
  // calling thread stopped being the loop while it ran them: it must leave the loop at once.
  bool HandOffCallbacks(Seat* seat);
  struct DeliveryBatch;
  bool RunInline(DeliveryBatch* batch, Seat* seat);
  // The watcher of inline callbacks (its own thread), and what it does when one held the loop.
  void WatchCallbacks();
  void MoveLoop();

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
  // Set by the loop before it sleeps, so Post knows to interrupt the wait.
  std::atomic<bool> sleeping_{false};
  std::atomic<std::thread::id> loop_thread_id_{};
  std::atomic<bool> stopped_{false};
  std::atomic<bool> started_{false};  // the loop thread exists (StallReport reads it)
  // Written by the loop thread alone (plain stores, no read-modify-write on its hot path): its
  // turn count and where in the turn it is (a string literal), for StallReport.
  std::atomic<uint64_t> turns_{0};
  std::atomic<const char*> phase_{"starting"};
  // StallReport's view: the turn count it last saw move, since when, and whether this stall
  // was reported.
  Mutex stall_mu_;
  uint64_t watched_turns_ ABSL_GUARDED_BY(stall_mu_) = 0;
  absl::Time watched_since_ ABSL_GUARDED_BY(stall_mu_) = absl::InfinitePast();
  bool stall_reported_ ABSL_GUARDED_BY(stall_mu_) = false;
  // Loop thread: tasks posted on it, run later in the same turn; user callbacks completed in
  // this turn, handed to the executor at its end.
  std::vector<Task> deferred_;
  std::vector<Task> running_;  // RunDeferred's batch, kept for its capacity
  std::vector<RecvDelivery> deliveries_;
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
