// ProcessGroupTensorVerbs: the `tensorverbs` backend of torch.distributed (PyTorch 1.13's
// c10d::ProcessGroup), over one tensorverbs Task per group.
//
// Create() runs inside init_process_group/new_group (tensorverbs.torch registers it): each rank
// starts a Task named "rank:R" on a free port, publishes its address, protocol and world size in
// the group's store, reads the others', checks that they agree, and waits for its peers.
//
// Point to point (send, recv, recvAnysource) runs on the caller's thread and the task's callback
// threads. Over grpc+verbs a send of at least 64 KiB lends the caller's tensor to the task
// (Task::AdoptHostMemory), whose fabric writes it to the peer from where it is, and completes
// when the task lets go of it: after the peer took it, as NCCL's and MPI's large sends do. A
// smaller send, or one over another protocol, copies the tensor into the task's registered pool
// (one staged copy, counted) and completes at once. A recv completes when its message has
// landed and been copied into the caller's tensor; over grpc+verbs, from that same size and
// where the fabric can write the caller's memory (tcp, ibverbs; not the same-host fabric), the
// message lands in the tensor itself (RecvOptions::into), with no copy. Collectives are numbered on
// the caller's thread, in call order, and run in that order on the group's worker thread, built on
// the same sends and recvs (binomial trees for small tensors, rings for large ones). Every method
// may be called from any thread without the GIL and never calls Python. The destructor, which torch
// may call from Python with the GIL held, lets go of the GIL while it waits for the group's
// threads: dropping a tensor whose Python object died first takes the GIL, and any of them may be
// the one to drop it.
//
// Each Work completes exactly once: with its outputs written, or with an error that names the
// operation and the peer rank and task; a `wait(timeout)` that expires fails it, and nothing
// writes into its tensors afterwards, but for a recv landing in the tensor itself: the fabric
// may still write that one until the task lets go of it (its peer answers, or the channel
// closes). A recv that fails on its own (a dead peer, the group's timeout) completes once the
// task let go, so nothing writes into its tensor afterwards; or at most 10 s later, failed all
// the same, if the task still holds it then (a live peer that has not sent: should it send
// after all, its bytes land there). A failed collective fails the group's later collectives
// (the ranks no longer agree on where they are) and tells the other ranks through the store.
#ifndef TENSORVERBS_PYTHON_TORCH_PROCESS_GROUP_H_
#define TENSORVERBS_PYTHON_TORCH_PROCESS_GROUP_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "python/src/torch/landings.h"
#include "python/src/torch/p2p_matcher.h"
#include "python/src/torch/same_host.h"
#include "python/src/torch/work_completer.h"
#include "src/common/counters.h"
#include "tensorverbs/task.h"

namespace tensorverbs::torch_backend {

class TvWork;
class Collective;

// How long an operation that failed while the transport still held one of its tensors as a
// destination (RecvOptions::into) waits for the task to let go of it before failing anyway.
inline constexpr std::chrono::milliseconds kLandingGrace = std::chrono::seconds(10);

class ProcessGroupTensorVerbs final : public c10d::ProcessGroup {
 public:
  static c10::intrusive_ptr<ProcessGroupTensorVerbs> Create(
      const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
      std::chrono::milliseconds timeout);
  // Create's last step (public for c10::make_intrusive): the group over a started `task`.
  ProcessGroupTensorVerbs(int rank, int size, std::chrono::milliseconds timeout,
                          c10::intrusive_ptr<c10d::Store> store, std::string key_prefix,
                          std::vector<std::string> addresses, std::unique_ptr<Task> task,
                          std::unique_ptr<SameHostGroup> same_host);
  ~ProcessGroupTensorVerbs() override;
  void release_resources() override;

  const std::string getBackendName() const override { return "tensorverbs"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // Waits, up to `limit` (and the group's timeout), until the collectives queued have run and
  // the peers took every message this rank sent; says on stderr what was left. A group that
  // failed does not wait.
  void Drain(std::chrono::milliseconds limit);
  // Drain's second half: waits up to `limit` for the peers to take what this group sent.
  void DrainSends(std::chrono::milliseconds limit);

  // The group's counters: the catalog's torch_ entries (common/counters.h), which
  // tensorverbs.torch.stats gives without that prefix. Any thread adds to them.
  using Counters = CounterSet<Counter::kTorchStagedCopies, Counter::kTorchFailed>;
  CounterList stats() const;
  const std::string& protocol() const { return task_->protocol(); }
  // "rank:R (/job:rank/replica:0/task:R at host:port)", for error messages.
  std::string PeerName(int rank) const;

 private:
  friend class Collective;
  using Body = std::function<absl::Status(Collective&)>;
  struct Queued {
    c10::intrusive_ptr<TvWork> work;
    Body body;
    int64_t seq;
    std::chrono::milliseconds timeout;
  };

  // Numbers the collective `op` and queues `body` for the worker; the Work completes with
  // `outputs` when `body` returns OK.
  c10::intrusive_ptr<c10d::Work> Enqueue(c10d::OpType type, const char* op,
                                         std::vector<at::Tensor> outputs,
                                         std::chrono::milliseconds timeout, Body body);
  // Drains, stops the worker and the task, and fails what never ran; runs once.
  void Shutdown();
  void WorkerLoop();
  // With mu_ held: takes the next queued collective if none runs (false otherwise), with the
  // status it starts with (a destroyed group's or an earlier failure's).
  bool TakeNext(Queued* item, absl::Status* status);
  // Runs a taken collective to its end and completes its work; then Finished, unless the group
  // went meanwhile (a future callback may destroy it).
  void Run(Queued& item, absl::Status status);
  void Finished();
  // On a thread in `work`'s wait(): runs the queued collectives up to `work`'s, unless the worker
  // runs them.
  void RunQueuedUntil(TvWork& work);
  std::chrono::milliseconds TimeoutOf(std::chrono::milliseconds requested) const;
  // The first failure of a collective, told to the other ranks through the store (best effort).
  void FailGroup(const absl::Status& status);
  // A failure another rank published in the store, if any.
  absl::Status AbortFromPeers();
  // A copy of `bytes` at `data` in the pool, counted: what small sends send from.
  absl::StatusOr<Tensor> Stage(const void* data, size_t bytes);
  // `work`'s tensor `t` lent to the task as it is, counted: `work` completes (on completer_'s
  // thread) when the task lets go of it.
  absl::StatusOr<Tensor> Lend(const at::Tensor& t, c10::intrusive_ptr<TvWork> work);
  // `bytes` of the caller's memory at `data` as a uint8 message the task writes from, counted as
  // lent (unless `count_as_lent` is false: a recv's destination): what every lent message is.
  // `release` runs once, when the task lets go of it, on a transport thread (or before this
  // returns on a refusal).
  absl::StatusOr<Tensor> Adopt(const void* data, size_t bytes, std::function<void()> release,
                               bool count_as_lent = true);
  // `work`'s tensor `t` as memory a recv's message may land in (RecvOptions::into), and what its
  // release and the recv's end share (ops_p2p.cc): uninitialized if the task refuses it.
  Tensor LandingFor(const at::Tensor& t, const c10::intrusive_ptr<TvWork>& work,
                    const std::shared_ptr<InPlaceLanding>& landing);
  std::string What(const char* op, int64_t seq) const;
  // The message of (`src`, `tag`, n) in the p2p key space.
  static std::string P2pName(int src, int dst, int64_t tag, int64_t n);

  const std::chrono::milliseconds timeout_;
  const c10::intrusive_ptr<c10d::Store> store_;
  const std::string key_prefix_;  // "tensorverbs/<generation>/"
  const std::vector<std::string> addresses_;
  std::unique_ptr<Task> task_;
  std::unique_ptr<Step> step_;
  // Every rank on this host over grpc+verbs: all_reduce and reduce_scatter go through it.
  std::unique_ptr<SameHostGroup> same_host_;
  std::vector<std::string> peer_tasks_;  // "rank:R"
  std::shared_ptr<Counters> counters_ = std::make_shared<Counters>();
  std::shared_ptr<P2pMatcher> matcher_;
  // Sends lend tensors from this size (grpc+verbs only; 0: never).
  const size_t lend_from_;
  const std::shared_ptr<WorkCompleter> completer_;

  std::mutex send_mu_;
  std::map<std::pair<int, int64_t>, int64_t> sent_;  // (dst, tag) -> messages; guarded by send_mu_
  std::atomic<int64_t> p2p_seq_{0};

  std::mutex mu_;
  std::condition_variable cv_;
  int64_t next_seq_ = 0;      // guarded by mu_
  std::deque<Queued> queue_;  // guarded by mu_
  bool stopping_ = false;     // guarded by mu_
  bool running_ = false;      // the worker runs a collective; guarded by mu_
  absl::Status group_error_;  // guarded by mu_
  // Set by a destructor that runs on the worker (inside a work's callback): the worker's loop
  // then touches nothing of the group.
  // Set by the first Shutdown: release_resources and the destructor both run it, and which
  // runs, or whether both do, depends on whether weak references were left.
  bool shut_down_ = false;
  const std::shared_ptr<std::atomic<bool>> destroyed_ = std::make_shared<std::atomic<bool>>(false);
  std::thread worker_;
};

// Drains every tensorverbs group of this process (at exit: Python's atexit, through
// tensorverbs.torch), so that a rank that ends right after its last collective still gets that
// collective's messages to the ranks that wait for them.
void DrainAllGroups(std::chrono::milliseconds limit);

}  // namespace tensorverbs::torch_backend

#endif  // TENSORVERBS_PYTHON_TORCH_PROCESS_GROUP_H_
