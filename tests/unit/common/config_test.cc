#include "src/common/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "src/common/logging.h"

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
  EXPECT_FALSE(Config::FromEnvironment({{"TENSORVERBS_CALLBACK_THREADS", "0"}}).ok());
  EXPECT_FALSE(Config::FromEnvironment({{"TENSORVERBS_POOL_REGION_MB", "65537"}}).ok());
  EXPECT_FALSE(Config::FromEnvironment({{"TENSORVERBS_MALLOC_TUNING", "2"}}).ok());
  EXPECT_FALSE(Config::FromEnvironment({{"TENSORVERBS_MALLOC_TRIM_MB", "4096"}}).ok());
  EXPECT_FALSE(Config::FromEnvironment({{"TENSORVERBS_MALLOC_TUNING", "0"}})->malloc_tuning);
}

TEST(Config, UnknownVariableIsWarned) {
  absl::StatusOr<Config> c = Config::FromEnvironment(
      {{"TENSORVERBS_RECV_TIMEOUT", "5"}, {"RDMA_DEVICE", "mlx5_0"}});
  ASSERT_TRUE(c.ok());
  ASSERT_EQ(c->warnings.size(), 1u);
  EXPECT_THAT(c->warnings[0], HasSubstr("TENSORVERBS_RECV_TIMEOUT"));
  EXPECT_THAT(c->warnings[0], HasSubstr("TENSORVERBS_RECV_TIMEOUT_MS"));
}

}  // namespace
}  // namespace tensorverbs
