// Collective: one collective operation of ProcessGroupTensorVerbs as its algorithm sees it, with
// the messages it exchanges (named after the operation's number, a part number and the pair of
// ranks, so concurrent operations never mix) and the algorithms themselves, over raw memory.
//
// Made and used on the group's worker thread only, for the lifetime of one operation. Recv
// waits for a message until the operation's deadline, until its work completed elsewhere (a
// wait() that expired), or until another rank published a failure; each error names the
// operation and the peer rank and task.
#ifndef TENSORVERBS_PYTHON_TORCH_COLLECTIVE_H_
#define TENSORVERBS_PYTHON_TORCH_COLLECTIVE_H_

#include <c10/core/ScalarType.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "python/src/torch/landings.h"
#include "python/src/torch/reduce.h"
#include "tensorverbs/task.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::torch_backend {

class ProcessGroupTensorVerbs;
class SameHostGroup;
class TvWork;

class Collective {
 public:
  Collective(ProcessGroupTensorVerbs& group, TvWork& work, int64_t seq, absl::Time deadline);

  int rank() const;
  int size() const;
  // The ranks' shared memory, when every rank of the group runs on this host (same_host.h).
  SameHostGroup* same_host() const;
  // OK while the operation is still wanted: before its deadline, its work not abandoned, and
  // no other rank having published a failure. `waiting_for` names what it waits for.
  absl::Status StillWanted(const std::string& waiting_for);
  // "rank R (task rank:R at host:port)", for errors.
  std::string PeerName(int rank) const;
  // Counts an operation done through the shared memory (the group counter
  // torch_same_host_collectives).
  void CountSameHost();

  // Sends `bytes` at `data` to `dst` as part `part`: one staged copy into the pool.
  absl::Status Send(int dst, int part, const void* data, size_t bytes);
  // Sends a landed message (pool memory) on without a copy; it must not change afterwards.
  absl::Status Forward(int dst, int part, const Tensor& message);
  // The caller's `bytes` at `data` as a message, lent without a copy where the group lends
  // (grpc+verbs, from 64 KiB; a staged copy otherwise): that memory must not change until every
  // peer it is sent to took it. The worker waits for that (WaitForLent) before the operation
  // completes; until the task lets go of it, the lent message holds the work, whose tensors
  // hold the memory, so even a failed operation's memory is never read after it is freed.
  absl::StatusOr<Tensor> Lend(const void* data, size_t bytes);
  // Waits until the task let go of every message this operation lent, up to the deadline (and
  // less when the work was abandoned or another rank failed).
  absl::Status WaitForLent();
  // A message asked for and not waited for yet (Post, then Wait, lets several be under way).
  struct Pending;
  using PendingRef = std::shared_ptr<Pending>;
  // Asks for part `part` from `src`, which must be `bytes` long. With `land_at` (the caller's
  // memory where the message ends up), the message may be written there by the fabric itself
  // (RecvOptions::into; grpc+verbs from 64 KiB, over tcp and ibverbs): the result then shares
  // that memory, WriteOut of it copies nothing, and forwarding it lends it. Such memory counts
  // as lent (WaitForLent) until the task lets go of it, and as a landing (WaitForLandings) until
  // its message arrived or the task let go.
  PendingRef Post(int src, int part, size_t bytes, void* land_at = nullptr);
  absl::StatusOr<Tensor> Wait(const PendingRef& pending);
  absl::StatusOr<Tensor> Recv(int src, int part, size_t bytes, void* land_at = nullptr) {
    return Wait(Post(src, part, bytes, land_at));
  }
  // After a failure: waits, at most `limit`, until no message of this operation can still be
  // written into the caller's memory (each landed, or the task let go of its destination).
  // False if some still could.
  bool WaitForLandings(std::chrono::milliseconds limit);
  // `bytes` of scratch memory that lives as long as the operation's work: it may be lent and
  // named as a destination as the caller's memory is.
  uint8_t* Scratch(size_t bytes);
  // A copy of `bytes` at `data` in the pool, for an accumulator that is sent on later.
  absl::StatusOr<Tensor> Stage(const void* data, size_t bytes);
  // Copies into the caller's tensor unless the work completed (then Cancelled).
  absl::Status WriteOut(void* dst, const void* src, size_t bytes);
  // Reduces `in` into the caller's memory at `acc`, unless the work completed.
  absl::Status ReduceOut(c10::ScalarType dtype, RedOp op, void* acc, const void* in, int64_t count);
  // Divides `count` elements of the caller's memory at `data` by `n` (AVG), unless the work
  // completed.
  absl::Status DivideOut(c10::ScalarType dtype, void* data, int64_t count, int64_t n);

 private:
  std::string NameOf(int src, int dst, int part) const;
  // Whether the task still holds memory lent by this operation, for the release callbacks.
  struct LentState {
    std::mutex mu;
    std::condition_variable cv;
    int outstanding = 0;  // guarded by mu
    int landings = 0;     // destinations in the caller's memory not settled; guarded by mu
  };
  // One destination in the caller's memory (CollectiveLanding): settled once, when its message
  // landed or the task let go of it, whichever comes first; the first counts it settled.
  static void Settle(const std::shared_ptr<LentState>& lent, CollectiveLanding& landing,
                     CollectiveLanding::Event event);
  // Waits on `pending`'s or the lent messages' condition until `ready`, the deadline, an
  // abandoned work or a failure another rank published; `what` names what did not come.
  template <typename Ready, typename What>
  absl::Status AwaitOrFail(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                           Ready ready, What what);
  // The same for a message's Event, driving the task's progress while it waits (Task::Wait):
  // the message's completion is polled, and its callback run, on this thread.
  template <typename What>
  absl::Status AwaitArrival(Event& arrived, What what);

  ProcessGroupTensorVerbs& group_;
  TvWork& work_;
  const int64_t seq_;
  const absl::Time deadline_;
  const std::shared_ptr<LentState> lent_ = std::make_shared<LentState>();
};

// Recv options that say a message is a uint8 vector of `bytes` (see RecvOptions).
RecvOptions ExpectBytes(size_t bytes);

// The algorithms. `data` is the caller's memory of `count` elements of `dtype`; `part_base`
// separates several of them inside one operation.
absl::Status AllreduceInPlace(Collective& c, void* data, int64_t count, c10::ScalarType dtype,
                              RedOp op, int part_base);
absl::Status BroadcastInPlace(Collective& c, void* data, size_t bytes, int root, int part_base);
// Rank `root`'s result in `out` (ignored elsewhere); `in` is left as it is.
absl::Status ReduceToRoot(Collective& c, const void* in, void* out, int64_t count,
                          c10::ScalarType dtype, RedOp op, int root);
// outs[i] receives rank i's `bytes` (outs[rank] gets `in`).
absl::Status Allgather(Collective& c, const void* in, void* const* outs, size_t bytes);
// ins[i] is this rank's block for rank i; `out` receives the reduction of every rank's block
// for this rank, `count` elements.
absl::Status ReduceScatter(Collective& c, const void* const* ins, void* out, int64_t count,
                           c10::ScalarType dtype, RedOp op);
absl::Status Barrier(Collective& c);

}  // namespace tensorverbs::torch_backend

#endif  // TENSORVERBS_PYTHON_TORCH_COLLECTIVE_H_
