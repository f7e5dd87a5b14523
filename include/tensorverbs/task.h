// Task and Step: tensorverbs as a library. A Task is one task of a cluster (a process, or a
// part of one, that serves the tasks it sends to and receives from); a Step is one training
// step's sends and recvs, ended (its pending recvs cancelled, its untaken sends dropped) when
// the Step object goes.
//
// A program starts a Task from TaskOptions (or the TENSORVERBS_* environment, as the tools do),
// waits for its peers, then for each step makes a Step, sends the tensors its peers need by
// name and receives the ones it needs:
//
//   auto task = tensorverbs::Task::Start(options).value();
//   task->WaitForPeers(absl::Seconds(30)).IgnoreError();
//   auto step = task->BeginStep(1).value();
//   step->Send("/job:ps/replica:0/task:0", "grad", grad).IgnoreError();
//   absl::StatusOr<tensorverbs::Tensor> w = step->Recv("ps:0", "weights");
//
// Tasks are named "/job:J/replica:0/task:T" or "J:T". A received tensor's memory comes from the
// task's registered pool (or, received into a GPU, its pool of that GPU's memory) and stays
// valid while any Tensor refers to it, after its Step and its Task are gone too: a Task destroyed
// while its tensors live stops at once but keeps its pools until they are dropped (it is freed when
// a later Task starts or goes). Every method is thread-safe. RecvAsync never waits, and its
// callback runs exactly once: for a recv that started, on one of the task's callback threads
// (TENSORVERBS_CALLBACK_THREADS); for one refused before it started (a malformed task name or key,
// a peer that did not answer when asked for its incarnation), inside the call or on the thread that
// asked. It must not block for long. Errors are absl::Status values whose message names the key,
// the peer and, where a setting is involved, its variable.
#ifndef TENSORVERBS_PUBLIC_TASK_H_
#define TENSORVERBS_PUBLIC_TASK_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "tensorverbs/cluster_spec.h"
#include "tensorverbs/event.h"
#include "tensorverbs/parsed_key.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs {

struct TaskOptions {
  ClusterSpec cluster;  // ClusterSpec::Parse("worker=h1:2222,h2:2222;ps=h3:2222")
  std::string job;
  int task = 0;
  // "grpc+verbs" (RDMA writes into the receiver's memory), "grpc", "grpc+gdr" or
  // "grpc+verbs-copy"; AvailableProtocols() lists what this build has. Every task of a cluster
  // uses the same.
  std::string protocol = "grpc+verbs";
  // How long a remote recv may wait for its tensor; unset takes TENSORVERBS_RECV_TIMEOUT_MS.
  std::optional<absl::Duration> recv_timeout;
  // Every other setting (fabric, pool, security, ...) comes from the TENSORVERBS_* variables the
  // README lists; an invalid one fails Start naming the variable.
};

// Counters of this task's remote recvs, since it started.
struct TaskStats {
  int64_t tensors = 0;  // received OK
  int64_t bytes = 0;    // their element bytes
  int64_t errors = 0;   // recvs that failed
  int64_t copies = 0;   // copies of tensor bytes this task made (zero-copy paths add none)
  int64_t copied_bytes = 0;
};

// Where a recv's tensor lands, and how long a blocking Recv waits.
struct RecvOptions {
  // The result's allocator; null: the task's registered pool. A GPU's (Task::DeviceAllocator):
  // the tensor lands in that GPU's memory, written there directly (CUDA IPC, between tasks of
  // one host over grpc+verbs) or landed in the pool and copied over before the callback runs.
  // Any other must outlive the task.
  Allocator* allocator = nullptr;
  // How long a blocking Recv waits (and at most the task's recv timeout).
  absl::Duration timeout = absl::InfiniteDuration();
  // The dtype and shape the caller expects, when it knows them (kInvalid: it does not). Over
  // grpc+verbs the first request then names a destination of that size, so a tensor under a name
  // never received before comes with no meta-data round trip; a tensor that differs still
  // arrives, one round trip later. Other protocols ignore it.
  DataType expected_dtype = DataType::kInvalid;
  TensorShape expected_shape;
  // Host memory of the caller's to land the tensor in (Task::AdoptHostMemory makes one over any
  // buffer; its release tells when the task has let go). Over grpc+verbs, where the fabric can
  // write memory it registers on the spot (tcp, ibverbs; not the same-host fabric, which
  // reaches only memory it shares), a tensor of exactly `into`'s dtype and shape is written
  // straight into it: the recv's result then shares `into`'s buffer, with no copy. Otherwise
  // the recv lands as it would without it. A recv that fails may keep `into`, and its peer may
  // still write into it, until the sender answers or the channel closes: the memory is the
  // caller's again only when `into`'s release has run.
  Tensor into;
  // For RecvAsync: the callback only stores its result and notifies an Event (or does no more
  // than that): it never blocks, never waits for the task and never calls back into it. Over
  // grpc+verbs such a callback may run on whichever thread drives the task's progress, a thread
  // waiting in Task::Wait included, with no hand-off to a callback thread. A callback that
  // blocks despite the mark holds up every transfer of the task while it blocks.
  bool quick_callback = false;
  // For RecvAsync: the caller waits for this recv with Task::Wait right away. Over grpc+verbs
  // the wait then starts the recv itself, instead of the transport waking its progress thread
  // for it. A recv marked so that nobody waits for starts late: when the task's progress thread
  // next wakes, 20 ms later at most.
  bool waiter_starts = false;
};

// The protocols this build provides, best first (the same function the server uses).
std::vector<std::string> AvailableProtocols();

class Step;

class Task {
 public:
  // Validates the options, binds the task's port and starts serving. InvalidArgument names
  // the field or variable that is wrong; Unavailable says why the port or fabric failed.
  static absl::StatusOr<std::unique_ptr<Task>> Start(TaskOptions options);
  Task(const Task&) = delete;
  Task& operator=(const Task&) = delete;
  // Stop(), then destroys the task: the pool stays while tensors from it live (see above). Waits
  // at most TENSORVERBS_STOP_TIMEOUT_MS for the task's threads (a recv callback that never
  // returns holds them), then logs it and leaves the task to go once they end.
  ~Task();

  // Waits until every other task of the cluster answers, or Unavailable naming the ones that
  // did not within `timeout`. It sets up no RDMA channel: over grpc+verbs each is set up when
  // the first tensor between its two tasks needs it, so a task holds channels only to the
  // peers it exchanges with.
  absl::Status WaitForPeers(absl::Duration timeout);
  // The same for the named tasks only ("/job:J/replica:0/task:T"; this task's own name is
  // skipped): a task that exchanges with a few peers, such as a parameter-server worker, waits
  // for those, so its start costs one probe per peer it needs rather than one per task of the
  // cluster. InvalidArgument names a task that is not in the cluster.
  absl::Status WaitForPeers(const std::vector<std::string>& tasks, absl::Duration timeout);

  // "/job:J/replica:0/task:T".
  const std::string& name() const;
  const std::string& protocol() const;
  // Changes each time the task starts; a peer's key carries it, so tensors of a task that
  // restarted are never mistaken for the new task's.
  uint64_t incarnation() const;

  // The step's sends and recvs, until the Step goes. FailedPrecondition if `step_id` was ended
  // recently in this task.
  absl::StatusOr<std::unique_ptr<Step>> BeginStep(int64_t step_id);

  // A tensor in the task's registered pool: sent from, it needs no staging copy.
  absl::StatusOr<Tensor> Empty(DataType dtype, const TensorShape& shape);

  // The task's pool of GPU `device`'s memory, made on first use: allocate tensors to send from
  // that GPU with it, and name it in RecvOptions to receive into the GPU. Between tasks of one
  // host over grpc+verbs the bytes go from GPU to GPU directly (CUDA IPC); otherwise they cross
  // in host memory (one device-to-host copy on the sender, one host-to-device copy on the
  // receiver). FailedPrecondition without a GPU, saying why; InvalidArgument for an ordinal
  // this host lacks.
  absl::StatusOr<Allocator*> DeviceAllocator(int device);

  // GPU memory the caller owns (a PyTorch or CuPy tensor's, or its own cudaMalloc's) as a
  // tensor to send, without copying it into the task's pools: a send stages it to host memory
  // once, as it would a tensor outside every device pool. `release` runs exactly once: when the
  // last Tensor referring to the memory goes (on whichever thread drops it, once the send's
  // copy is done), or before this returns on an error. The memory needs no alignment.
  // FailedPrecondition without a CUDA runtime for `device`; InvalidArgument for strings.
  absl::StatusOr<Tensor> AdoptDeviceMemory(int device, void* data, DataType dtype,
                                           const TensorShape& shape, std::function<void()> release);

  // Host memory the caller owns (a PyTorch CPU tensor's, say) as a tensor to send, without
  // copying it into the task's pool first. Over grpc+verbs a tensor of at least 64 KiB is then
  // written to the peer from this memory itself (registered with the fabric for that one
  // write); smaller ones, and the other protocols, copy it once as they send, as they would any
  // memory outside the pool. The caller must neither free nor write the memory before
  // `release`, which runs exactly once: when the last Tensor referring to it goes (after the
  // peer took it, or when the step that sent it ends), on whichever thread drops it (often a
  // transport thread: it must return quickly and never block), or before this returns on an
  // error. InvalidArgument for strings, or a null `data` with bytes to hold.
  absl::StatusOr<Tensor> AdoptHostMemory(void* data, DataType dtype, const TensorShape& shape,
                                         std::function<void()> release);

  // Returns once the work queued on GPU `device`'s legacy default stream, and through it on
  // every blocking stream, has completed. The task's own copies run on streams of their own,
  // so memory written by the caller's kernels must be finished before a send reads it: call
  // this first (a DLPack producer asked for stream 1, the legacy default stream, orders its
  // work before it). Blocks the caller; FailedPrecondition without a CUDA runtime.
  absl::Status WaitForDeviceWork(int device);

  // Waits until `event` is notified or `deadline` passes; whether it was notified. Over
  // grpc+verbs the calling thread drives the task's transport while it waits: it polls the
  // fabric and runs the protocol itself, and runs the callbacks of recvs started with
  // RecvOptions::quick_callback that complete meanwhile, so the recv it waits for completes on
  // this thread with no hand-off between threads. One thread drives at a time; others wait for
  // it and take over when it leaves (TENSORVERBS_WAITER_PROGRESS=0: none drives, all sleep).
  // Never call it from a recv callback. Step::Recv and WaitUntilSendsTaken wait this way.
  bool Wait(Event& event, absl::Time deadline);

  // A burst of sends, recvs and waits on one thread (a collective's): while it lives, what the
  // thread starts on this task wakes no other thread, because the thread's next wait (Task::Wait,
  // Step::Recv) starts it itself; if the burst ends with nothing waited for since, its end wakes
  // the task's progress thread. Make it, use it and let it go on the same thread. Other
  // protocols ignore it.
  class Burst {
   public:
    explicit Burst(Task& task);
    Burst(const Burst&) = delete;
    Burst& operator=(const Burst&) = delete;
    ~Burst();

   private:
    std::shared_ptr<void> scope_;
  };

  TaskStats stats() const;
  // Every counter of this task as `tensorverbs stats` reports it (the channels' aside), by
  // name: tensors_received, bytes_sent, pushed_requests, pool_bytes_in_use, ...
  std::vector<std::pair<std::string, int64_t>> counters() const;

  // Fails every pending recv with Cancelled and shuts the task's server down. Idempotent.
  // Returns within TENSORVERBS_STOP_TIMEOUT_MS (60 s): a shutdown stuck past it (a callback that
  // never returns, a fabric call that blocks the progress thread) is logged as an error that
  // says where it is stuck, and goes on in the background; the task's threads and memory stay
  // until it finishes, so nothing the stuck call returns to has been freed. Called from one of
  // the task's own callbacks (which the shutdown may wait for), it starts the shutdown and
  // returns at once; so does the destructor.
  void Stop();

  struct Impl;

 private:
  explicit Task(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

class Step {
 public:
  using RecvCallback = std::function<void(absl::StatusOr<Tensor>)>;

  Step(const Step&) = delete;
  Step& operator=(const Step&) = delete;
  // Ends the step: its pending recvs fail with Cancelled, sends no peer took are dropped.
  ~Step();

  int64_t id() const;

  // Makes `value` available to `dst_task` under `name` in this step; returns at once (the peer
  // takes it when it asks). InvalidArgument for an unknown task or a bad name, AlreadyExists
  // for a name sent twice.
  absl::Status Send(absl::string_view dst_task, absl::string_view name, const Tensor& value);

  // Receives `name` from `src_task`, waiting at most `timeout` (and at most the task's recv
  // timeout). After DeadlineExceeded from `timeout` the key stays asked for in this step: a
  // later Recv of it in the same step fails.
  absl::StatusOr<Tensor> Recv(absl::string_view src_task, absl::string_view name,
                              absl::Duration timeout = absl::InfiniteDuration());
  // The same, into options.allocator's memory (a GPU's, say), waiting at most options.timeout.
  absl::StatusOr<Tensor> Recv(absl::string_view src_task, absl::string_view name,
                              const RecvOptions& options);
  // Never waits: a peer this task has not heard from yet (WaitForPeers asks them all) is asked
  // on a thread of its own.
  void RecvAsync(absl::string_view src_task, absl::string_view name, RecvCallback done);
  void RecvAsync(absl::string_view src_task, absl::string_view name, const RecvOptions& options,
                 RecvCallback done);

  // The same with a full rendezvous key (TensorFlow's form, see parsed_key.h): its source or
  // destination device must be on this task.
  absl::Status SendKey(const ParsedKey& key, const Tensor& value);
  void RecvKeyAsync(const ParsedKey& key, RecvCallback done);
  void RecvKeyAsync(const ParsedKey& key, const RecvOptions& options, RecvCallback done);

  // Waits until peers have taken every tensor this step sent, so ending it drops nothing; or
  // DeadlineExceeded naming how many are left.
  absl::Status WaitUntilSendsTaken(absl::Duration timeout);

  struct Impl;

 private:
  friend class Task;
  explicit Step(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_PUBLIC_TASK_H_
