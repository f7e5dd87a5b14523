#include "src/common/settings.h"

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "src/common/config.h"
#include "src/common/logging.h"

namespace tensorverbs {
namespace {

std::string Ms(absl::Duration d) { return absl::StrCat(absl::ToInt64Milliseconds(d)); }
std::string Us(absl::Duration d) { return absl::StrCat(absl::ToInt64Microseconds(d)); }
std::string Mb(uint64_t bytes) { return absl::StrCat(bytes >> 20); }
std::string OnOff(bool on) { return on ? "on" : "off"; }
std::string OneZero(bool on) { return on ? "1" : "0"; }

absl::Status ParseLogLevel(const std::string& text, Config& config) {
  const std::string v = absl::AsciiStrToLower(text);
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
    return absl::InvalidArgumentError("expected error, warning, info, debug or a verbosity 0..9");
  }
  return absl::OkStatus();
}

std::string GetLogLevel(const Config& c) {
  switch (c.log_severity) {
    case LogSeverity::kError:
      return "error";
    case LogSeverity::kWarning:
      return "warning";
    default:
      return c.log_verbosity == 0 ? "info" : absl::StrCat(c.log_verbosity);
  }
}

std::vector<Setting> MakeSettings() {
  using K = SettingKind;
  std::vector<Setting> s;
  auto add = [&s](Setting setting) { s.push_back(std::move(setting)); };

  add({.variable = "TENSORVERBS_LOG_LEVEL",
       .kind = K::kCustom,
       .help = "what to log: errors, warnings, information, or information and the debug lines "
               "of verbosity up to N",
       .values = "`error`, `warning`, `info`, `debug` (verbosity 1), or a verbosity `0`..`9`",
       .parse = ParseLogLevel,
       .get = GetLogLevel});
  add({.variable = "TENSORVERBS_RECV_TIMEOUT_MS",
       .kind = K::kInteger,
       .min = 1,
       .max = 86400000,
       .help = "how long a remote receive waits for the tensor and its peer before failing",
       .set_int = [](Config& c, int64_t v) { c.recv_timeout = absl::Milliseconds(v); },
       .get = [](const Config& c) { return Ms(c.recv_timeout); }});
  add({.variable = "TENSORVERBS_CONNECT_TIMEOUT_MS",
       .kind = K::kInteger,
       .min = 1,
       .max = 86400000,
       .help = "how long start-up waits for every peer task to answer",
       .set_int = [](Config& c, int64_t v) { c.connect_timeout = absl::Milliseconds(v); },
       .get = [](const Config& c) { return Ms(c.connect_timeout); }});
  add({.variable = "TENSORVERBS_POOL_REGION_MB",
       .kind = K::kInteger,
       .min = 1,
       .max = 65536,
       .help = "size of each memory region the receive pool takes from the OS",
       .set_int = [](Config& c, int64_t v) { c.pool_region_bytes = v << 20; },
       .get = [](const Config& c) { return Mb(c.pool_region_bytes); }});
  add({.variable = "TENSORVERBS_POOL_KEEP_FREE_MB",
       .kind = K::kInteger,
       .min = 0,
       .max = 1048576,
       .help = "wholly free receive-pool memory a task keeps however long it idles, in MiB; "
               "free regions beyond it are returned to the OS after 30 s unused, so a burst of "
               "large tensors does not hold its memory for the life of the process",
       .set_int = [](Config& c, int64_t v) { c.pool_keep_free_bytes = uint64_t(v) << 20; },
       .get = [](const Config& c) { return Mb(c.pool_keep_free_bytes); }});
  add({.variable = "TENSORVERBS_MAX_TENSOR_MB",
       .kind = K::kInteger,
       .min = 1,
       .max = 1048576,
       .help = "the largest tensor a task accepts from a peer, in MiB; checked against the "
               "peer's announced size before anything is allocated, so a larger one fails its "
               "recv with ResourceExhausted",
       .set_int = [](Config& c, int64_t v) { c.max_tensor_bytes = uint64_t(v) << 20; },
       .get = [](const Config& c) { return Mb(c.max_tensor_bytes); }});
  add({.variable = "TENSORVERBS_MAX_PEER_STEPS",
       .kind = K::kInteger,
       .min = 1,
       .max = 1048576,
       .help = "steps that peers' requests may start on a task before the task itself runs "
               "them; a request for one more fails at once with ResourceExhausted, and such a "
               "step the task has not run within the recv timeout is aborted",
       .set_int = [](Config& c, int64_t v) { c.max_peer_steps = v; },
       .get = [](const Config& c) { return absl::StrCat(c.max_peer_steps); }});
  add({.variable = "TENSORVERBS_MAX_RESPONSES",
       .kind = K::kInteger,
       .min = 1,
       .max = 1048576,
       .help = "`grpc+verbs` requests a peer may have waiting at a task on one channel; "
               "beyond, a request fails at once with ResourceExhausted",
       .set_int = [](Config& c, int64_t v) { c.max_responses = static_cast<int>(v); },
       .get = [](const Config& c) { return absl::StrCat(c.max_responses); }});
  add({.variable = "TENSORVERBS_MAX_PENDING_RECVS",
       .kind = K::kInteger,
       .min = 1,
       .max = 1048576,
       .help = "`grpc+verbs` recvs (and `grpc+gdr` reads) a task may have waiting on one peer "
               "at once, including ended ones whose memory the peer may still write; one more "
               "fails at once with ResourceExhausted",
       .set_int = [](Config& c, int64_t v) { c.max_pending_recvs = static_cast<int>(v); },
       .get = [](const Config& c) { return absl::StrCat(c.max_pending_recvs); }});
  add({.variable = "TENSORVERBS_REMOTE_KEYS",
       .kind = K::kChoice,
       .choices = {"per-channel", "shared"},
       .help = "`per-channel`: where the fabric offers it (ibverbs with type-2 memory windows, "
               "bound to the channel's queue pair; libfabric; loopback), each peer is offered "
               "keys of this task's memory of its own, revoked when its channel closes; "
               "`shared`: one key per pool region for every peer (`shmem` always shares)",
       .set_text = [](Config& c, const std::string& v) { c.remote_keys = v; },
       .get = [](const Config& c) { return c.remote_keys; }});
  add({.variable = "TENSORVERBS_LARGE_IN_FLIGHT",
       .kind = K::kInteger,
       .min = 0,
       .max = 1048576,
       .help = "`grpc+verbs` destinations of 4 MiB and more that a channel hands its sender at "
               "once for tensors the sender holds (`0`: every recv names its destination at "
               "once); further large recvs name theirs as earlier ones land, so many "
               "outstanding large recvs commit a few destinations, not one each",
       .set_int = [](Config& c, int64_t v) { c.large_in_flight = static_cast<int>(v); },
       .get = [](const Config& c) { return absl::StrCat(c.large_in_flight); }});
  add({.variable = "TENSORVERBS_RAILS",
       .kind = K::kText,
       .help = "`grpc+verbs` over libfabric `tcp` or ibverbs: further rails, comma-separated: "
               "over tcp each an address of this host (or an interface's name) on a network "
               "of its own, over ibverbs each a device (`mlx5_1` or `mlx5_1:2`); or a count "
               "(`2`: over tcp the interfaces that are up, each on a network of its own, over "
               "ibverbs the active ports in `RDMA_DEVICE`'s order; those on the task's NUMA "
               "node first, then by name; `tensorverbs info` shows the ranking); every channel "
               "gets a lane on each rail its peer has too, and large tensors are spread over "
               "the lanes (`TENSORVERBS_STRIPE_KB`)",
       .values = "addresses, interface or device names, or a count 0..3",
       .default_note = "none: one lane, on the task's address",
       .set_text = [](Config& c, const std::string& v) { c.rails = v; },
       .get = [](const Config& c) { return c.rails; }});
  add({.variable = "TENSORVERBS_STRIPE_KB",
       .kind = K::kInteger,
       .min = 0,
       .max = 4194304,
       .help = "`grpc+verbs` over several rails: tensors of this many KiB and more are written "
               "in segments spread over every lane (`0`: each tensor keeps to the first lane)",
       .set_int = [](Config& c, int64_t v) { c.stripe_bytes = static_cast<uint64_t>(v) << 10; },
       .get = [](const Config& c) { return absl::StrCat(c.stripe_bytes >> 10); }});
  add({.variable = "TENSORVERBS_STRIPE_SHARES",
       .kind = K::kChoice,
       .choices = {"rate", "even"},
       .help = "`grpc+verbs` over several rails: `rate`: each lane carries a share of a spread "
               "tensor in proportion to the rate the receiver measured it at over the tensors "
               "before (even until each lane was measured), so rails of different speeds "
               "finish together; `even`: the segments go round the lanes alike",
       .set_text = [](Config& c, const std::string& v) { c.stripe_by_rate = v == "rate"; },
       .get = [](const Config& c) -> std::string { return c.stripe_by_rate ? "rate" : "even"; }});
  add({.variable = "TENSORVERBS_SHMEM_COPY_THREADS",
       .kind = K::kInteger,
       .min = 0,
       .max = 64,
       .help = "threads of the same-host fabric that share each write of 8 MiB and more with "
               "the progress thread, so a large tensor is copied by several cores (`0`: the "
               "progress thread copies alone)",
       .set_int = [](Config& c, int64_t v) { c.shmem_copy_threads = static_cast<int>(v); },
       .get = [](const Config& c) { return absl::StrCat(c.shmem_copy_threads); }});
  add({.variable = "TENSORVERBS_SHMEM_PEER_COPY",
       .kind = K::kChoice,
       .choices = {"on", "off"},
       .help = "`on`: the same-host fabric shares each write of 512 KiB up to the copy threads' "
               "size with the receiving process's progress thread, which copies part of the "
               "tensor into its own memory while the sender copies the rest (the sender's pool "
               "region the tensor leaves from is then readable, read-only, by that one peer); "
               "`off`: the sender copies alone",
       .set_text = [](Config& c, const std::string& v) { c.shmem_peer_copy = v == "on"; },
       .get = [](const Config& c) { return OnOff(c.shmem_peer_copy); }});
  add({.variable = "TENSORVERBS_OFI_SHARED_ENDPOINT",
       .kind = K::kChoice,
       .choices = {"on", "off"},
       .help = "`on`: a task's channels over libfabric share one libfabric endpoint and "
               "completion queue per fabric, each channel a peer address and its own state "
               "(where the provider carries 8 bytes of CQ data, as shm and tcp;ofi_rxm do); "
               "`off`: each channel opens an endpoint of its own",
       .set_text = [](Config& c, const std::string& v) { c.ofi_shared_endpoint = v == "on"; },
       .get = [](const Config& c) { return OnOff(c.ofi_shared_endpoint); }});
  add({.variable = "TENSORVERBS_CALLBACK_THREADS",
       .kind = K::kInteger,
       .min = 0,
       .max = 256,
       .help = "threads that run receive callbacks; `0` runs each callback inline on the "
               "transport's thread (lowest latency; a callback that blocks then stalls every "
               "transfer)",
       .set_int = [](Config& c, int64_t v) { c.callback_threads = static_cast<int>(v); },
       .get = [](const Config& c) { return absl::StrCat(c.callback_threads); }});
  add({.variable = "TENSORVERBS_INLINE_CALLBACK_US",
       .kind = K::kInteger,
       .min = 0,
       .max = 1000000,
       .help = "grpc+verbs with callback threads: receive callbacks run on the progress thread "
               "(no hand-off between threads) until one keeps it this long; the loop then moves "
               "to a new thread, logs a warning once, and callbacks run on the callback threads "
               "from then on. `0` always uses the callback threads",
       .set_int = [](Config& c, int64_t v) { c.inline_callback_limit = absl::Microseconds(v); },
       .get = [](const Config& c) { return Us(c.inline_callback_limit); }});
  add({.variable = "TENSORVERBS_MALLOC_TUNING",
       .kind = K::kInteger,
       .min = 0,
       .max = 1,
       .help = "`1`: a Server raises glibc's heap trim threshold so large gRPC transfers do not "
               "fault fresh pages every time (4–8× at 64 MiB, see docs/PERFORMANCE.md); `0`: "
               "leave malloc alone",
       .set_int = [](Config& c, int64_t v) { c.malloc_tuning = v == 1; },
       .get = [](const Config& c) { return OneZero(c.malloc_tuning); }});
  add({.variable = "TENSORVERBS_MALLOC_TRIM_MB",
       .kind = K::kInteger,
       .min = 1,
       .max = 2047,
       .help = "with the tuning on, freed heap kept mapped before glibc returns it to the OS",
       .set_int = [](Config& c, int64_t v) { c.malloc_trim_bytes = v << 20; },
       .get = [](const Config& c) { return Mb(c.malloc_trim_bytes); }});
  add({.variable = "TENSORVERBS_OFI_PROVIDER",
       .kind = K::kText,
       .help = "libfabric provider of the ofi backend when the caller names none (`shm`, "
               "`tcp;ofi_rxm`, `verbs;ofi_rxm`, ...)",
       .values = "a provider name",
       .default_note = "first hardware provider, else `tcp;ofi_rxm`",
       .set_text = [](Config& c, const std::string& v) { c.ofi_provider = v; },
       .get = [](const Config& c) { return c.ofi_provider; }});
  add({.variable = "TENSORVERBS_FABRIC",
       .kind = K::kChoice,
       .choices = {"auto", "shmem", "ofi", "ibverbs", "loopback"},
       .help = "`grpc+verbs` fabric: `auto` (per peer: `shmem` for tasks on this host, and for "
               "the others ibverbs where a port is usable, else libfabric; grpc+gdr uses one "
               "fabric for all), `shmem` (processes of one user on one host), `ofi`, `ibverbs`, "
               "`loopback` (servers of one process only)",
       .set_text = [](Config& c, const std::string& v) { c.fabric = v; },
       .get = [](const Config& c) { return c.fabric; }});
  add({.variable = "TENSORVERBS_MESSAGE_SLOTS",
       .kind = K::kInteger,
       .min = 1,
       .max = 1024,
       .help = "control-message slots in flight per channel direction; `1` (with batch `1`) is "
               "the seed's stop-and-wait buffer",
       .set_int = [](Config& c, int64_t v) { c.message_slots = static_cast<int>(v); },
       .get = [](const Config& c) { return absl::StrCat(c.message_slots); }});
  add({.variable = "TENSORVERBS_MESSAGE_BATCH",
       .kind = K::kInteger,
       .min = 1,
       .max = 128,
       .help = "most control messages one slot carries when messages queue behind busy slots; "
               "`1` writes one per slot, as the seed",
       .set_int = [](Config& c, int64_t v) { c.message_batch = static_cast<int>(v); },
       .get = [](const Config& c) { return absl::StrCat(c.message_batch); }});
  add({.variable = "TENSORVERBS_CHANNEL_IDLE_MS",
       .kind = K::kInteger,
       .min = 0,
       .max = 86400000,
       .help = "a channel idle this long gives back its slots, keys and mappings; the next "
               "recv sets it up again; `0`: never",
       .set_int = [](Config& c, int64_t v) { c.channel_idle = absl::Milliseconds(v); },
       .get = [](const Config& c) { return Ms(c.channel_idle); }});
  add({.variable = "TENSORVERBS_POLL_MODE",
       .kind = K::kChoice,
       .choices = {"busy", "blocking", "adaptive"},
       .help = "whoever drives progress: `busy` (always spin), `blocking` (sleep when idle), "
               "`adaptive` (spin for a bound learned from how soon work came after earlier idle "
               "turns, then sleep)",
       .set_text = [](Config& c, const std::string& v) { c.poll_mode = v; },
       .get = [](const Config& c) { return c.poll_mode; }});
  add({.variable = "TENSORVERBS_POLL_SPIN_US",
       .kind = K::kInteger,
       .min = 0,
       .max = 1000000,
       .help = "in `adaptive` mode, how long an idle driver spins before sleeping; while a peer "
               "owes an answer it spins about twice as long as answers have taken, up to 1 ms",
       .set_int = [](Config& c, int64_t v) { c.poll_spin = absl::Microseconds(v); },
       .get = [](const Config& c) { return Us(c.poll_spin); }});
  add({.variable = "TENSORVERBS_WAITER_PROGRESS",
       .kind = K::kInteger,
       .min = 0,
       .max = 1,
       .help = "grpc+verbs: `1` lets a thread that waits for a recv (a blocking recv, a "
               "future's or a torch work's wait) drive the transport itself while nobody else "
               "does; `0` leaves progress to the progress thread alone",
       .set_int = [](Config& c, int64_t v) { c.waiter_progress = v == 1; },
       .get = [](const Config& c) { return OneZero(c.waiter_progress); }});
  add({.variable = "TENSORVERBS_DATA_VALIDATION",
       .kind = K::kInteger,
       .min = 0,
       .max = 1,
       .help = "`1`: the sender's CRC-32C travels with the meta-data and a mismatch fails the "
               "recv with DataLoss",
       .set_int = [](Config& c, int64_t v) { c.data_validation = v == 1; },
       .get = [](const Config& c) { return OneZero(c.data_validation); }});
  add({.variable = "TENSORVERBS_REGISTRATION",
       .kind = K::kChoice,
       .choices = {"pool", "per-transfer", "copy"},
       .help = "`pool` (pool regions registered once), `per-transfer` (each destination and "
               "source pinned per transfer), `copy` (pre-registered staging buffers and a copy "
               "on each side)",
       .set_text = [](Config& c, const std::string& v) { c.registration = v; },
       .get = [](const Config& c) { return c.registration; }});
  add({.variable = "TENSORVERBS_PEER_TIMEOUT_MS",
       .kind = K::kInteger,
       .min = 100,
       .max = 86400000,
       .help = "a peer with pending recvs that does not answer the liveness probe for this long "
               "is declared dead",
       .set_int = [](Config& c, int64_t v) { c.peer_timeout = absl::Milliseconds(v); },
       .get = [](const Config& c) { return Ms(c.peer_timeout); }});
  add({.variable = "TENSORVERBS_SLOW_RECV_MS",
       .kind = K::kInteger,
       .min = 0,
       .max = 86400000,
       .help = "a remote recv still waiting after this long logs one warning naming its key, "
               "step and peer; 0 turns it off",
       .set_int = [](Config& c, int64_t v) { c.slow_recv_warning = absl::Milliseconds(v); },
       .get = [](const Config& c) { return Ms(c.slow_recv_warning); }});
  add({.variable = "TENSORVERBS_STOP_TIMEOUT_MS",
       .kind = K::kInteger,
       .min = 100,
       .max = 86400000,
       .help = "how long `Task::Stop`, and then a task's destructor, each wait for the task to "
               "shut down (a stuck progress thread, a recv callback that never returns); past "
               "it, they log what is stuck and return, and the rest finishes, with the task's "
               "memory, when the stuck call returns",
       .set_int = [](Config& c, int64_t v) { c.stop_timeout = absl::Milliseconds(v); },
       .get = [](const Config& c) { return Ms(c.stop_timeout); }});
  add({.variable = "TENSORVERBS_PUSH",
       .kind = K::kChoice,
       .choices = {"on", "off"},
       .help = "`on`: after a grpc+verbs recv of a key at step s completes, the receiver asks "
               "for the key at step s+1 at once (tensors up to 256 KiB), so that recv needs no "
               "REQUEST round trip; `off`: every recv asks for itself",
       .set_text = [](Config& c, const std::string& v) { c.push = v == "on"; },
       .get = [](const Config& c) { return OnOff(c.push); }});
  add({.variable = "TENSORVERBS_PUSH_MAX",
       .kind = K::kInteger,
       .min = 1,
       .max = 65536,
       .help = "requests a channel may have made ahead of their recvs",
       .set_int = [](Config& c, int64_t v) { c.push_max_destinations = static_cast<int>(v); },
       .get = [](const Config& c) { return absl::StrCat(c.push_max_destinations); }});
  add({.variable = "TENSORVERBS_PUSH_MAX_MB",
       .kind = K::kInteger,
       .min = 1,
       .max = 1048576,
       .help = "bytes of destinations a channel may hold for them, in MiB",
       .set_int = [](Config& c, int64_t v) { c.push_max_bytes = uint64_t(v) << 20; },
       .get = [](const Config& c) { return Mb(c.push_max_bytes); }});
  add({.variable = "TENSORVERBS_TRACE",
       .kind = K::kText,
       .help = "a file to write a trace of every remote recv's phases into (Chrome trace-event "
               "JSON, for ui.perfetto.dev or chrome://tracing); `%p` becomes the process id",
       .values = "a path",
       .set_text = [](Config& c, const std::string& v) { c.trace_file = v; },
       .get = [](const Config& c) { return c.trace_file; }});
  add({.variable = "TENSORVERBS_CUDA_RUNTIME",
       .kind = K::kText,
       .help = "the CUDA runtime library to load at run time (name or path); unset: "
               "`libcudart.so.13`, `.12`, `.so`, then the build's toolkit, and only where the "
               "NVIDIA driver is loaded; set: loaded in any case",
       .values = "a library name or path",
       .set_text = [](Config& c, const std::string& v) { c.cuda_runtime = v; },
       .get = [](const Config& c) { return c.cuda_runtime; }});
  add({.variable = "TENSORVERBS_PIN_POOL",
       .kind = K::kChoice,
       .choices = {"auto", "on", "off"},
       .help = "`auto`: page-lock each task's receive pool with the CUDA runtime when an NVIDIA "
               "driver and a GPU are there (GPU copies then reach it by DMA); `on`: the same, "
               "with a warning when they are not; `off`: never load the CUDA runtime",
       .set_text = [](Config& c, const std::string& v) { c.pin_pool = v; },
       .get = [](const Config& c) { return c.pin_pool; }});
  add({.variable = "TENSORVERBS_GPU_DIRECT",
       .kind = K::kChoice,
       .choices = {"on", "off"},
       .help = "`on`: grpc+verbs over the same-host fabric writes tensors of the tasks' GPU "
               "pools (`Task::DeviceAllocator`) from and into GPU memory directly, by CUDA IPC "
               "and device copies, with no copy through host memory; `off`: GPU tensors take "
               "the proxy path through host memory (two copies), as on the other fabrics",
       .set_text = [](Config& c, const std::string& v) { c.gpu_direct = v == "on"; },
       .get = [](const Config& c) { return OnOff(c.gpu_direct); }});
  add({.variable = "TENSORVERBS_PROXY_CHUNK_KB",
       .kind = K::kInteger,
       .min = 0,
       .max = 1048576,
       .help = "GPU tensors on the proxy path over grpc+verbs move in chunks of this many KiB: "
               "each chunk goes host-to-device as soon as it has landed, while the next is "
               "still on its way; `0` moves them whole, one stage after another",
       .values = "0, or 64..1048576",
       .check = [](int64_t v) -> const char* {
         return v > 0 && v < 64 ? "chunks of the proxy path are at least 64 KiB; set 0 to move "
                                  "GPU tensors whole"
                                : nullptr;
       },
       .set_int = [](Config& c, int64_t v) { c.proxy_chunk_bytes = uint64_t(v) << 10; },
       .get = [](const Config& c) { return absl::StrCat(c.proxy_chunk_bytes >> 10); }});
  add({.variable = "TENSORVERBS_SECRET_FILE",
       .kind = K::kText,
       .help = "a file holding the cluster secret (at least 16 bytes; see Security)",
       .values = "a path",
       .set_text = [](Config& c, const std::string& v) { c.secret_file = v; },
       .get = [](const Config& c) { return c.secret_file; }});
  add({.variable = "TENSORVERBS_TLS_CERT",
       .kind = K::kText,
       .help = "PEM file of this task's certificate, for mutual TLS (with `TENSORVERBS_TLS_KEY` "
               "and `TENSORVERBS_TLS_CA`: all three or none)",
       .values = "a path",
       .set_text = [](Config& c, const std::string& v) { c.tls_cert_file = v; },
       .get = [](const Config& c) { return c.tls_cert_file; }});
  add({.variable = "TENSORVERBS_TLS_KEY",
       .kind = K::kText,
       .help = "PEM file of this task's private key, for mutual TLS",
       .values = "a path",
       .set_text = [](Config& c, const std::string& v) { c.tls_key_file = v; },
       .get = [](const Config& c) { return c.tls_key_file; }});
  add({.variable = "TENSORVERBS_TLS_CA",
       .kind = K::kText,
       .help = "PEM file of the cluster's CA, for mutual TLS",
       .values = "a path",
       .set_text = [](Config& c, const std::string& v) { c.tls_ca_file = v; },
       .get = [](const Config& c) { return c.tls_ca_file; }});
  add({.variable = "TENSORVERBS_SLURM_JOBS",
       .kind = K::kText,
       .help = "with `--cluster-from slurm`: the jobs by rank ranges (`ps:1,worker:3`); read "
               "with the `SLURM_*` variables by the placement parser",
       .values = "`job:count,...`",
       .default_note = "every rank a `worker`"});
  add({.variable = "TENSORVERBS_SLURM_PORT",
       .kind = K::kInteger,
       .min = 1,
       .max = 65535,
       .help = "with `--cluster-from slurm`: the port of each host's first task (the k-th "
               "listens on it + k)",
       .set_int = [](Config& c, int64_t v) { c.slurm_port = static_cast<int>(v); },
       .get = [](const Config& c) { return absl::StrCat(c.slurm_port); }});
  add({.variable = "TENSORVERBS_PROTOCOL",
       .kind = K::kText,
       .help = "the `torch.distributed` backend: the protocol of the tasks it starts",
       .values = "a protocol (`tensorverbs info` lists them)",
       .set_text = [](Config& c, const std::string& v) { c.torch_protocol = v; },
       .get = [](const Config& c) { return c.torch_protocol; }});
  add({.variable = "TENSORVERBS_HOST",
       .kind = K::kText,
       .help = "the `torch.distributed` backend: the address its peers reach this rank at",
       .values = "an address",
       .default_note = "this host's name resolved",
       .set_text = [](Config& c, const std::string& v) { c.torch_host = v; },
       .get = [](const Config& c) { return c.torch_host; }});
  add({.variable = "TENSORVERBS_TORCH_SAME_HOST",
       .kind = K::kChoice,
       .choices = {"1", "0", "on", "off"},
       .help = "the `torch.distributed` backend: `1` reduces through the ranks' shared memory "
               "when every rank runs on this host over `grpc+verbs` and the same-host fabric; "
               "`0` keeps to messages (set it alike on every rank)",
       .set_text = [](Config& c, const std::string& v) {
         c.torch_same_host = v == "1" || v == "on";
       },
       .get = [](const Config& c) { return OneZero(c.torch_same_host); }});
  add({.variable = "TENSORVERBS_CMAKE_BUILD_DIR",
       .kind = K::kText,
       .help = "`pip install`: the CMake build tree whose Python module setup.py packages",
       .values = "a path",
       .default_note = "a build of its own"});

  settings_internal::AddRdmaSettings(s);
  return s;
}

std::string DefaultColumn(const Setting& s) {
  if (s.default_note != nullptr) return s.default_note;
  const std::string value = s.get != nullptr ? s.get(Config::Defaults()) : "";
  if (value.empty()) return "unset";
  return s.kind == SettingKind::kInteger ? value : absl::StrCat("`", value, "`");
}

std::string ValuesColumn(const Setting& s) {
  if (s.values != nullptr) return s.values;
  switch (s.kind) {
    case SettingKind::kInteger:
      return absl::StrCat(s.min, "..", s.max);
    case SettingKind::kChoice: {
      std::vector<std::string> quoted;
      for (const std::string& c : s.choices) quoted.push_back(absl::StrCat("`", c, "`"));
      return absl::StrJoin(quoted, ", ");
    }
    default:
      return "text";
  }
}

}  // namespace

const std::vector<Setting>& Settings() {
  static const std::vector<Setting>* settings = new std::vector<Setting>(MakeSettings());
  return *settings;
}

const Setting* FindSetting(absl::string_view variable) {
  for (const Setting& s : Settings()) {
    if (variable == s.variable || (s.alias != nullptr && variable == s.alias)) return &s;
  }
  return nullptr;
}

std::string SettingsMarkdown(SettingTable table) {
  std::string out = table == SettingTable::kRdma
                        ? "| variable (alias) | meaning | values | default |\n"
                        : "| variable | meaning | values | default |\n";
  absl::StrAppend(&out, "| --- | --- | --- | --- |\n");
  for (const Setting& s : Settings()) {
    if (s.table != table) continue;
    std::string name = absl::StrCat("`", s.variable, "`");
    if (s.alias != nullptr) absl::StrAppend(&name, " (`", s.alias, "`)");
    absl::StrAppend(&out, "| ", name, " | ", s.help, " | ", ValuesColumn(s), " | ",
                    DefaultColumn(s), " |\n");
  }
  return out;
}

}  // namespace tensorverbs
