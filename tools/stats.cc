#include "tools/stats.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "proto/worker.grpc.pb.h"
#include "src/common/config.h"
#include "src/common/counters.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"
#include "src/rpc/grpc_util.h"
#include "src/rpc/security.h"
#include "src/server/server.h"

namespace tensorverbs::tools {
namespace {

// What a counter means, and whether it is a gauge (a value now) rather than a running total:
// the catalog's entry, or a plain total for a name this version does not know (a newer
// peer's).
CounterInfo MeaningOf(absl::string_view name) {
  const CounterInfo* info = FindCounter(name);
  if (info != nullptr) return *info;
  return {.name = "", .help = "tensorverbs counter", .gauge = false};
}

// Prometheus label values escape backslash, double quote and newline.
std::string LabelValue(const std::string& v) {
  return absl::StrReplaceAll(v, {{"\\", "\\\\"}, {"\"", "\\\""}, {"\n", "\\n"}});
}

// Counters in a stable order: by name.
std::vector<std::pair<std::string, int64_t>> Ordered(
    const google::protobuf::Map<std::string, int64_t>& counters) {
  std::vector<std::pair<std::string, int64_t>> out(counters.begin(), counters.end());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

std::string FormatStatsTable(const proto::GetStatsResponse& stats) {
  std::string out = absl::StrFormat(
      "task %s  protocol %s%s  incarnation %016x  up %s\n", stats.task_name(), stats.protocol(),
      stats.fabric().empty() ? "" : absl::StrCat(" over ", stats.fabric()), stats.incarnation(),
      absl::FormatDuration(absl::Milliseconds(stats.uptime_ms())));
  for (const auto& [name, value] : Ordered(stats.counters())) {
    absl::StrAppendFormat(&out, "  %-26s %16d\n", name, value);
  }
  for (const proto::ChannelStats& c : stats.channels()) {
    absl::StrAppendFormat(&out, "channel %s %s (%s, %s)\n", c.receives() ? "from" : "to",
                          c.peer_task(), c.state(), c.fabric());
    for (const auto& [name, value] : Ordered(c.counters())) {
      absl::StrAppendFormat(&out, "  %-26s %16d\n", name, value);
    }
  }
  return out;
}

std::string FormatStatsJson(const proto::GetStatsResponse& stats) {
  nlohmann::ordered_json j;
  j["task"] = stats.task_name();
  j["protocol"] = stats.protocol();
  j["fabric"] = stats.fabric();
  j["incarnation"] = absl::StrFormat("%016x", stats.incarnation());
  j["uptime_ms"] = stats.uptime_ms();
  j["counters"] = nlohmann::ordered_json::object();
  for (const auto& [name, value] : Ordered(stats.counters())) j["counters"][name] = value;
  j["channels"] = nlohmann::ordered_json::array();
  for (const proto::ChannelStats& c : stats.channels()) {
    nlohmann::ordered_json cj;
    cj["peer"] = c.peer_task();
    cj["direction"] = c.receives() ? "recv" : "send";
    cj["state"] = c.state();
    cj["fabric"] = c.fabric();
    cj["description"] = c.description();
    cj["counters"] = nlohmann::ordered_json::object();
    for (const auto& [name, value] : Ordered(c.counters())) cj["counters"][name] = value;
    j["channels"].push_back(std::move(cj));
  }
  return j.dump(2) + "\n";
}

std::string FormatPrometheus(const proto::GetStatsResponse& stats) {
  // Families, each with its samples, so every family's HELP and TYPE come once before them.
  struct Family {
    CounterInfo meaning;
    std::vector<std::string> samples;
  };
  std::map<std::string, Family> families;
  const std::string task = absl::StrCat("task=\"", LabelValue(stats.task_name()), "\"");
  auto add = [&](const std::string& prefix, std::string name, int64_t value, std::string labels) {
    // recv_errors_<code> (a channel's failed recvs by status code) is one family, by label.
    constexpr absl::string_view kByCode = "recv_errors_";
    if (absl::StartsWith(name, kByCode)) {
      absl::StrAppend(&labels, ",code=\"", LabelValue(name.substr(kByCode.size())), "\"");
      name = "recv_errors_by_code";
    }
    const CounterInfo meaning = MeaningOf(name);
    const std::string family = absl::StrCat(prefix, name, meaning.gauge ? "" : "_total");
    Family& f = families[family];
    f.meaning = meaning;
    f.samples.push_back(absl::StrCat(family, "{", labels, "} ", value));
  };
  for (const auto& [name, value] : Ordered(stats.counters())) {
    add("tensorverbs_", name, value, task);
  }
  for (const proto::ChannelStats& c : stats.channels()) {
    const std::string labels =
        absl::StrCat(task, ",peer=\"", LabelValue(c.peer_task()), "\",direction=\"",
                     c.receives() ? "recv" : "send", "\"");
    for (const auto& [name, value] : Ordered(c.counters())) {
      add("tensorverbs_channel_", name, value, labels);
    }
  }
  std::string out;
  for (const auto& [family, f] : families) {
    absl::StrAppend(&out, "# HELP ", family, " ", f.meaning.help, "\n", "# TYPE ", family, " ",
                    f.meaning.gauge ? "gauge" : "counter", "\n");
    for (const std::string& sample : f.samples) absl::StrAppend(&out, sample, "\n");
  }
  absl::StrAppend(&out, "# HELP tensorverbs_up_seconds Seconds since the task started\n",
                  "# TYPE tensorverbs_up_seconds gauge\n", "tensorverbs_up_seconds{", task, "} ",
                  absl::StrFormat("%.3f", stats.uptime_ms() / 1000.0), "\n");
  return out;
}

absl::StatusOr<proto::GetStatsResponse> FetchStats(const std::string& address,
                                                   const std::string& as_task,
                                                   absl::Duration timeout) {
  RETURN_IF_ERROR(ValidateAddress(address));
  const rpc::SecurityOptions options = ServerOptions::FromConfig(Config::Get()).security;
  std::shared_ptr<const rpc::RpcSecurity> security = rpc::RpcSecurity::Insecure();
  if (options.enabled()) {
    if (as_task.empty()) {
      return absl::InvalidArgumentError(
          "security is configured (TENSORVERBS_SECRET_FILE / TENSORVERBS_TLS_*): name the task "
          "of the cluster whose credentials this call presents with --as /job:J/replica:0/task:T");
    }
    ASSIGN_OR_RETURN(security, rpc::RpcSecurity::Create(options, as_task, {{as_task, address}}));
  }
  auto stub =
      proto::WorkerService::NewStub(security->NewChannel(address, grpc::ChannelArguments()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  proto::GetStatsResponse response;
  grpc::Status s = stub->GetStats(&context, proto::GetStatsRequest(), &response);
  if (!s.ok()) {
    absl::Status status = rpc::FromGrpcStatus(s);
    return absl::Status(status.code(),
                        absl::StrCat("GetStats to ", address, ": ", status.message()));
  }
  return response;
}

absl::Status WriteFileAtomically(const std::string& path, const std::string& contents) {
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << contents;
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      return absl::UnavailableError(absl::StrCat("cannot write the metrics file ", tmp,
                                                 ": check that its folder exists and is writable"));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

MetricsFileWriter::MetricsFileWriter(std::string path, absl::Duration interval,
                                     std::function<proto::GetStatsResponse()> collect)
    : path_(std::move(path)), interval_(interval), collect_(std::move(collect)) {
  thread_ = std::thread([this] { Loop(); });
}

MetricsFileWriter::~MetricsFileWriter() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
  (void)WriteNow();  // the last figures, for a collector that reads after the task ended
}

absl::Status MetricsFileWriter::WriteNow() {
  MutexLock lock(&write_mu_);  // one temporary file at a time
  return WriteFileAtomically(path_, FormatPrometheus(collect_()));
}

void MetricsFileWriter::Loop() {
  bool warned = false;
  while (true) {
    if (absl::Status s = WriteNow(); !s.ok() && !warned) {
      LOG(WARNING) << s.message();  // once: the folder may come later
      warned = true;
    }
    MutexLock lock(&mu_);
    if (mu_.AwaitWithTimeout([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; },
                             interval_)) {
      return;
    }
  }
}

}  // namespace tensorverbs::tools
