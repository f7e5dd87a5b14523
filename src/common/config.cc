#include "src/common/config.h"

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"

extern char** environ;

namespace tensorverbs {
namespace {

constexpr char kPrefix[] = "TENSORVERBS_";

// What an unset variable parses to, in the unit the variable is written in: the field's own
// default, so each default is declared once, in config.h.
int64_t Ms(absl::Duration d) { return absl::ToInt64Milliseconds(d); }
int64_t Mb(uint64_t bytes) { return static_cast<int64_t>(bytes >> 20); }
std::string OnOff(bool on) { return on ? "on" : "off"; }

absl::StatusOr<int64_t> ParseInt(const std::map<std::string, std::string>& env,
                                 const std::string& name, int64_t min, int64_t max,
                                 int64_t default_value) {
  auto it = env.find(name);
  if (it == env.end()) return default_value;
  int64_t value = 0;
  std::string text(absl::StripAsciiWhitespace(it->second));
  if (!absl::SimpleAtoi(text, &value) || value < min || value > max) {
    return absl::InvalidArgumentError(absl::StrCat("environment variable ", name, "='", it->second,
                                                   "' is invalid: expected an integer in [", min,
                                                   ", ", max, "]"));
  }
  return value;
}

// A value from a fixed set (case-insensitive); `default_value` when unset.
absl::StatusOr<std::string> ParseChoice(const std::map<std::string, std::string>& env,
                                        const std::string& name,
                                        const std::vector<std::string>& choices,
                                        const std::string& default_value) {
  auto it = env.find(name);
  if (it == env.end()) return default_value;
  std::string v = absl::AsciiStrToLower(absl::StripAsciiWhitespace(it->second));
  for (const std::string& c : choices) {
    if (v == c) return v;
  }
  return absl::InvalidArgumentError(absl::StrCat("environment variable ", name, "='", it->second,
                                                 "' is invalid: expected one of ",
                                                 absl::StrJoin(choices, ", ")));
}

absl::Status ParseLogLevel(const std::map<std::string, std::string>& env, Config& config) {
  config.log_severity = LogSeverity::kWarning;
  auto it = env.find("TENSORVERBS_LOG_LEVEL");
  if (it == env.end()) return absl::OkStatus();
  std::string v = absl::AsciiStrToLower(absl::StripAsciiWhitespace(it->second));
  int n = 0;
  if (v == "error") {
    config.log_severity = LogSeverity::kError;
  } else if (v == "warning" || v == "warn") {
    config.log_severity = LogSeverity::kWarning;
  } else if (v == "info") {
    config.log_severity = LogSeverity::kInfo;
  } else if (v == "debug") {
    config.log_severity = LogSeverity::kInfo;
    config.log_verbosity = 1;
  } else if (absl::SimpleAtoi(v, &n) && n >= 0 && n <= 9) {
    config.log_severity = LogSeverity::kInfo;
    config.log_verbosity = n;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable TENSORVERBS_LOG_LEVEL='", it->second,
                     "' is invalid: expected error, warning, info, debug or a verbosity 0..9"));
  }
  return absl::OkStatus();
}

// Reads `name`, or its TensorFlow-code alias; an error if both are set and disagree.
absl::StatusOr<int64_t> ParseAliased(const std::map<std::string, std::string>& env,
                                     const std::string& name, const std::string& alias, int64_t min,
                                     int64_t max, int64_t default_value) {
  auto a = env.find(name), b = env.find(alias);
  if (a != env.end() && b != env.end() &&
      absl::StripAsciiWhitespace(a->second) != absl::StripAsciiWhitespace(b->second)) {
    return absl::InvalidArgumentError(absl::StrCat("environment variables ", name, "='", a->second,
                                                   "' and its alias ", alias, "='", b->second,
                                                   "' disagree; set only ", name));
  }
  return ParseInt(env, a != env.end() ? name : alias, min, max, default_value);
}

absl::Status ParseRdma(const std::map<std::string, std::string>& env, RdmaConfig& rdma) {
  if (auto it = env.find("RDMA_DEVICE"); it != env.end()) {
    rdma.device = std::string(absl::StripAsciiWhitespace(it->second));
  }
  ASSIGN_OR_RETURN(int64_t port, ParseInt(env, "RDMA_DEVICE_PORT", 1, 255, rdma.port));
  ASSIGN_OR_RETURN(int64_t gid, ParseInt(env, "RDMA_GID_INDEX", 0, 255, rdma.gid_index));
  ASSIGN_OR_RETURN(int64_t pkey,
                   ParseAliased(env, "RDMA_QP_PKEY_INDEX", "RDMA_PKEY", 0, 65535, rdma.pkey_index));
  ASSIGN_OR_RETURN(int64_t depth, ParseAliased(env, "RDMA_QP_QUEUE_DEPTH", "RDMA_QUEUE_DEPTH", 1,
                                               65536, rdma.queue_depth));
  ASSIGN_OR_RETURN(int64_t timeout,
                   ParseAliased(env, "RDMA_QP_TIMEOUT", "RDMA_TIMEOUT", 0, 31, rdma.timeout));
  ASSIGN_OR_RETURN(int64_t retry, ParseAliased(env, "RDMA_QP_RETRY_COUNT", "RDMA_RETRY_CNT", 0, 7,
                                               rdma.retry_count));
  ASSIGN_OR_RETURN(int64_t sl, ParseAliased(env, "RDMA_QP_SL", "RDMA_SL", 0, 7, rdma.sl));
  ASSIGN_OR_RETURN(int64_t mtu, ParseAliased(env, "RDMA_QP_MTU", "RDMA_MTU", 256, 4096, rdma.mtu));
  if (mtu != 0 && mtu != 256 && mtu != 512 && mtu != 1024 && mtu != 2048 && mtu != 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("environment variable RDMA_QP_MTU=", mtu,
                     " is invalid: expected 256, 512, 1024, 2048 or 4096"));
  }
  ASSIGN_OR_RETURN(int64_t tc, ParseInt(env, "RDMA_TRAFFIC_CLASS", 0, 255, rdma.traffic_class));
  rdma.port = static_cast<int>(port);
  rdma.gid_index = static_cast<int>(gid);
  rdma.pkey_index = static_cast<int>(pkey);
  rdma.queue_depth = static_cast<int>(depth);
  rdma.timeout = static_cast<int>(timeout);
  rdma.retry_count = static_cast<int>(retry);
  rdma.sl = static_cast<int>(sl);
  rdma.mtu = static_cast<int>(mtu);
  rdma.traffic_class = static_cast<int>(tc);
  return absl::OkStatus();
}

std::map<std::string, std::string> ProcessEnvironment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    absl::string_view entry(*e);
    size_t eq = entry.find('=');
    if (eq == absl::string_view::npos) continue;
    std::string name(entry.substr(0, eq));
    // Only the variables this project owns or honours are kept.
    if (absl::StartsWith(name, kPrefix) || absl::StartsWith(name, "RDMA_")) {
      env.emplace(std::move(name), std::string(entry.substr(eq + 1)));
    }
  }
  return env;
}

struct ProcessConfig {
  Config config;
  absl::Status status;
};

const ProcessConfig& GetProcessConfig() {
  static const ProcessConfig* process = [] {
    auto* p = new ProcessConfig;
    absl::StatusOr<Config> parsed = Config::FromEnvironment(ProcessEnvironment());
    if (parsed.ok()) {
      p->config = *std::move(parsed);
    } else {
      p->status = parsed.status();
      p->config = *Config::FromEnvironment({});
    }
    // Logging reads this object, so remarks are written directly rather than through LOG.
    for (const std::string& w : p->config.warnings) {
      std::fprintf(stderr, "W tensorverbs config] %s\n", w.c_str());
    }
    return p;
  }();
  return *process;
}

}  // namespace

const std::vector<std::string>& Config::KnownVariables() {
  static const std::vector<std::string> names = {
      "TENSORVERBS_LOG_LEVEL",
      "TENSORVERBS_RECV_TIMEOUT_MS",
      "TENSORVERBS_CONNECT_TIMEOUT_MS",
      "TENSORVERBS_POOL_REGION_MB",
      "TENSORVERBS_CALLBACK_THREADS",
      "TENSORVERBS_INLINE_CALLBACK_US",
      "TENSORVERBS_WAITER_PROGRESS",
      "TENSORVERBS_MALLOC_TUNING",
      "TENSORVERBS_MALLOC_TRIM_MB",
      "TENSORVERBS_OFI_PROVIDER",
      "TENSORVERBS_FABRIC",
      "TENSORVERBS_MESSAGE_SLOTS",
      "TENSORVERBS_MESSAGE_BATCH",
      "TENSORVERBS_POLL_MODE",
      "TENSORVERBS_POLL_SPIN_US",
      "TENSORVERBS_DATA_VALIDATION",
      "TENSORVERBS_REGISTRATION",
      "TENSORVERBS_PEER_TIMEOUT_MS",
      "TENSORVERBS_SLOW_RECV_MS",
      "TENSORVERBS_STOP_TIMEOUT_MS",
      "TENSORVERBS_TRACE",
      "TENSORVERBS_CUDA_RUNTIME",
      "TENSORVERBS_PIN_POOL",
      "TENSORVERBS_GPU_DIRECT",
      "TENSORVERBS_PROXY_CHUNK_KB",
      "TENSORVERBS_PUSH",
      "TENSORVERBS_PUSH_MAX",
      "TENSORVERBS_PUSH_MAX_MB",
      "TENSORVERBS_MAX_TENSOR_MB",
      "TENSORVERBS_MAX_PEER_STEPS",
      "TENSORVERBS_MAX_RESPONSES",
      "TENSORVERBS_POOL_KEEP_FREE_MB",
      "TENSORVERBS_MAX_PENDING_RECVS",
      "TENSORVERBS_LARGE_IN_FLIGHT",
      "TENSORVERBS_SHMEM_COPY_THREADS",
      "TENSORVERBS_SHMEM_PEER_COPY",
      "TENSORVERBS_REMOTE_KEYS",
      "TENSORVERBS_TLS_CERT",
      "TENSORVERBS_TLS_KEY",
      "TENSORVERBS_TLS_CA",
      "TENSORVERBS_SECRET_FILE",
      // Read outside the task's settings: by PlacementFromEnvironment (Slurm) and by the
      // torch.distributed backend, which picks the protocol and address of the tasks it starts.
      "TENSORVERBS_SLURM_JOBS",
      "TENSORVERBS_SLURM_PORT",
      "TENSORVERBS_PROTOCOL",
      "TENSORVERBS_HOST",
      // Read by setup.py (pip install): the CMake build tree whose Python module it packages.
      "TENSORVERBS_CMAKE_BUILD_DIR",
  };
  return names;
}

absl::StatusOr<Config> Config::FromEnvironment(const std::map<std::string, std::string>& env) {
  Config config;
  RETURN_IF_ERROR(ParseLogLevel(env, config));
  ASSIGN_OR_RETURN(int64_t recv_ms, ParseInt(env, "TENSORVERBS_RECV_TIMEOUT_MS", 1, 86400000,
                                             Ms(config.recv_timeout)));
  config.recv_timeout = absl::Milliseconds(recv_ms);
  ASSIGN_OR_RETURN(int64_t connect_ms, ParseInt(env, "TENSORVERBS_CONNECT_TIMEOUT_MS", 1, 86400000,
                                                Ms(config.connect_timeout)));
  config.connect_timeout = absl::Milliseconds(connect_ms);
  ASSIGN_OR_RETURN(int64_t region_mb, ParseInt(env, "TENSORVERBS_POOL_REGION_MB", 1, 65536,
                                               Mb(config.pool_region_bytes)));
  config.pool_region_bytes = region_mb << 20;
  ASSIGN_OR_RETURN(int64_t max_tensor_mb, ParseInt(env, "TENSORVERBS_MAX_TENSOR_MB", 1, 1048576,
                                                   Mb(config.max_tensor_bytes)));
  config.max_tensor_bytes = static_cast<uint64_t>(max_tensor_mb) << 20;
  ASSIGN_OR_RETURN(int64_t keep_free_mb, ParseInt(env, "TENSORVERBS_POOL_KEEP_FREE_MB", 0, 1048576,
                                                  Mb(config.pool_keep_free_bytes)));
  config.pool_keep_free_bytes = static_cast<uint64_t>(keep_free_mb) << 20;
  ASSIGN_OR_RETURN(config.max_peer_steps,
                   ParseInt(env, "TENSORVERBS_MAX_PEER_STEPS", 1, 1048576, config.max_peer_steps));
  for (auto [name, field] : {std::pair{"TENSORVERBS_TLS_CERT", &config.tls_cert_file},
                             std::pair{"TENSORVERBS_TLS_KEY", &config.tls_key_file},
                             std::pair{"TENSORVERBS_TLS_CA", &config.tls_ca_file},
                             std::pair{"TENSORVERBS_SECRET_FILE", &config.secret_file},
                             std::pair{"TENSORVERBS_TRACE", &config.trace_file},
                             std::pair{"TENSORVERBS_CUDA_RUNTIME", &config.cuda_runtime}}) {
    if (auto it = env.find(name); it != env.end()) {
      *field = std::string(absl::StripAsciiWhitespace(it->second));
    }
  }
  const int tls_files =
      !config.tls_cert_file.empty() + !config.tls_key_file.empty() + !config.tls_ca_file.empty();
  if (tls_files != 0 && tls_files != 3) {
    return absl::InvalidArgumentError(
        "TENSORVERBS_TLS_CERT, TENSORVERBS_TLS_KEY and TENSORVERBS_TLS_CA: mutual TLS needs all "
        "three (this task's certificate, its private key and the cluster's CA), or none");
  }
  ASSIGN_OR_RETURN(int64_t threads,
                   ParseInt(env, "TENSORVERBS_CALLBACK_THREADS", 0, 256, config.callback_threads));
  config.callback_threads = static_cast<int>(threads);
  ASSIGN_OR_RETURN(int64_t inline_us,
                   ParseInt(env, "TENSORVERBS_INLINE_CALLBACK_US", 0, 1000000,
                            absl::ToInt64Microseconds(config.inline_callback_limit)));
  config.inline_callback_limit = absl::Microseconds(inline_us);
  ASSIGN_OR_RETURN(int64_t waiter_progress,
                   ParseInt(env, "TENSORVERBS_WAITER_PROGRESS", 0, 1, config.waiter_progress));
  config.waiter_progress = waiter_progress == 1;
  ASSIGN_OR_RETURN(int64_t tuning,
                   ParseInt(env, "TENSORVERBS_MALLOC_TUNING", 0, 1, config.malloc_tuning));
  config.malloc_tuning = tuning == 1;
  ASSIGN_OR_RETURN(int64_t trim_mb, ParseInt(env, "TENSORVERBS_MALLOC_TRIM_MB", 1, 2047,
                                             Mb(config.malloc_trim_bytes)));
  config.malloc_trim_bytes = trim_mb << 20;
  RETURN_IF_ERROR(ParseRdma(env, config.rdma));
  if (auto it = env.find("TENSORVERBS_OFI_PROVIDER"); it != env.end()) {
    config.ofi_provider = std::string(absl::StripAsciiWhitespace(it->second));
  }
  ASSIGN_OR_RETURN(config.fabric,
                   ParseChoice(env, "TENSORVERBS_FABRIC",
                               {"auto", "shmem", "ofi", "ibverbs", "loopback"}, config.fabric));
  ASSIGN_OR_RETURN(int64_t slots,
                   ParseInt(env, "TENSORVERBS_MESSAGE_SLOTS", 1, 1024, config.message_slots));
  config.message_slots = static_cast<int>(slots);
  ASSIGN_OR_RETURN(int64_t batch,
                   ParseInt(env, "TENSORVERBS_MESSAGE_BATCH", 1, 128, config.message_batch));
  config.message_batch = static_cast<int>(batch);
  ASSIGN_OR_RETURN(config.poll_mode,
                   ParseChoice(env, "TENSORVERBS_POLL_MODE", {"busy", "blocking", "adaptive"},
                               config.poll_mode));
  ASSIGN_OR_RETURN(int64_t spin_us, ParseInt(env, "TENSORVERBS_POLL_SPIN_US", 0, 1000000,
                                             absl::ToInt64Microseconds(config.poll_spin)));
  config.poll_spin = absl::Microseconds(spin_us);
  ASSIGN_OR_RETURN(int64_t validation,
                   ParseInt(env, "TENSORVERBS_DATA_VALIDATION", 0, 1, config.data_validation));
  config.data_validation = validation == 1;
  ASSIGN_OR_RETURN(config.registration,
                   ParseChoice(env, "TENSORVERBS_REGISTRATION", {"pool", "per-transfer", "copy"},
                               config.registration));
  ASSIGN_OR_RETURN(int64_t peer_ms, ParseInt(env, "TENSORVERBS_PEER_TIMEOUT_MS", 100, 86400000,
                                             Ms(config.peer_timeout)));
  config.peer_timeout = absl::Milliseconds(peer_ms);
  ASSIGN_OR_RETURN(int64_t slow_ms, ParseInt(env, "TENSORVERBS_SLOW_RECV_MS", 0, 86400000,
                                             Ms(config.slow_recv_warning)));
  config.slow_recv_warning = absl::Milliseconds(slow_ms);
  ASSIGN_OR_RETURN(int64_t stop_ms, ParseInt(env, "TENSORVERBS_STOP_TIMEOUT_MS", 100, 86400000,
                                             Ms(config.stop_timeout)));
  config.stop_timeout = absl::Milliseconds(stop_ms);
  ASSIGN_OR_RETURN(config.pin_pool, ParseChoice(env, "TENSORVERBS_PIN_POOL", {"auto", "on", "off"},
                                                config.pin_pool));
  ASSIGN_OR_RETURN(std::string gpu_direct, ParseChoice(env, "TENSORVERBS_GPU_DIRECT", {"on", "off"},
                                                       OnOff(config.gpu_direct)));
  config.gpu_direct = gpu_direct == "on";
  ASSIGN_OR_RETURN(int64_t proxy_chunk_kb,
                   ParseInt(env, "TENSORVERBS_PROXY_CHUNK_KB", 0, 1048576,
                            static_cast<int64_t>(config.proxy_chunk_bytes >> 10)));
  if (proxy_chunk_kb > 0 && proxy_chunk_kb < 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TENSORVERBS_PROXY_CHUNK_KB=", proxy_chunk_kb,
        ": chunks of the proxy path are at least 64 KiB; set 0 to move GPU tensors whole"));
  }
  config.proxy_chunk_bytes = static_cast<uint64_t>(proxy_chunk_kb) << 10;
  ASSIGN_OR_RETURN(std::string push,
                   ParseChoice(env, "TENSORVERBS_PUSH", {"on", "off"}, OnOff(config.push)));
  config.push = push == "on";
  ASSIGN_OR_RETURN(int64_t push_max,
                   ParseInt(env, "TENSORVERBS_PUSH_MAX", 1, 65536, config.push_max_destinations));
  config.push_max_destinations = static_cast<int>(push_max);
  ASSIGN_OR_RETURN(int64_t push_mb,
                   ParseInt(env, "TENSORVERBS_PUSH_MAX_MB", 1, 1048576, Mb(config.push_max_bytes)));
  config.push_max_bytes = static_cast<uint64_t>(push_mb) << 20;
  ASSIGN_OR_RETURN(int64_t max_responses,
                   ParseInt(env, "TENSORVERBS_MAX_RESPONSES", 1, 1048576, config.max_responses));
  config.max_responses = static_cast<int>(max_responses);
  ASSIGN_OR_RETURN(int64_t max_pending_recvs, ParseInt(env, "TENSORVERBS_MAX_PENDING_RECVS", 1,
                                                       1048576, config.max_pending_recvs));
  config.max_pending_recvs = static_cast<int>(max_pending_recvs);
  ASSIGN_OR_RETURN(int64_t large_in_flight, ParseInt(env, "TENSORVERBS_LARGE_IN_FLIGHT", 0, 1048576,
                                                     config.large_in_flight));
  config.large_in_flight = static_cast<int>(large_in_flight);
  ASSIGN_OR_RETURN(int64_t copy_threads, ParseInt(env, "TENSORVERBS_SHMEM_COPY_THREADS", 0, 64,
                                                  config.shmem_copy_threads));
  config.shmem_copy_threads = static_cast<int>(copy_threads);
  ASSIGN_OR_RETURN(std::string peer_copy,
                   ParseChoice(env, "TENSORVERBS_SHMEM_PEER_COPY", {"on", "off"},
                               OnOff(config.shmem_peer_copy)));
  config.shmem_peer_copy = peer_copy == "on";
  ASSIGN_OR_RETURN(config.remote_keys, ParseChoice(env, "TENSORVERBS_REMOTE_KEYS",
                                                   {"per-channel", "shared"}, config.remote_keys));

  const std::vector<std::string>& known = KnownVariables();
  for (const auto& [name, value] : env) {
    if (!absl::StartsWith(name, kPrefix)) continue;
    bool is_known = false;
    for (const std::string& k : known) is_known |= (k == name);
    if (!is_known) {
      config.warnings.push_back(
          absl::StrCat("unknown environment variable ", name,
                       " is ignored; known variables: ", absl::StrJoin(known, ", ")));
    }
  }
  return config;
}

const Config& Config::Defaults() {
  static const Config* defaults = new Config(*FromEnvironment({}));
  return *defaults;
}

const Config& Config::Get() { return GetProcessConfig().config; }

absl::Status Config::EnvironmentStatus() { return GetProcessConfig().status; }

}  // namespace tensorverbs
