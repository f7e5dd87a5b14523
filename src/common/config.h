// Config: every environment variable tensorverbs reads, parsed once into typed fields.
//
// Each variable is one row of the settings table (src/common/settings.h: name, alias, type,
// range, help); each default is the field's initializer here, declared once and read back by
// the table for the README and `tensorverbs info`. The options of the layer that owns a
// setting read it through Config::Defaults() or Config::Get().
//
// config.cc is the only place in the project that reads the process environment. Config::Get()
// parses it on first use (thread-safe) and returns the same object forever after; tools call
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
#include "src/common/log_severity.h"

namespace tensorverbs {

// The seed's RDMA_* variables for the ibverbs backend (the settings table's second part).
// Zero / -1 / empty mean "choose automatically".
struct RdmaConfig {
  std::string device;      // RDMA_DEVICE
  int port = 0;            // RDMA_DEVICE_PORT
  int gid_index = -1;      // RDMA_GID_INDEX
  int pkey_index = 0;      // RDMA_QP_PKEY_INDEX
  int queue_depth = 1024;  // RDMA_QP_QUEUE_DEPTH
  int timeout = 14;        // RDMA_QP_TIMEOUT
  int retry_count = 7;     // RDMA_QP_RETRY_COUNT
  int sl = 0;              // RDMA_QP_SL
  int mtu = 0;             // RDMA_QP_MTU
  int traffic_class = 0;   // RDMA_TRAFFIC_CLASS
};

// Each field's meaning and range are its row's in src/common/settings.cc.
struct Config {
  LogSeverity log_severity = LogSeverity::kWarning;  // TENSORVERBS_LOG_LEVEL
  int log_verbosity = 0;

  absl::Duration recv_timeout = absl::Minutes(10);      // TENSORVERBS_RECV_TIMEOUT_MS
  absl::Duration connect_timeout = absl::Seconds(60);   // TENSORVERBS_CONNECT_TIMEOUT_MS
  absl::Duration peer_timeout = absl::Seconds(10);      // TENSORVERBS_PEER_TIMEOUT_MS
  absl::Duration slow_recv_warning = absl::Seconds(60);  // TENSORVERBS_SLOW_RECV_MS
  // Longer than the waits Server::Stop makes on its own (grace periods, peers' calls, device
  // copies: 54 s at most).
  absl::Duration stop_timeout = absl::Seconds(60);  // TENSORVERBS_STOP_TIMEOUT_MS

  int64_t pool_region_bytes = int64_t{64} << 20;          // TENSORVERBS_POOL_REGION_MB
  uint64_t pool_keep_free_bytes = uint64_t{1024} << 20;  // TENSORVERBS_POOL_KEEP_FREE_MB
  // Checked against a peer's announced size before anything is allocated, so a faulty or
  // hostile peer cannot make a receiver commit more memory than this per recv.
  uint64_t max_tensor_bytes = uint64_t{4096} << 20;  // TENSORVERBS_MAX_TENSOR_MB
  int64_t max_peer_steps = 1024;                     // TENSORVERBS_MAX_PEER_STEPS
  int max_responses = 65536;                         // TENSORVERBS_MAX_RESPONSES
  int max_pending_recvs = 65536;                     // TENSORVERBS_MAX_PENDING_RECVS
  // ChannelEnv::large_in_flight says why.
  int large_in_flight = 2;  // TENSORVERBS_LARGE_IN_FLIGHT

  // Authentication of the calls between tasks (rpc/security.h); empty: not configured.
  std::string tls_cert_file;  // TENSORVERBS_TLS_CERT
  std::string tls_key_file;   // TENSORVERBS_TLS_KEY
  std::string tls_ca_file;    // TENSORVERBS_TLS_CA
  std::string secret_file;    // TENSORVERBS_SECRET_FILE

  int callback_threads = 2;                                      // TENSORVERBS_CALLBACK_THREADS
  absl::Duration inline_callback_limit = absl::Milliseconds(1);  // TENSORVERBS_INLINE_CALLBACK_US
  bool waiter_progress = true;                                   // TENSORVERBS_WAITER_PROGRESS

  // common/malloc_tuning.h.
  bool malloc_tuning = true;                        // TENSORVERBS_MALLOC_TUNING
  int64_t malloc_trim_bytes = int64_t{1024} << 20;  // TENSORVERBS_MALLOC_TRIM_MB

  std::string ofi_provider;  // TENSORVERBS_OFI_PROVIDER; empty: chosen per peer
  RdmaConfig rdma;

  // --- grpc+verbs ---
  std::string fabric = "auto";  // TENSORVERBS_FABRIC
  int message_slots = 8;        // TENSORVERBS_MESSAGE_SLOTS
  int message_batch = 32;       // TENSORVERBS_MESSAGE_BATCH
  absl::Duration channel_idle = absl::Minutes(5);    // TENSORVERBS_CHANNEL_IDLE_MS (0: never)
  std::string poll_mode = "adaptive";                // TENSORVERBS_POLL_MODE
  absl::Duration poll_spin = absl::Microseconds(50);  // TENSORVERBS_POLL_SPIN_US
  bool data_validation = false;                       // TENSORVERBS_DATA_VALIDATION
  std::string registration = "pool";                  // TENSORVERBS_REGISTRATION
  std::string trace_file;  // TENSORVERBS_TRACE (common/trace.h)
  std::string cuda_runtime;          // TENSORVERBS_CUDA_RUNTIME
  std::string pin_pool = "auto";     // TENSORVERBS_PIN_POOL
  bool gpu_direct = true;            // TENSORVERBS_GPU_DIRECT
  uint64_t proxy_chunk_bytes = uint64_t{4} << 20;  // TENSORVERBS_PROXY_CHUNK_KB
  std::string rails;                               // TENSORVERBS_RAILS; empty: one lane
  uint64_t stripe_bytes = uint64_t{1} << 20;       // TENSORVERBS_STRIPE_KB
  bool stripe_by_rate = true;                      // TENSORVERBS_STRIPE_SHARES
  bool push = true;                                // TENSORVERBS_PUSH
  int push_max_destinations = 1024;                // TENSORVERBS_PUSH_MAX
  uint64_t push_max_bytes = uint64_t{256} << 20;   // TENSORVERBS_PUSH_MAX_MB
  int shmem_copy_threads = 1;  // TENSORVERBS_SHMEM_COPY_THREADS (fabric::shmem::CopyHelpers)
  bool ofi_shared_endpoint = true;  // TENSORVERBS_OFI_SHARED_ENDPOINT (fabric::DomainOptions)
  bool shmem_peer_copy = true;  // TENSORVERBS_SHMEM_PEER_COPY (fabric::shmem::SharedWrite)
  // Capabilities::channel_keys says where per-channel keys exist.
  std::string remote_keys = "per-channel";  // TENSORVERBS_REMOTE_KEYS

  // --- read by the tools and the bindings ---
  int slurm_port = 8888;                    // TENSORVERBS_SLURM_PORT (server/placement.cc)
  std::string torch_protocol = "grpc+verbs";  // TENSORVERBS_PROTOCOL
  std::string torch_host;                   // TENSORVERBS_HOST; empty: this host's name resolved
  bool torch_same_host = true;              // TENSORVERBS_TORCH_SAME_HOST

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

  // The documented variables and their aliases (the settings table's), for the
  // unknown-variable check.
  static const std::vector<std::string>& KnownVariables();
};

// The process environment's variables whose names start with one of `prefixes` (all of them
// when it is empty). The one reader of the environment besides Config itself: the Slurm and
// TF_CONFIG placement parsers read the scheduler's variables through it.
std::map<std::string, std::string> EnvironmentVariables(const std::vector<std::string>& prefixes);

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_CONFIG_H_
