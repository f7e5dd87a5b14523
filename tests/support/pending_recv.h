// PendingRecv: a recv whose outcome a test collects later. It counts how often the callback
// ran, so tests can check that every callback fires exactly once. Thread-safe: the callback
// may run on any thread.
#ifndef TENSORVERBS_TESTS_SUPPORT_PENDING_RECV_H_
#define TENSORVERBS_TESTS_SUPPORT_PENDING_RECV_H_

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "src/common/mutex.h"
#include "src/rendezvous/remote_rendezvous.h"

namespace tensorverbs {

class PendingRecv {
 public:
  PendingRecv(RemoteRendezvous& r, const ParsedKey& key, RecvArgs args = RecvArgs()) {
    r.RecvAsync(key, args, [this](const absl::Status& s, const Tensor& t, bool dead) {
      MutexLock lock(&mu_);
      status_ = s;
      tensor_ = t;
      is_dead_ = dead;
      ++calls_;
    });
  }
  // Waits for the callback; false on timeout.
  bool Wait(absl::Duration timeout = absl::Seconds(30)) {
    MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return calls_ > 0; },
                                timeout);
  }
  absl::Status status() {
    MutexLock lock(&mu_);
    return status_;
  }
  Tensor tensor() {
    MutexLock lock(&mu_);
    return tensor_;
  }
  bool is_dead() {
    MutexLock lock(&mu_);
    return is_dead_;
  }
  int calls() {
    MutexLock lock(&mu_);
    return calls_;
  }

 private:
  Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  Tensor tensor_ ABSL_GUARDED_BY(mu_);
  bool is_dead_ ABSL_GUARDED_BY(mu_) = false;
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_TESTS_SUPPORT_PENDING_RECV_H_
