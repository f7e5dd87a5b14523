// Config: every environment variable tensorverbs reads, parsed once into typed fields, and
// each one's default, declared here once (the field's initializer) and read by the options of
// the layer that owns the setting through Config::Defaults().
//
// This is the only place in the project that calls getenv. Config::Get() parses the process
// environment on first use (thread-safe) and returns the same object forever after; tools call
// Config::EnvironmentStatus() at start so that a bad value stops them with a message naming the
// variable and its valid range. Tests build a Config from an explicit map with FromEnvironment.
// An unknown TENSORVERBS_* variable is reported as a warning (most often a typo).
#ifndef TENSORVERBS_COMMON_CONFIG_H_
#define TENSORVERBS_COMMON_CONFIG_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tensorverbs {

enum class LogSeverity;

// The seed's RDMA_* variables for the ibverbs backend. The README spellings are canonical; the
// spellings TensorFlow's code read are accepted as aliases (setting both to different values is
// an error). Zero / -1 / empty mean "choose automatically".
struct RdmaConfig {
  std::string device;      // RDMA_DEVICE: e.g. mlx5_0
  int port = 0;            // RDMA_DEVICE_PORT: 1..255
  int gid_index = -1;      // RDMA_GID_INDEX: 0..255 (default: RoCEv2 preferred)
  int pkey_index = 0;      // RDMA_QP_PKEY_INDEX (alias RDMA_PKEY): 0..65535
  int queue_depth = 1024;  // RDMA_QP_QUEUE_DEPTH (alias RDMA_QUEUE_DEPTH): 1..65536
  int timeout = 14;        // RDMA_QP_TIMEOUT (alias RDMA_TIMEOUT): 0..31 (4.096 us * 2^t)
  int retry_count = 7;     // RDMA_QP_RETRY_COUNT (alias RDMA_RETRY_CNT): 0..7
  int sl = 0;              // RDMA_QP_SL (alias RDMA_SL): 0..7
  int mtu = 0;             // RDMA_QP_MTU (alias RDMA_MTU): 256, 512, 1024, 2048 or 4096
  int traffic_class = 0;   // RDMA_TRAFFIC_CLASS: 0..255
};

struct Config {
  // TENSORVERBS_LOG_LEVEL: error | warning | info | debug | a number N >= 0 (info plus VLOG(N)).
  LogSeverity log_severity;
  int log_verbosity = 0;

  // TENSORVERBS_RECV_TIMEOUT_MS: how long a remote recv waits for the tensor (and the peer)
  // before failing. 1 .. 86400000, default 600000 (10 minutes: a producer may be slow).
  absl::Duration recv_timeout = absl::Minutes(10);

  // TENSORVERBS_CONNECT_TIMEOUT_MS: how long start-up waits for every peer task to answer.
  // 1 .. 86400000, default 60000.
  absl::Duration connect_timeout = absl::Seconds(60);

  // TENSORVERBS_POOL_REGION_MB: size of each region the pool allocator obtains from the OS
  // (larger requests get a region of their own). 1 .. 65536, default 64.
  int64_t pool_region_bytes = int64_t{64} << 20;

  // TENSORVERBS_MAX_TENSOR_MB: the largest tensor this task accepts from a peer, 1 .. 1048576,
  // default 4096. A peer's announced size is checked against it before anything is allocated,
  // so a faulty or hostile peer cannot make a receiver commit more memory than this per recv.
  uint64_t max_tensor_bytes = uint64_t{4096} << 20;
  // TENSORVERBS_MAX_PEER_STEPS: steps that peers' requests may start before this task takes
  // them up, 1 .. 1048576, default 1024; those it has not taken up within the recv timeout are
  // aborted (see rendezvous/rendezvous_mgr.h).
  int64_t max_peer_steps = 1024;
  // TENSORVERBS_POOL_KEEP_FREE_MB: wholly free receive-pool memory kept however long it idles,
  // in MiB, 0 .. 1048576, default 1024; free regions beyond it are returned to the OS after
  // 30 s unused (see tensor/allocator.h).
  uint64_t pool_keep_free_bytes = uint64_t{1024} << 20;

  // Authentication of the calls between tasks (see rpc/security.h). TENSORVERBS_TLS_CERT,
  // TENSORVERBS_TLS_KEY, TENSORVERBS_TLS_CA: PEM files for mutual TLS (all three or none).
  // TENSORVERBS_SECRET_FILE: a file holding the cluster secret. Empty: not configured.
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_ca_file;
  std::string secret_file;

  // TENSORVERBS_CALLBACK_THREADS: threads that run user `done` callbacks. 0 .. 256, default 2;
  // 0 runs each callback inline on the transport's thread (lowest latency; a callback that
  // blocks then stalls every transfer).
  int callback_threads = 2;
  // TENSORVERBS_INLINE_CALLBACK_US: with callback threads, grpc+verbs runs recv callbacks on its
  // progress thread (no hand-off between threads) until one keeps it this long; the loop then
  // moves to a new thread and callbacks go to the callback threads from then on. 0 .. 1000000,
  // default 1000; 0 always hands them over.
  absl::Duration inline_callback_limit = absl::Milliseconds(1);
  // TENSORVERBS_WAITER_PROGRESS: 1 (default) lets a thread that waits for a recv (a blocking
  // recv, a future's or a work's wait) drive grpc+verbs's progress itself while it waits, so
  // the recv completes on it with no hand-off between threads; 0 leaves progress to the progress
  // thread alone, and the waiter sleeps until it is woken.
  bool waiter_progress = true;

  // TENSORVERBS_MALLOC_TUNING: 1 (default) lets Server raise glibc's heap trim threshold so
  // large transfers do not fault fresh pages each time (see common/malloc_tuning.h); 0 leaves
  // malloc alone.
  bool malloc_tuning = true;
  // TENSORVERBS_MALLOC_TRIM_MB: freed heap kept before glibc returns it to the OS, with the
  // tuning on. 1 .. 2047, default 1024.
  int64_t malloc_trim_bytes = int64_t{1024} << 20;

  // TENSORVERBS_OFI_PROVIDER: the libfabric provider the ofi backend opens when the caller names
  // none ("shm", "tcp;ofi_rxm", "verbs;ofi_rxm", ...); empty: the first hardware provider found,
  // else tcp;ofi_rxm.
  std::string ofi_provider;

  RdmaConfig rdma;

  // --- grpc+verbs ---
  // TENSORVERBS_FABRIC: auto | shmem | ofi | ibverbs | loopback. auto: shmem when every peer
  // is on this host, else ibverbs where a usable port exists, else ofi. shmem works only
  // between processes of one host; loopback only between servers of one process (tests).
  std::string fabric = "auto";
  // TENSORVERBS_MESSAGE_SLOTS: control messages in flight per channel direction, 1 .. 1024,
  // default 8. 1 is the seed's stop-and-wait message buffer.
  int message_slots = 8;
  // TENSORVERBS_MESSAGE_BATCH: the most control messages one slot carries when messages queue
  // behind busy slots, 1 .. 128, default 32. 1 writes one message per slot, as the seed does.
  int message_batch = 32;
  // TENSORVERBS_POLL_MODE: busy | blocking | adaptive (default). adaptive spins for
  // TENSORVERBS_POLL_SPIN_US (0 .. 1000000, default 50) after the last completion, then sleeps
  // in Domain::Wait; busy never sleeps; blocking sleeps as soon as nothing is ready.
  std::string poll_mode = "adaptive";
  absl::Duration poll_spin = absl::Microseconds(50);
  // TENSORVERBS_DATA_VALIDATION: 1 sends a CRC-32C of every tensor with its meta-data and
  // fails a recv whose bytes do not match with DataLoss. Default 0.
  bool data_validation = false;
  // TENSORVERBS_REGISTRATION: pool (default; pool regions registered once) | per-transfer
  // (the destination is registered for each transfer) | copy (transfers land in a
  // pre-registered buffer and are copied out). The seed's three strategies.
  std::string registration = "pool";
  // TENSORVERBS_PEER_TIMEOUT_MS: a peer that does not answer the control plane for this long
  // is dead: everything pending on its channel fails with Unavailable. 100 .. 86400000,
  // default 10000.
  absl::Duration peer_timeout = absl::Seconds(10);
  // TENSORVERBS_SLOW_RECV_MS: a remote recv still waiting after this long logs one warning
  // naming its key, step and peer (a sender that never sends shows up long before the recv
  // timeout). 0 turns the warning off. 0 .. 86400000, default 60000.
  absl::Duration slow_recv_warning = absl::Seconds(60);
  // TENSORVERBS_STOP_TIMEOUT_MS: how long Task::Stop, and then a Task's destructor, each wait
  // for the task to shut down before they give up, log what is stuck and leave the rest to
  // finish, with the task's memory, whenever the stuck call returns. Longer than the waits
  // Server::Stop makes on its own (grace periods, peers' calls, device copies: 54 s at most).
  // 100 .. 86400000, default 60000.
  absl::Duration stop_timeout = absl::Seconds(60);
  // TENSORVERBS_TRACE: a file to write a Chrome trace-event JSON of every remote recv's phases
  // into (src/common/trace.h); "%p" in it becomes the process id. Empty: no trace.
  std::string trace_file;
  // TENSORVERBS_CUDA_RUNTIME: the CUDA runtime library to load (a name or path, such as
  // /usr/local/cuda/lib64/libcudart.so.13); empty: libcudart.so.13, .12 or .so from the loader's
  // path, then the build's toolkit.
  std::string cuda_runtime;
  // TENSORVERBS_PIN_POOL: auto (default) | on | off. A task's receive pool is page-locked with
  // the CUDA runtime so GPU copies reach it by DMA: auto and on do it when a GPU is found (on
  // also says when none is), off never loads the CUDA runtime.
  std::string pin_pool = "auto";
  // TENSORVERBS_GPU_DIRECT: on (default) | off. On, grpc+verbs over the same-host fabric writes
  // GPU tensors from and into GPU memory directly (CUDA IPC) where a GPU is found; off, they
  // take the proxy path through host memory (two copies), as on every other fabric.
  bool gpu_direct = true;
  // TENSORVERBS_PROXY_CHUNK_KB: 0, or 64 .. 1048576, default 4096. A GPU tensor on the proxy
  // path over grpc+verbs moves in chunks of this many KiB, so that one chunk's device copy
  // overlaps the next one's transfer; 0 moves it whole, one stage after another.
  uint64_t proxy_chunk_bytes = uint64_t{4} << 20;
  // TENSORVERBS_PUSH: on (default) | off. On, a grpc+verbs receiver that just received a key at
  // step s asks for it at step s+1 at once, with a destination from the key's meta-data, so the
  // sender writes the moment it sends and the next recv of the key needs no REQUEST round
  // trip. TENSORVERBS_PUSH_MAX (1 .. 65536, default 1024) and TENSORVERBS_PUSH_MAX_MB (1 ..
  // 1048576, default 256) bound the destinations and bytes a channel has pushed ahead.
  bool push = true;
  int push_max_destinations = 1024;
  uint64_t push_max_bytes = uint64_t{256} << 20;
  // TENSORVERBS_MAX_RESPONSES: requests a peer may have pending at this task on one channel
  // (tensors it asked for that are not yet sent), 1 .. 1048576, default 65536; beyond, a
  // request fails with ResourceExhausted at once.
  int max_responses = 65536;
  // TENSORVERBS_MAX_PENDING_RECVS: recvs (and grpc+gdr reads) this task may have waiting on one
  // channel for the peer's answer, ended ones whose destination the peer may still write
  // included; 1 .. 1048576, default 65536. Beyond, a recv fails with ResourceExhausted at once.
  int max_pending_recvs = 65536;
  // TENSORVERBS_LARGE_IN_FLIGHT: grpc+verbs destinations of 4 MiB and more that one channel
  // hands its sender at once, 0 .. 1048576 (0: no limit), default 2; further large recvs name
  // their destination when an earlier one has landed (ChannelEnv::large_in_flight says why).
  int large_in_flight = 2;
  // TENSORVERBS_SHMEM_COPY_THREADS: threads of the same-host fabric that share each write of 8
  // MiB and more with the progress thread, 0 .. 64 (0: the progress thread copies alone),
  // default 1 (fabric::shmem::CopyHelpers).
  int shmem_copy_threads = 1;
  // TENSORVERBS_SHMEM_PEER_COPY: on (default) | off. On: the same-host fabric's progress thread
  // takes part in copying a peer's writes of 512 KiB up to the copy threads' size into this
  // task's memory, and offers its own to the peer alike (fabric::shmem::SharedWrite).
  bool shmem_peer_copy = true;
  // TENSORVERBS_REMOTE_KEYS: per-channel (default) | shared. Per-channel: where the fabric
  // offers keys of its own to each endpoint (Capabilities::channel_keys), each peer is offered
  // its own registration of this task's memory, dropped when its channel closes; elsewhere,
  // and with shared, one registration per pool region serves every peer.
  std::string remote_keys = "per-channel";

  // Non-fatal remarks about the environment (unknown TENSORVERBS_* variables).
  std::vector<std::string> warnings;

  // Parses `env` (name -> value). Returns InvalidArgument naming the variable, the value and
  // the valid range for the first bad value.
  static absl::StatusOr<Config> FromEnvironment(const std::map<std::string, std::string>& env);

  // Every variable unset: the one declaration of each setting's default. The options of the
  // layers that own the settings (ServerOptions, TransferSettings, VerbsOptions,
  // protocol::ChannelOptions) start from these, so a default changes here and nowhere else.
  static const Config& Defaults();

  // The process configuration. If the environment holds a bad value, the defaults are used and
  // EnvironmentStatus() reports the error.
  static const Config& Get();
  static absl::Status EnvironmentStatus();

  // The documented variables, for `tensorverbs info` and the unknown-variable check.
  static const std::vector<std::string>& KnownVariables();
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_CONFIG_H_
