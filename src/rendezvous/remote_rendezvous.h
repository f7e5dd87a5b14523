// RemoteRendezvous: the per-step rendezvous of one worker task, the base every protocol extends.
//
// Send is always local (passive). RecvAsync serves a key whose source device is on this task
// from the local table and otherwise calls RecvFromRemoteAsync, which each protocol (`grpc`,
// `grpc+verbs`, ...) implements once. RecvLocalAsync is how a protocol's server side takes a
// tensor out of this task's table for a peer.
//
// GPU tensors (a placement that is not host-accessible) take the proxy path here, the same for
// every protocol, through env's DeviceCopier: a device tensor a peer asks for is copied
// device-to-host into a tensor of the registered pool before RecvLocalAsync's `done` sees it
// (so the protocol only ever reads host memory), and a recv whose allocator is a GPU's lands in
// the pool and is copied host-to-device before its `done` runs, on the callback executor.
// Strings never live on a GPU. Without a copier device tensors stay within the task. A protocol
// whose fabric reaches GPU memory directly takes the direct path instead where it can: a recv
// it says lands on the device (LandsOnDevice) goes to it with the GPU allocator, and its server
// side asks RecvLocalAsync to keep device tensors as they are (StageToHostAsync stages one it
// cannot write from after all). StartAbort
// fails local waiters and asks the protocol (AbortRemote) to fail its in-flight remote recvs with
// the same status.
//
// Thread-safe. Owned by RendezvousMgr through shared_ptr; protocol callbacks that outlive a call
// hold a shared_ptr. Every `done` runs exactly once; the protocol must guarantee it for remote
// recvs.
#ifndef TENSORVERBS_RENDEZVOUS_REMOTE_RENDEZVOUS_H_
#define TENSORVERBS_RENDEZVOUS_REMOTE_RENDEZVOUS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/common/counters.h"
#include "src/common/executor.h"
#include "src/rendezvous/local_rendezvous.h"
#include "src/tensor/allocator.h"
#include "src/tensor/device_copier.h"
#include "tensorverbs/parsed_key.h"

namespace tensorverbs {

// Counters of remote recvs, updated for every protocol: by RemoteRendezvous::RecvAsync, or by
// the transport itself where it says so (RemoteRendezvous::CountsOwnRecvs).
struct TransferStats {
  std::atomic<int64_t> tensors{0};  // remote recvs completed OK
  std::atomic<int64_t> bytes{0};    // their element bytes (TotalBytes)
  std::atomic<int64_t> errors{0};
  // Copies of tensor bytes the protocol made in this process, sending or receiving (a gRPC
  // response parsed into its tensor, a proxy or staging buffer); zero-copy transfers add none.
  std::atomic<int64_t> copies{0};
  std::atomic<int64_t> copied_bytes{0};
  // Of those, the copies between host and GPU memory that device tensors took: a device
  // tensor a peer asked for, staged device-to-host, and a recv into device memory, landed in a
  // host proxy and copied host-to-device. Failed ones count as device_copy_errors only.
  std::atomic<int64_t> device_to_host{0};
  std::atomic<int64_t> host_to_device{0};
  std::atomic<int64_t> device_copied_bytes{0};
  std::atomic<int64_t> device_copy_errors{0};
  // Device copies started and not yet through their completion (a gauge): a stopping task
  // waits for zero before its executor and pools go.
  std::atomic<int64_t> device_copies_in_flight{0};
  // Device tensors that moved with no copy through host memory: the fabric wrote them from or
  // into GPU memory directly (grpc+verbs over the shmem fabric, by CUDA IPC).
  std::atomic<int64_t> device_direct_sends{0};
  std::atomic<int64_t> device_direct_recvs{0};

  // The totals above (not the in-flight gauge) under their catalog names (common/counters.h).
  void AppendCounters(CounterList* out) const;

  // One remote recv's outcome, just before its `done` runs.
  void CountRecv(const absl::Status& status, const Tensor& tensor) {
    if (status.ok()) {
      tensors.fetch_add(1, std::memory_order_relaxed);
      bytes.fetch_add(static_cast<int64_t>(tensor.TotalBytes()), std::memory_order_relaxed);
    } else {
      errors.fetch_add(1, std::memory_order_relaxed);
    }
  }
};

// What a worker task's rendezvous needs to know about its process. Outlives every rendezvous.
// TENSORVERBS_MAX_TENSOR_MB's default (Config::max_tensor_bytes).
inline constexpr uint64_t kDefaultMaxTensorBytes = uint64_t{4096} << 20;

struct WorkerEnv {
  std::string job;
  int task = 0;
  std::string task_name;  // /job:J/replica:0/task:T
  uint64_t incarnation = 0;
  Allocator* recv_allocator = nullptr;    // where received tensors are allocated
  Executor* callback_executor = nullptr;  // runs user callbacks of remote recvs
  TransferStats* stats = nullptr;         // optional
  KeyTable* keys = nullptr;               // optional: interns the keys of sends and local recvs
  StepSizeHint* step_sizes = nullptr;     // optional: presizes each step's tables
  // The largest tensor accepted from a peer (TENSORVERBS_MAX_TENSOR_MB).
  uint64_t max_tensor_bytes = kDefaultMaxTensorBytes;
  // Copies device tensors to and from host memory (null: no GPU in this process, and device
  // tensors cannot leave the task). Staging and proxy tensors come from recv_allocator.
  DeviceCopier* device_copier = nullptr;
  // A device tensor on the proxy path moves in chunks of this size where the transport reports
  // progress (RecvArgs::on_landed), each chunk's device copy overlapping the next one's
  // transfer; 0: whole (TENSORVERBS_PROXY_CHUNK_KB).
  uint64_t proxy_chunk_bytes = 0;
};

// OK if a peer's tensor of `bytes` (what receiving it allocates) fits under `max_bytes`;
// ResourceExhausted otherwise, naming the size and the variable that raises the limit. Called
// with the peer's announced size before anything is allocated for it.
absl::Status CheckReceivedTensorBytes(uint64_t bytes, uint64_t max_bytes);

// What every protocol logs, once, for a remote recv of `key` in step `step_id` from task `peer`
// that has waited `waited`, past TENSORVERBS_SLOW_RECV_MS (`threshold`).
std::string SlowRecvWarning(absl::string_view key, int64_t step_id, absl::string_view peer,
                            absl::Duration waited, absl::Duration threshold);

// RecvArgs::on_landed.
using LandedCallback = std::function<void(const Tensor& landing, uint64_t landed_bytes)>;

struct RecvArgs {
  // Destination allocator; null means env.recv_allocator. A GPU's takes the proxy path. It must
  // outlive the tensors received into it, and a transport may drop its own reference just
  // after `done` returns: keep it as long as the task.
  Allocator* allocator = nullptr;
  // The dtype and shape the caller expects (kInvalid: none): a transport that negotiates
  // meta-data (grpc+verbs) names a destination of this size in its first request, as for a
  // cached key, so the bytes come with no meta-data round trip. Wrong, it costs that round trip.
  DataType expected_dtype = DataType::kInvalid;
  TensorShape expected_shape;
  // Memory of the caller's that a transport whose fabric can write it lands the tensor in
  // (RecvOptions::into); others ignore it.
  Tensor into;
  // A transport that can see a large tensor land piece by piece (grpc+verbs) asks for it in
  // segments of `progress_bytes` (at least 64 KiB; 0: not at all) and calls `on_landed` as
  // each segment but the last lands: `landed_bytes`, a prefix of the tensor, is then in
  // `landing`, the memory the recv's result will be. Called on the transport's thread, which
  // it must not block; never after the recv failed, never for the last segment (`done` says
  // that one). Others ignore it.
  uint64_t progress_bytes = 0;
  LandedCallback on_landed;
  // `done` only stores the outcome and notifies whoever waits for it (an Event): it never
  // blocks and never waits for the task, so a transport may run it on whichever thread drives
  // its progress, a thread waiting for this very recv included, instead of handing it to a
  // callback thread.
  bool quick_callback = false;
  // The caller waits for this recv right away, driving the transport's progress (Task::Wait):
  // a transport whose progress a waiter can drive (grpc+verbs) leaves starting the recv to that
  // wait instead of waking its progress thread for it, which would then have to hand progress
  // over. A recv nobody waits for after all starts when the progress thread next wakes (its
  // housekeeping interval, 20 ms, at the latest).
  bool waiter_starts = false;
};

// What RecvArgs says about where a transport lands the tensor, as it travels with the recv.
// And whether its callback is quick (RecvArgs::quick_callback), which travels with it too.
struct RecvLanding {
  Tensor into;
  uint64_t progress_bytes = 0;
  LandedCallback on_landed;
  bool quick_callback = false;
  bool waiter_starts = false;

  static RecvLanding Of(const RecvArgs& args) {
    return RecvLanding{args.into, args.progress_bytes, args.on_landed, args.quick_callback,
                       args.waiter_starts};
  }
};

class RemoteRendezvous {
 public:
  RemoteRendezvous(const WorkerEnv* env, int64_t step_id);
  RemoteRendezvous(const RemoteRendezvous&) = delete;
  RemoteRendezvous& operator=(const RemoteRendezvous&) = delete;
  virtual ~RemoteRendezvous() = default;

  int64_t step_id() const { return step_id_; }
  const WorkerEnv& env() const { return *env_; }

  // The key's source device must be on this task.
  absl::Status Send(const ParsedKey& key, const Tensor& value, bool is_dead = false);

  // The key's destination device must be on this task.
  void RecvAsync(const ParsedKey& key, const RecvArgs& args, RecvDoneCallback done);

  // For the protocols' server side: takes `key` from this task's table once it is sent.
  // Returns a token for CancelLocalRecv.
  // With `keep_device` a device tensor reaches `done` as it is (the protocol writes from GPU
  // memory directly); otherwise it is staged to host memory first.
  uint64_t RecvLocalAsync(const ParsedKey& key, RecvDoneCallback done);
  uint64_t RecvLocalAsync(KeyRef key, RecvDoneCallback done, bool keep_device = false);
  // Copies the device tensor `value` into a pool tensor for a peer and runs `done` with it (on
  // the copier's thread), or with the reason it cannot. `key` names it in errors.
  void StageToHostAsync(const std::string& key, const Tensor& value, RecvDoneCallback done);
  // Told, on the copier's thread, as a staging in chunks goes on: OK with the bytes staged so
  // far (a prefix, growing), or the first failure, after which nothing more is told.
  using StagedCallback = std::function<void(const absl::Status& status, uint64_t staged_bytes)>;
  // As StageToHostAsync, in chunks of `chunk_bytes`: returns the pool tensor the device tensor
  // `value` is copied into, at once, and tells `on_staged` of each prefix that is there, so
  // that a protocol may send the first chunk while the next ones are copied. Fails at once
  // (nothing copied) when there is no copier for `value` or no pool memory for the copy.
  absl::StatusOr<Tensor> StageToHostInChunks(const std::string& key, const Tensor& value,
                                             uint64_t chunk_bytes, StagedCallback on_staged);
  bool CancelLocalRecv(uint64_t token, const absl::Status& status);

  void StartAbort(const absl::Status& status);
  absl::Status status() const { return local_.status(); }

  // Sent values not yet taken by a recv (local or remote).
  size_t NumPendingSends() const { return local_.NumPendingSends(); }
  // Notifies `event` once every sent value was taken (LocalRendezvous::NotifyWhenSendsTaken).
  void NotifyWhenSendsTaken(std::shared_ptr<Event> event) {
    local_.NotifyWhenSendsTaken(std::move(event));
  }

 protected:
  // Whether RecvFromRemoteAsync counts each recv in env's TransferStats itself (CountRecv, on
  // every path that runs `done`). Otherwise RecvAsync wraps `done` to count it, which costs a
  // heap allocation per recv.
  virtual bool CountsOwnRecvs() const { return false; }
  virtual void RecvFromRemoteAsync(const ParsedKey& key, const RecvArgs& args,
                                   RecvDoneCallback done) = 0;
  // Fails every in-flight remote recv; later ones fail because status() is no longer OK.
  virtual void AbortRemote(const absl::Status& status) {}
  // Whether a recv of `key` into `allocator`'s GPU memory lands there directly, with no host
  // proxy: the protocol's fabric writes into that memory from the key's source task. Any
  // thread; false sends it through the proxy path.
  virtual bool LandsOnDevice(const ParsedKey& key, Allocator* allocator) const { return false; }

  const WorkerEnv* const env_;

 private:
  // RecvFromRemoteAsync, counted in env's TransferStats unless the protocol counts itself.
  void RecvFromRemoteAsyncCounted(const ParsedKey& key, const RecvArgs& args,
                                  RecvDoneCallback done);

  const int64_t step_id_;
  LocalRendezvous local_;
};

// Starts a recv of every key at once and blocks the calling thread until all are done. Returns
// the tensors in key order, or the first error. For tools and tests; never call it on a
// progress loop, a gRPC thread or the callback executor.
absl::StatusOr<std::vector<Tensor>> RecvAll(RemoteRendezvous& rendezvous,
                                            const std::vector<ParsedKey>& keys,
                                            const RecvArgs& args = RecvArgs());

}  // namespace tensorverbs

#endif  // TENSORVERBS_RENDEZVOUS_REMOTE_RENDEZVOUS_H_
