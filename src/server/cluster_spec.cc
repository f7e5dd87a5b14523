#include "tensorverbs/cluster_spec.h"

#include <ifaddrs.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "src/common/net_address.h"
#include "src/common/status_macros.h"
#include "tensorverbs/device_name.h"

namespace tensorverbs {
namespace {

constexpr char kExpected[] =
    "expected JOB=HOST:PORT[,HOST:PORT...][;JOB=...], e.g. "
    "ps=localhost:2222;worker=localhost:2223,localhost:2224, or JSON "
    "{\"ps\": [\"localhost:2222\"], \"worker\": [\"localhost:2223\"]}";

absl::Status Bad(absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("malformed cluster spec: ", why, "; ", kExpected));
}

}  // namespace

bool AddressIsLocal(absl::string_view address) {
  if (address.rfind(':') == absl::string_view::npos) return false;
  const absl::string_view host = HostOf(address);
  if (host == "localhost" || host == "::1" || absl::StartsWith(host, "127.")) return true;
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) == 0 && host == name) return true;
  // An address of one of this network namespace's interfaces, or a name that resolves to one:
  // the same host as far as a network namespace lets tasks share memory.
  ifaddrs* interfaces = nullptr;
  if (getifaddrs(&interfaces) != 0) return false;
  const bool local = AnyResolvedAddress(host, [&](const sockaddr* a) {
    for (const ifaddrs* i = interfaces; i != nullptr; i = i->ifa_next) {
      if (SameIp(a, i->ifa_addr)) return true;
    }
    return false;
  });
  freeifaddrs(interfaces);
  return local;
}

absl::Status ValidateAddress(absl::string_view address) {
  size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) {
    return absl::InvalidArgumentError(absl::StrCat("address '", address, "' is not HOST:PORT"));
  }
  absl::string_view host = address.substr(0, colon);
  absl::string_view port_text = address.substr(colon + 1);
  if (host.front() == '[' ? host.back() != ']' : host.find(':') != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "address '", address, "' has a malformed host (write IPv6 hosts as [addr]:port)"));
  }
  for (char c : host) {
    if (absl::ascii_isspace(static_cast<unsigned char>(c)) || c == ',' || c == ';' || c == '=') {
      return absl::InvalidArgumentError(
          absl::StrCat("address '", address, "' has a malformed host"));
    }
  }
  int port = 0;
  if (port_text.empty() || !absl::SimpleAtoi(port_text, &port) || port < 1 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("address '", address, "' has port '", port_text, "', not 1..65535"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ClusterSpec> ClusterSpec::FromJobs(
    std::map<std::string, std::vector<std::string>> jobs) {
  if (jobs.empty()) return Bad("no jobs");
  for (const auto& [job, tasks] : jobs) {
    if (!IsValidJobName(job)) {
      return Bad(absl::StrCat("job name '", job, "' is not [A-Za-z][A-Za-z0-9_]*"));
    }
    if (tasks.empty()) return Bad(absl::StrCat("job '", job, "' has no tasks"));
    for (const std::string& addr : tasks) {
      absl::Status s = ValidateAddress(addr);
      if (!s.ok()) return Bad(absl::StrCat("job '", job, "': ", s.message()));
    }
  }
  ClusterSpec spec;
  spec.jobs_ = std::move(jobs);
  return spec;
}

absl::StatusOr<ClusterSpec> ClusterSpec::Parse(absl::string_view text) {
  absl::string_view spec = absl::StripAsciiWhitespace(text);
  if (spec.empty()) return Bad("it is empty");
  if (spec.front() == '{') return FromJson(spec);
  std::map<std::string, std::vector<std::string>> jobs;
  for (absl::string_view part : absl::StrSplit(spec, ';')) {
    part = absl::StripAsciiWhitespace(part);
    if (part.empty()) return Bad("empty job entry (stray ';')");
    size_t eq = part.find('=');
    if (eq == absl::string_view::npos) {
      return Bad(absl::StrCat("job entry '", part, "' has no '='"));
    }
    std::string job(absl::StripAsciiWhitespace(part.substr(0, eq)));
    if (jobs.count(job)) return Bad(absl::StrCat("job '", job, "' appears twice"));
    std::vector<std::string> tasks;
    for (absl::string_view addr : absl::StrSplit(part.substr(eq + 1), ',')) {
      addr = absl::StripAsciiWhitespace(addr);
      if (addr.empty()) return Bad(absl::StrCat("job '", job, "' has an empty address"));
      tasks.emplace_back(addr);
    }
    jobs.emplace(std::move(job), std::move(tasks));
  }
  return FromJobs(std::move(jobs));
}

absl::StatusOr<ClusterSpec> ClusterSpec::FromJson(absl::string_view json_text) {
  nlohmann::json json = nlohmann::json::parse(json_text.begin(), json_text.end(), nullptr,
                                              /*allow_exceptions=*/false);
  if (json.is_discarded()) return Bad("invalid JSON");
  if (!json.is_object()) return Bad("JSON is not an object");
  if (json.contains("cluster")) json = json["cluster"];
  if (!json.is_object()) return Bad("\"cluster\" is not an object");
  std::map<std::string, std::vector<std::string>> jobs;
  for (auto it = json.begin(); it != json.end(); ++it) {
    if (!it.value().is_array()) {
      return Bad(absl::StrCat("job '", it.key(), "' is not a list of addresses"));
    }
    std::vector<std::string> tasks;
    for (const auto& addr : it.value()) {
      if (!addr.is_string())
        return Bad(absl::StrCat("job '", it.key(), "' has a non-string address"));
      tasks.push_back(addr.get<std::string>());
    }
    jobs.emplace(it.key(), std::move(tasks));
  }
  return FromJobs(std::move(jobs));
}

int ClusterSpec::NumTasks(absl::string_view job) const {
  auto it = jobs_.find(std::string(job));
  return it == jobs_.end() ? 0 : static_cast<int>(it->second.size());
}

absl::StatusOr<std::string> ClusterSpec::TaskAddress(absl::string_view job, int task) const {
  auto it = jobs_.find(std::string(job));
  if (it == jobs_.end()) {
    std::vector<std::string> names;
    for (const auto& [name, tasks] : jobs_) names.push_back(name);
    return absl::NotFoundError(absl::StrCat(
        "job '", job, "' is not in the cluster spec (jobs: ", absl::StrJoin(names, ", "), ")"));
  }
  if (task < 0 || task >= static_cast<int>(it->second.size())) {
    return absl::NotFoundError(absl::StrCat("task ", task, " of job '", job,
                                            "' is not in the cluster spec (tasks 0..",
                                            it->second.size() - 1, ")"));
  }
  return it->second[task];
}

absl::flat_hash_map<std::string, std::string> ClusterSpec::TaskAddresses() const {
  absl::flat_hash_map<std::string, std::string> out;
  for (const auto& [job, tasks] : jobs_) {
    for (size_t i = 0; i < tasks.size(); ++i) out[TaskName(job, static_cast<int>(i))] = tasks[i];
  }
  return out;
}

std::string ClusterSpec::ToString() const {
  std::vector<std::string> parts;
  for (const auto& [job, tasks] : jobs_)
    parts.push_back(absl::StrCat(job, "=", absl::StrJoin(tasks, ",")));
  return absl::StrJoin(parts, ";");
}

}  // namespace tensorverbs
