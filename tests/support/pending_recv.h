// PendingRecv: a recv whose outcome a test collects later. It counts how often the callback
// ran, so tests can check that every callback fires exactly once. Thread-safe: the callback
// may run on any thread.
#ifndef TENSORVERBS_TESTS_SUPPORT_PENDING_RECV_H_
#define TENSORVERBS_TESTS_SUPPORT_PENDING_RECV_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "src/common/mutex.h"
#include "src/rendezvous/remote_rendezvous.h"

namespace tensorverbs {

class PendingRecv {
 public:
  PendingRecv(RemoteRendezvous& r, const ParsedKey& key, RecvArgs args = RecvArgs())
      : state_(std::make_shared<State>()) {
    // The state outlives this object: a test that gives up early (a failed assertion) must not
    // turn a late callback into a use-after-free.
    r.RecvAsync(key, args, [state = state_](const absl::Status& s, const Tensor& t, bool dead) {
      MutexLock lock(&state->mu);
      state->status = s;
      state->tensor = t;
      state->is_dead = dead;
      ++state->calls;
    });
  }
  // Waits for the callback; false on timeout.
  bool Wait(absl::Duration timeout = absl::Seconds(30)) {
    MutexLock lock(&state_->mu);
    return state_->mu.AwaitWithTimeout(
        [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) { return state_->calls > 0; },
        timeout);
  }
  absl::Status status() {
    MutexLock lock(&state_->mu);
    return state_->status;
  }
  Tensor tensor() {
    MutexLock lock(&state_->mu);
    return state_->tensor;
  }
  bool is_dead() {
    MutexLock lock(&state_->mu);
    return state_->is_dead;
  }
  int calls() {
    MutexLock lock(&state_->mu);
    return state_->calls;
  }

 private:
  struct State {
    Mutex mu;
    absl::Status status ABSL_GUARDED_BY(mu);
    Tensor tensor ABSL_GUARDED_BY(mu);
    bool is_dead ABSL_GUARDED_BY(mu) = false;
    int calls ABSL_GUARDED_BY(mu) = 0;
  };
  const std::shared_ptr<State> state_;
};

// TSan slows libfabric's copies and gRPC by an order of magnitude: suites scale their largest
// loads down under it (the normal build runs them in full).
#if defined(__SANITIZE_THREAD__)
inline constexpr bool kUnderThreadSanitizer = true;
#else
inline constexpr bool kUnderThreadSanitizer = false;
#endif

}  // namespace tensorverbs

#endif  // TENSORVERBS_TESTS_SUPPORT_PENDING_RECV_H_
