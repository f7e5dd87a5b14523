// LocalRendezvous: the tag-matching table between Send and Recv for one step.
//
// Send is passive: it stores the tensor under its key, or hands it to a waiting recv. RecvAsync
// takes the tensor if it is there, or leaves a waiter. Matching works in both orders. A second
// Send of a key whose value is still unconsumed, or a second RecvAsync of a key already waited
// for, is AlreadyExists. StartAbort(status) fails every waiter once and makes later calls fail
// with that status.
//
// Thread-safe: one mutex guards the table, and callbacks always run after it is released, on
// the thread that completed the match (Send's, RecvAsync's, CancelRecv's or StartAbort's).
// Every `done` runs exactly once.
//
// Entries hold their key as an interned KeyRef and the table looks them up by views of it, so
// a steady step (the same keys every step) copies no key strings: keys given as a ParsedKey are
// interned in the KeyTable passed at construction (a one-off copy without one). A StepSizeHint
// shared by a task's steps sizes each new table for what the last step held, so a steady step's
// tables do not grow entry by entry.
#ifndef TENSORVERBS_RENDEZVOUS_LOCAL_RENDEZVOUS_H_
#define TENSORVERBS_RENDEZVOUS_LOCAL_RENDEZVOUS_H_

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "src/common/mutex.h"
#include "src/common/trace.h"
#include "src/rendezvous/key_table.h"
#include "tensorverbs/event.h"
#include "tensorverbs/parsed_key.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs {

// Called once with the outcome of a recv: on error the tensor is uninitialized.
using RecvDoneCallback =
    absl::AnyInvocable<void(const absl::Status& status, const Tensor& tensor, bool is_dead) &&>;

// `done`, ending `trace` (TENSORVERBS_TRACE) with the recv's outcome once it returns; `done`
// itself when the trace is empty. Every protocol's recv path wraps its callback with it.
RecvDoneCallback EndTraceAfter(RecvTrace trace, RecvDoneCallback done);

// How many entries the tables of a task's recent steps held at most: the largest step's size,
// forgotten by a sixteenth per smaller step, so that steps which differ a little (how many
// recvs arrived before their sends) all fit, and one huge step does not size every later one.
// Any thread; a lost update only costs a table some growth.
class StepSizeHint {
 public:
  size_t items() const { return items_.load(std::memory_order_relaxed); }
  size_t waiters() const { return waiters_.load(std::memory_order_relaxed); }
  void Record(size_t items, size_t waiters) {
    Remember(items_, items);
    Remember(waiters_, waiters);
  }

 private:
  static void Remember(std::atomic<size_t>& hint, size_t seen) {
    const size_t old = hint.load(std::memory_order_relaxed);
    hint.store(std::min(std::max(seen, old - old / 16), kMaxHint), std::memory_order_relaxed);
  }

  // A step of a million tensors should not make every later step reserve for it.
  static constexpr size_t kMaxHint = 1 << 16;
  std::atomic<size_t> items_{0};
  std::atomic<size_t> waiters_{0};
};

class LocalRendezvous {
 public:
  // `keys` (optional, outlives this) interns the keys given as ParsedKeys; `sizes` (optional,
  // outlives this) presizes the tables and learns this step's size when it ends.
  explicit LocalRendezvous(KeyTable* keys = nullptr, StepSizeHint* sizes = nullptr);
  LocalRendezvous(const LocalRendezvous&) = delete;
  LocalRendezvous& operator=(const LocalRendezvous&) = delete;
  ~LocalRendezvous();  // Fails remaining waiters with Cancelled.

  absl::Status Send(const ParsedKey& key, const Tensor& value, bool is_dead);
  absl::Status Send(KeyRef key, const Tensor& value, bool is_dead);

  // Returns a token for CancelRecv (0 when `done` already ran).
  uint64_t RecvAsync(const ParsedKey& key, RecvDoneCallback done);
  uint64_t RecvAsync(KeyRef key, RecvDoneCallback done);

  // Fails the waiter `token` with `status` if it is still waiting. Returns whether it was.
  bool CancelRecv(uint64_t token, const absl::Status& status);

  void StartAbort(const absl::Status& status);

  // OK until aborted.
  absl::Status status() const;
  size_t NumPendingSends() const;
  size_t NumWaiters() const;
  // Notifies `event` once no sent value waits for its recv (at once if none does; also when the
  // rendezvous aborts, which drops them).
  void NotifyWhenSendsTaken(std::shared_ptr<Event> event);

 private:
  struct Value {
    Tensor tensor;
    bool is_dead;
  };
  struct Waiter {
    uint64_t token;
    RecvDoneCallback done;
  };
  struct Item {
    KeyRef key;  // owns the string the table's view of it points into
    std::variant<Value, Waiter> what;
  };

  KeyRef Intern(const ParsedKey& key) const {
    return keys_ != nullptr ? keys_->Intern(key) : MakeKeyRef(key);
  }

  KeyTable* const keys_;
  StepSizeHint* const sizes_;
  mutable Mutex mu_;
  // Keyed by views of each item's own full key (an interned key never moves).
  absl::flat_hash_map<absl::string_view, Item> table_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, absl::string_view> waiter_keys_ ABSL_GUARDED_BY(mu_);
  uint64_t next_token_ ABSL_GUARDED_BY(mu_) = 1;
  size_t most_items_ ABSL_GUARDED_BY(mu_) = 0;  // the tables' high-water marks, for sizes_
  size_t most_waiters_ ABSL_GUARDED_BY(mu_) = 0;
  size_t values_ ABSL_GUARDED_BY(mu_) = 0;  // sent values in table_
  std::vector<std::shared_ptr<Event>> sends_taken_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_RENDEZVOUS_LOCAL_RENDEZVOUS_H_
