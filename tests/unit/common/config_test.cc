#include "src/common/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "src/common/logging.h"
#include "src/common/settings.h"

namespace tensorverbs {
namespace {

using ::testing::HasSubstr;

TEST(Config, Defaults) {
  absl::StatusOr<Config> c = Config::FromEnvironment({});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->log_severity, LogSeverity::kWarning);
  EXPECT_EQ(c->recv_timeout, absl::Minutes(10));
  EXPECT_EQ(c->connect_timeout, absl::Seconds(60));
  EXPECT_EQ(c->pool_region_bytes, int64_t{64} << 20);
  EXPECT_EQ(c->callback_threads, 2);
  EXPECT_TRUE(c->malloc_tuning);
  EXPECT_EQ(c->malloc_trim_bytes, int64_t{1024} << 20);
  EXPECT_EQ(c->max_tensor_bytes, uint64_t{4096} << 20);
  EXPECT_TRUE(c->warnings.empty());
}

TEST(Config, ParsesValues) {
  absl::StatusOr<Config> c = Config::FromEnvironment({{"TENSORVERBS_LOG_LEVEL", "debug"},
                                                      {"TENSORVERBS_RECV_TIMEOUT_MS", "1500"},
                                                      {"TENSORVERBS_POOL_REGION_MB", " 8 "},
                                                      {"TENSORVERBS_CALLBACK_THREADS", "4"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->log_severity, LogSeverity::kInfo);
  EXPECT_EQ(c->log_verbosity, 1);
  EXPECT_EQ(c->recv_timeout, absl::Milliseconds(1500));
  EXPECT_EQ(c->pool_region_bytes, int64_t{8} << 20);
  EXPECT_EQ(c->callback_threads, 4);
  EXPECT_EQ(Config::FromEnvironment({{"TENSORVERBS_OFI_PROVIDER", " shm "}})->ofi_provider, "shm");
}

TEST(Config, LogLevels) {
  EXPECT_EQ(Config::FromEnvironment({{"TENSORVERBS_LOG_LEVEL", "ERROR"}})->log_severity,
            LogSeverity::kError);
  EXPECT_EQ(Config::FromEnvironment({{"TENSORVERBS_LOG_LEVEL", "info"}})->log_severity,
            LogSeverity::kInfo);
  EXPECT_EQ(Config::FromEnvironment({{"TENSORVERBS_LOG_LEVEL", "3"}})->log_verbosity, 3);
  absl::StatusOr<Config> bad = Config::FromEnvironment({{"TENSORVERBS_LOG_LEVEL", "loud"}});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("TENSORVERBS_LOG_LEVEL"));
}

TEST(Config, OutOfRangeNamesVariableAndRange) {
  for (const char* value : {"0", "-5", "abc", "1e3", "99999999999"}) {
    absl::StatusOr<Config> c = Config::FromEnvironment({{"TENSORVERBS_RECV_TIMEOUT_MS", value}});
    ASSERT_FALSE(c.ok()) << value;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(c.status().message(), HasSubstr("TENSORVERBS_RECV_TIMEOUT_MS"));
    EXPECT_THAT(c.status().message(), HasSubstr("[1, 86400000]"));
  }
  EXPECT_FALSE(Config::FromEnvironment({{"TENSORVERBS_CALLBACK_THREADS", "-1"}}).ok());
  EXPECT_EQ(Config::FromEnvironment({{"TENSORVERBS_CALLBACK_THREADS", "0"}})->callback_threads, 0)
      << "0 runs callbacks inline";
  EXPECT_EQ(Config::Defaults().inline_callback_limit, absl::Milliseconds(1));
  EXPECT_EQ(
      Config::FromEnvironment({{"TENSORVERBS_INLINE_CALLBACK_US", "0"}})->inline_callback_limit,
      absl::ZeroDuration())
      << "0 always hands callbacks to the callback threads";
  for (const char* value : {"-1", "1000001", "1ms"}) {
    absl::StatusOr<Config> c = Config::FromEnvironment({{"TENSORVERBS_INLINE_CALLBACK_US", value}});
    ASSERT_FALSE(c.ok()) << value;
    EXPECT_THAT(c.status().message(), HasSubstr("TENSORVERBS_INLINE_CALLBACK_US"));
  }
  EXPECT_TRUE(Config::Defaults().waiter_progress);
  EXPECT_FALSE(Config::FromEnvironment({{"TENSORVERBS_WAITER_PROGRESS", "0"}})->waiter_progress)
      << "0 leaves progress to the progress thread";
  for (const char* value : {"2", "-1", "yes"}) {
    absl::StatusOr<Config> c = Config::FromEnvironment({{"TENSORVERBS_WAITER_PROGRESS", value}});
    ASSERT_FALSE(c.ok()) << value;
    EXPECT_THAT(c.status().message(), HasSubstr("TENSORVERBS_WAITER_PROGRESS"));
  }
  EXPECT_FALSE(Config::FromEnvironment({{"TENSORVERBS_POOL_REGION_MB", "65537"}}).ok());
  EXPECT_FALSE(Config::FromEnvironment({{"TENSORVERBS_MALLOC_TUNING", "2"}}).ok());
  EXPECT_FALSE(Config::FromEnvironment({{"TENSORVERBS_MALLOC_TRIM_MB", "4096"}}).ok());
  EXPECT_FALSE(Config::FromEnvironment({{"TENSORVERBS_MALLOC_TUNING", "0"}})->malloc_tuning);
  // Security files: taken as given (read by the server), TLS all three or none.
  absl::StatusOr<Config> secured =
      Config::FromEnvironment({{"TENSORVERBS_SECRET_FILE", " /etc/tv/secret\n"},
                               {"TENSORVERBS_TLS_CERT", "c.pem"},
                               {"TENSORVERBS_TLS_KEY", "k.pem"},
                               {"TENSORVERBS_TLS_CA", "ca.pem"}});
  ASSERT_TRUE(secured.ok()) << secured.status();
  EXPECT_EQ(secured->secret_file, "/etc/tv/secret");
  EXPECT_EQ(secured->tls_ca_file, "ca.pem");
  EXPECT_TRUE(secured->warnings.empty());
  absl::StatusOr<Config> half = Config::FromEnvironment({{"TENSORVERBS_TLS_CERT", "c.pem"}});
  EXPECT_EQ(half.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(half.status().message(), HasSubstr("TENSORVERBS_TLS_KEY"));
  EXPECT_EQ(Config::FromEnvironment({{"TENSORVERBS_MAX_TENSOR_MB", "1"}})->max_tensor_bytes,
            uint64_t{1} << 20);
  EXPECT_EQ(Config::FromEnvironment({{"TENSORVERBS_MAX_TENSOR_MB", "1048576"}})->max_tensor_bytes,
            uint64_t{1} << 40);
  for (const char* value : {"0", "1048577", "-1", "4G"}) {
    absl::StatusOr<Config> c = Config::FromEnvironment({{"TENSORVERBS_MAX_TENSOR_MB", value}});
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << value;
    EXPECT_THAT(c.status().message(), HasSubstr("TENSORVERBS_MAX_TENSOR_MB"));
  }
}

TEST(Config, UnknownVariableIsWarned) {
  absl::StatusOr<Config> c =
      Config::FromEnvironment({{"TENSORVERBS_RECV_TIMEOUT", "5"}, {"RDMA_DEVICE", "mlx5_0"}});
  ASSERT_TRUE(c.ok());
  ASSERT_EQ(c->warnings.size(), 1u);
  EXPECT_THAT(c->warnings[0], HasSubstr("TENSORVERBS_RECV_TIMEOUT"));
  EXPECT_THAT(c->warnings[0], HasSubstr("TENSORVERBS_RECV_TIMEOUT_MS"));
}

TEST(Config, RdmaDefaultsAreTheSeeds) {
  const RdmaConfig r = Config::FromEnvironment({})->rdma;
  EXPECT_EQ(r.device, "");
  EXPECT_EQ(r.port, 0);
  EXPECT_EQ(r.gid_index, -1);
  EXPECT_EQ(r.pkey_index, 0);
  EXPECT_EQ(r.queue_depth, 1024);
  EXPECT_EQ(r.timeout, 14);
  EXPECT_EQ(r.retry_count, 7);
  EXPECT_EQ(r.sl, 0);
  EXPECT_EQ(r.mtu, 0) << "the port's active MTU";
  EXPECT_EQ(r.traffic_class, 0);
}

TEST(Config, RdmaReadmeNamesAndTensorFlowAliases) {
  absl::StatusOr<Config> c = Config::FromEnvironment({{"RDMA_DEVICE", "mlx5_1"},
                                                      {"RDMA_DEVICE_PORT", "2"},
                                                      {"RDMA_GID_INDEX", "3"},
                                                      {"RDMA_QP_PKEY_INDEX", "1"},
                                                      {"RDMA_QUEUE_DEPTH", "256"},
                                                      {"RDMA_TIMEOUT", "20"},
                                                      {"RDMA_RETRY_CNT", "5"},
                                                      {"RDMA_SL", "3"},
                                                      {"RDMA_MTU", "2048"},
                                                      {"RDMA_TRAFFIC_CLASS", "106"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rdma.device, "mlx5_1");
  EXPECT_EQ(c->rdma.port, 2);
  EXPECT_EQ(c->rdma.gid_index, 3);
  EXPECT_EQ(c->rdma.pkey_index, 1);
  EXPECT_EQ(c->rdma.queue_depth, 256);
  EXPECT_EQ(c->rdma.timeout, 20);
  EXPECT_EQ(c->rdma.retry_count, 5);
  EXPECT_EQ(c->rdma.sl, 3);
  EXPECT_EQ(c->rdma.mtu, 2048);
  EXPECT_EQ(c->rdma.traffic_class, 106);
  // Both spellings with the same value are fine; different values are an error.
  EXPECT_TRUE(Config::FromEnvironment({{"RDMA_QP_SL", "2"}, {"RDMA_SL", "2"}}).ok());
  absl::StatusOr<Config> both = Config::FromEnvironment({{"RDMA_QP_SL", "2"}, {"RDMA_SL", "3"}});
  EXPECT_EQ(both.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(both.status().message(), HasSubstr("RDMA_QP_SL"));
  EXPECT_THAT(both.status().message(), HasSubstr("RDMA_SL"));
}

TEST(Config, RdmaOutOfRangeNamesTheVariableAndRange) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"RDMA_DEVICE_PORT", "0"},     {"RDMA_GID_INDEX", "256"}, {"RDMA_QP_PKEY_INDEX", "-1"},
      {"RDMA_QP_QUEUE_DEPTH", "0"},  {"RDMA_QP_TIMEOUT", "32"}, {"RDMA_QP_RETRY_COUNT", "8"},
      {"RDMA_QP_SL", "8"},           {"RDMA_QP_MTU", "1500"},   {"RDMA_QP_MTU", "8192"},
      {"RDMA_TRAFFIC_CLASS", "256"}, {"RDMA_RETRY_CNT", "x"},
  };
  for (const auto& [name, value] : bad) {
    absl::StatusOr<Config> c = Config::FromEnvironment({{name, value}});
    ASSERT_FALSE(c.ok()) << name << "=" << value;
    EXPECT_THAT(c.status().message(), HasSubstr(name == "RDMA_QP_MTU" ? "RDMA_QP_MTU" : name));
  }
  EXPECT_TRUE(Config::FromEnvironment({{"RDMA_QP_MTU", "4096"}}).ok());
}

// fuzz/corpus/config/regression-rdma-variable: a refusal names the RDMA_ variable it refuses,
// not a TENSORVERBS_ one (the fuzzer's check had assumed the prefix).
TEST(Config, ARefusedRdmaValueNamesItsOwnVariable) {
  absl::StatusOr<Config> c = Config::FromEnvironment({{"TENSORVERBS_RECV_TIMEOUT_MS", "600000"},
                                                      {"TENSORVERBS_POOL_REGION_MB", "64"},
                                                      {"TENSORVERBS_MADE_UP", "-"},
                                                      {"RDMA_GID_INDEX", "01\x13x0"}});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("RDMA_GID_INDEX"));
}

TEST(Config, GrpcVerbsVariables) {
  absl::StatusOr<Config> d = Config::FromEnvironment({});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->fabric, "auto");
  EXPECT_EQ(d->message_slots, 8);
  EXPECT_EQ(d->message_batch, 32);
  EXPECT_EQ(d->poll_mode, "adaptive");
  EXPECT_FALSE(d->data_validation);
  EXPECT_EQ(d->registration, "pool");
  EXPECT_EQ(d->peer_timeout, absl::Seconds(10));

  absl::StatusOr<Config> c = Config::FromEnvironment({{"TENSORVERBS_FABRIC", "OFI"},
                                                      {"TENSORVERBS_MESSAGE_SLOTS", "1"},
                                                      {"TENSORVERBS_MESSAGE_BATCH", "1"},
                                                      {"TENSORVERBS_POLL_MODE", "busy"},
                                                      {"TENSORVERBS_POLL_SPIN_US", "0"},
                                                      {"TENSORVERBS_DATA_VALIDATION", "1"},
                                                      {"TENSORVERBS_REGISTRATION", "per-transfer"},
                                                      {"TENSORVERBS_PEER_TIMEOUT_MS", "250"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->fabric, "ofi");
  EXPECT_EQ(c->message_slots, 1);
  EXPECT_EQ(c->message_batch, 1);
  EXPECT_EQ(c->poll_mode, "busy");
  EXPECT_EQ(c->poll_spin, absl::ZeroDuration());
  EXPECT_TRUE(c->data_validation);
  EXPECT_EQ(c->registration, "per-transfer");
  EXPECT_EQ(c->peer_timeout, absl::Milliseconds(250));
  EXPECT_TRUE(c->warnings.empty());

  absl::StatusOr<Config> bad = Config::FromEnvironment({{"TENSORVERBS_REGISTRATION", "pinned"}});
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              testing::AllOf(testing::HasSubstr("TENSORVERBS_REGISTRATION"),
                             testing::HasSubstr("pool, per-transfer, copy")));
  EXPECT_FALSE(Config::FromEnvironment({{"TENSORVERBS_MESSAGE_SLOTS", "0"}}).ok());
  EXPECT_FALSE(Config::FromEnvironment({{"TENSORVERBS_MESSAGE_SLOTS", "1025"}}).ok());
  EXPECT_FALSE(Config::FromEnvironment({{"TENSORVERBS_MESSAGE_BATCH", "0"}}).ok());
  EXPECT_FALSE(Config::FromEnvironment({{"TENSORVERBS_MESSAGE_BATCH", "129"}}).ok());
  EXPECT_FALSE(Config::FromEnvironment({{"TENSORVERBS_FABRIC", "rdma"}}).ok());
  EXPECT_FALSE(Config::FromEnvironment({{"TENSORVERBS_PEER_TIMEOUT_MS", "10"}}).ok());
}

TEST(Config, ShmemCopyThreads) {
  EXPECT_EQ(Config::FromEnvironment({})->shmem_copy_threads, 1);
  absl::StatusOr<Config> off = Config::FromEnvironment({{"TENSORVERBS_SHMEM_COPY_THREADS", "0"}});
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_EQ(off->shmem_copy_threads, 0);
  EXPECT_TRUE(off->warnings.empty()) << "a known variable";
  for (const char* value : {"-1", "65", "two"}) {
    absl::StatusOr<Config> bad =
        Config::FromEnvironment({{"TENSORVERBS_SHMEM_COPY_THREADS", value}});
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << value;
    EXPECT_THAT(bad.status().message(), HasSubstr("TENSORVERBS_SHMEM_COPY_THREADS"));
    EXPECT_THAT(bad.status().message(), HasSubstr("[0, 64]"));
  }
}

TEST(Config, ShmemPeerCopy) {
  EXPECT_TRUE(Config::FromEnvironment({})->shmem_peer_copy);
  absl::StatusOr<Config> off = Config::FromEnvironment({{"TENSORVERBS_SHMEM_PEER_COPY", "off"}});
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_FALSE(off->shmem_peer_copy);
  EXPECT_TRUE(off->warnings.empty()) << "a known variable";
  absl::StatusOr<Config> bad = Config::FromEnvironment({{"TENSORVERBS_SHMEM_PEER_COPY", "0"}});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("TENSORVERBS_SHMEM_PEER_COPY"));
}

TEST(Config, PeerStateBounds) {
  absl::StatusOr<Config> d = Config::FromEnvironment({});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->max_responses, 65536);
  EXPECT_EQ(d->max_pending_recvs, 65536);
  absl::StatusOr<Config> c = Config::FromEnvironment(
      {{"TENSORVERBS_MAX_RESPONSES", "1"}, {"TENSORVERBS_MAX_PENDING_RECVS", "1048576"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_responses, 1);
  EXPECT_EQ(c->max_pending_recvs, 1048576);
  EXPECT_TRUE(c->warnings.empty()) << "both are known variables";
  for (const char* name : {"TENSORVERBS_MAX_RESPONSES", "TENSORVERBS_MAX_PENDING_RECVS"}) {
    for (const char* value : {"0", "1048577", "-1", "many"}) {
      absl::StatusOr<Config> bad = Config::FromEnvironment({{name, value}});
      EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << name << "=" << value;
      EXPECT_THAT(bad.status().message(), HasSubstr(name));
      EXPECT_THAT(bad.status().message(), HasSubstr("[1, 1048576]"));
    }
  }
}

}  // namespace
TEST(Config, SlowRecvWarning) {
  absl::StatusOr<Config> d = Config::FromEnvironment({});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->slow_recv_warning, absl::Seconds(60));
  absl::StatusOr<Config> off = Config::FromEnvironment({{"TENSORVERBS_SLOW_RECV_MS", "0"}});
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_EQ(off->slow_recv_warning, absl::ZeroDuration());
  EXPECT_TRUE(off->warnings.empty()) << "a known variable";
  for (const char* value : {"-1", "86400001", "soon"}) {
    absl::StatusOr<Config> bad = Config::FromEnvironment({{"TENSORVERBS_SLOW_RECV_MS", value}});
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << value;
    EXPECT_THAT(bad.status().message(), HasSubstr("TENSORVERBS_SLOW_RECV_MS"));
  }
}

TEST(Config, TraceCudaRuntimeAndPoolPinning) {
  absl::StatusOr<Config> d = Config::FromEnvironment({});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->trace_file, "");
  EXPECT_EQ(d->cuda_runtime, "");
  EXPECT_EQ(d->pin_pool, "auto");
  absl::StatusOr<Config> set =
      Config::FromEnvironment({{"TENSORVERBS_TRACE", " t-%p.json "},
                               {"TENSORVERBS_CUDA_RUNTIME", "/opt/cuda/lib64/libcudart.so.13"},
                               {"TENSORVERBS_PIN_POOL", "off"}});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->trace_file, "t-%p.json");
  EXPECT_EQ(set->cuda_runtime, "/opt/cuda/lib64/libcudart.so.13");
  EXPECT_EQ(set->pin_pool, "off");
  EXPECT_TRUE(set->warnings.empty()) << "known variables";
  absl::StatusOr<Config> bad = Config::FromEnvironment({{"TENSORVERBS_PIN_POOL", "sometimes"}});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("TENSORVERBS_PIN_POOL"));
}

TEST(Config, ProxyChunks) {
  EXPECT_EQ(Config::FromEnvironment({})->proxy_chunk_bytes, uint64_t{4} << 20);
  EXPECT_EQ(Config::FromEnvironment({{"TENSORVERBS_PROXY_CHUNK_KB", "0"}})->proxy_chunk_bytes, 0u)
      << "whole tensors";
  EXPECT_EQ(Config::FromEnvironment({{"TENSORVERBS_PROXY_CHUNK_KB", "64"}})->proxy_chunk_bytes,
            uint64_t{64} << 10);
  EXPECT_EQ(Config::FromEnvironment({{"TENSORVERBS_PROXY_CHUNK_KB", "1048576"}})->proxy_chunk_bytes,
            uint64_t{1} << 30);
  for (const char* value : {"1", "63", "1048577", "-1", "4M"}) {
    absl::StatusOr<Config> c = Config::FromEnvironment({{"TENSORVERBS_PROXY_CHUNK_KB", value}});
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << value;
    EXPECT_THAT(c.status().message(), HasSubstr("TENSORVERBS_PROXY_CHUNK_KB")) << value;
  }
  EXPECT_THAT(Config::FromEnvironment({{"TENSORVERBS_PROXY_CHUNK_KB", "8"}}).status().message(),
              HasSubstr("at least 64 KiB"));
}

// The settings table is what Config parses, lists and documents: each row must read back the
// value it stores, refuse what lies outside its range, and appear once in the README's tables.
TEST(Settings, EveryRowStoresWhatItReadsBack) {
  for (const Setting& s : Settings()) {
    if (s.get == nullptr) continue;
    std::string value = s.get(Config::Defaults());
    if (s.kind == SettingKind::kInteger && s.default_note != nullptr) value = absl::StrCat(s.max);
    if (s.kind == SettingKind::kText) value = "some text";
    if (s.kind == SettingKind::kChoice) value = s.choices.front();
    if (value.empty()) continue;
    std::map<std::string, std::string> env = {{s.variable, value}};
    if (absl::StartsWith(s.variable, "TENSORVERBS_TLS_")) {  // all three or none
      env = {{"TENSORVERBS_TLS_CERT", value}, {"TENSORVERBS_TLS_KEY", value},
             {"TENSORVERBS_TLS_CA", value}};
    }
    absl::StatusOr<Config> c = Config::FromEnvironment(env);
    ASSERT_TRUE(c.ok()) << s.variable << "=" << value << ": " << c.status();
    EXPECT_EQ(s.get(*c), value) << s.variable;
    EXPECT_TRUE(c->warnings.empty()) << s.variable;
  }
}

TEST(Settings, EveryIntegerRowRefusesOneBeyondItsRange) {
  for (const Setting& s : Settings()) {
    if (s.kind != SettingKind::kInteger || s.set_int == nullptr) continue;
    for (int64_t v : {s.min - 1, s.max + 1}) {
      absl::StatusOr<Config> c = Config::FromEnvironment({{s.variable, absl::StrCat(v)}});
      ASSERT_FALSE(c.ok()) << s.variable << "=" << v;
      EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(c.status().message(), HasSubstr(s.variable));
      EXPECT_THAT(c.status().message(), HasSubstr(absl::StrCat("[", s.min, ", ", s.max, "]")));
    }
  }
}

TEST(Settings, ChoiceRowsNameTheirChoices) {
  for (const Setting& s : Settings()) {
    if (s.kind != SettingKind::kChoice) continue;
    absl::StatusOr<Config> c = Config::FromEnvironment({{s.variable, "no-such-choice"}});
    ASSERT_FALSE(c.ok()) << s.variable;
    EXPECT_THAT(c.status().message(), HasSubstr(s.variable));
    EXPECT_THAT(c.status().message(), HasSubstr(s.choices.front()));
    // Case does not matter.
    std::string upper = s.choices.front();
    for (char& ch : upper) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    EXPECT_TRUE(Config::FromEnvironment({{s.variable, upper}}).ok()) << s.variable;
  }
}

TEST(Settings, EachVariableIsKnownAndListedOnce) {
  std::set<std::string> seen;
  for (const Setting& s : Settings()) {
    EXPECT_TRUE(seen.insert(s.variable).second) << s.variable << " twice";
    EXPECT_EQ(FindSetting(s.variable), &s);
    if (s.alias != nullptr) {
      EXPECT_EQ(FindSetting(s.alias), &s);
    }
    const std::string table = SettingsMarkdown(s.table);
    const std::string row = absl::StrCat("| `", s.variable, "`");
    ASSERT_NE(table.find(row), std::string::npos) << s.variable;
    EXPECT_EQ(table.find(row), table.rfind(row)) << s.variable;
  }
  EXPECT_EQ(FindSetting("TENSORVERBS_NO_SUCH"), nullptr);
  const std::vector<std::string>& known = Config::KnownVariables();
  EXPECT_NE(std::find(known.begin(), known.end(), "RDMA_PKEY"), known.end());
}

TEST(Settings, TheTorchBackendsAndSlurmsVariables) {
  absl::StatusOr<Config> d = Config::FromEnvironment({});
  EXPECT_EQ(d->torch_protocol, "grpc+verbs");
  EXPECT_EQ(d->torch_host, "");
  EXPECT_TRUE(d->torch_same_host);
  EXPECT_EQ(d->slurm_port, 8888);
  absl::StatusOr<Config> c = Config::FromEnvironment({{"TENSORVERBS_PROTOCOL", " grpc "},
                                                      {"TENSORVERBS_HOST", "10.0.0.7"},
                                                      {"TENSORVERBS_TORCH_SAME_HOST", "0"},
                                                      {"TENSORVERBS_SLURM_PORT", "9000"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->torch_protocol, "grpc");
  EXPECT_EQ(c->torch_host, "10.0.0.7");
  EXPECT_FALSE(c->torch_same_host);
  EXPECT_EQ(c->slurm_port, 9000);
  EXPECT_FALSE(Config::FromEnvironment({{"TENSORVERBS_TORCH_SAME_HOST", "off"}})->torch_same_host);
  EXPECT_TRUE(Config::FromEnvironment({{"TENSORVERBS_TORCH_SAME_HOST", "ON"}})->torch_same_host);
  absl::StatusOr<Config> bad = Config::FromEnvironment({{"TENSORVERBS_TORCH_SAME_HOST", "yes"}});
  EXPECT_THAT(bad.status().message(), HasSubstr("TENSORVERBS_TORCH_SAME_HOST"));
}

// `VAR= command` sets VAR to nothing, which means "unset" here as in most tools: an empty
// protocol or port must not replace the default, and a blank alias does not disagree.
TEST(Settings, AVariableSetToNothingIsUnset) {
  absl::StatusOr<Config> c = Config::FromEnvironment({{"TENSORVERBS_PROTOCOL", ""},
                                                      {"TENSORVERBS_SLURM_PORT", " "},
                                                      {"TENSORVERBS_RECV_TIMEOUT_MS", ""},
                                                      {"RDMA_QP_SL", "3"},
                                                      {"RDMA_SL", ""}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->torch_protocol, "grpc+verbs");
  EXPECT_EQ(c->slurm_port, 8888);
  EXPECT_EQ(c->recv_timeout, Config::Defaults().recv_timeout);
  EXPECT_EQ(c->rdma.sl, 3);
}

}  // namespace tensorverbs
