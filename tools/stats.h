// `tensorverbs stats` and metrics files: a task's GetStats answer as a table, JSON, or the
// Prometheus text exposition format.
//
// The formatting functions are pure (any thread). MetricsFileWriter is owned by the server
// command: it starts a thread that rewrites the file every interval (a temporary file renamed
// over it, so a collector never reads half a file), and its destructor writes once more and
// joins it.
#ifndef TENSORVERBS_TOOLS_STATS_H_
#define TENSORVERBS_TOOLS_STATS_H_

#include <functional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/worker.pb.h"
#include "src/common/mutex.h"

namespace tensorverbs::tools {

// A table for people: the task's counters, then one block per channel.
std::string FormatStatsTable(const proto::GetStatsResponse& stats);
// One JSON object: task fields, "counters", and "channels" (each with its "counters").
std::string FormatStatsJson(const proto::GetStatsResponse& stats);
// Prometheus text format: tensorverbs_<counter>{task=...} for the task and
// tensorverbs_channel_<counter>{task=...,peer=...,direction="recv"|"send"} per channel, each
// family with its HELP and TYPE lines.
std::string FormatPrometheus(const proto::GetStatsResponse& stats);

// Asks the task at `address` (host:port) for its stats, within `timeout`. With security
// configured (TENSORVERBS_SECRET_FILE, TENSORVERBS_TLS_*), the call claims to come from task
// `as_task` of the cluster and proves it as that task would.
absl::StatusOr<proto::GetStatsResponse> FetchStats(const std::string& address,
                                                   const std::string& as_task,
                                                   absl::Duration timeout);

// Writes `path` atomically (a sibling temporary file, then rename).
absl::Status WriteFileAtomically(const std::string& path, const std::string& contents);

class MetricsFileWriter {
 public:
  MetricsFileWriter(std::string path, absl::Duration interval,
                    std::function<proto::GetStatsResponse()> collect);
  ~MetricsFileWriter();
  MetricsFileWriter(const MetricsFileWriter&) = delete;
  MetricsFileWriter& operator=(const MetricsFileWriter&) = delete;

  // Writes the file now; the error names the path.
  absl::Status WriteNow();

 private:
  void Loop();

  const std::string path_;
  const absl::Duration interval_;
  const std::function<proto::GetStatsResponse()> collect_;
  Mutex write_mu_;
  Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace tensorverbs::tools

#endif  // TENSORVERBS_TOOLS_STATS_H_
