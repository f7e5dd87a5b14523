#include "tensorverbs/placement.h"

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "src/common/config.h"
#include "src/common/status_macros.h"

namespace tensorverbs {
namespace {

// Bounds what a host list or a count may expand to: a typo must not allocate without end.
constexpr int64_t kMaxTasks = 1 << 20;

absl::Status Bad(absl::string_view variable, absl::string_view value, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(variable, "='", value, "': ", why));
}

// Splits at commas outside brackets: "a[1,2],b" -> "a[1,2]", "b".
std::vector<absl::string_view> SplitTopLevel(absl::string_view list) {
  std::vector<absl::string_view> parts;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i] == '[') ++depth;
    if (list[i] == ']') --depth;
    if (list[i] == ',' && depth == 0) {
      parts.push_back(list.substr(start, i - start));
      start = i + 1;
    }
  }
  parts.push_back(list.substr(start));
  return parts;
}

// The numbers of one bracket's ranges, "01-03,07" -> 01 02 03 07, zero-padded as written.
absl::StatusOr<std::vector<std::string>> ExpandRanges(absl::string_view ranges,
                                                      absl::string_view list) {
  std::vector<std::string> out;
  for (absl::string_view r : absl::StrSplit(ranges, ',')) {
    std::pair<absl::string_view, absl::string_view> ends =
        absl::StrSplit(r, absl::MaxSplits('-', 1));
    if (ends.second.empty()) ends.second = ends.first;
    int64_t lo = 0, hi = 0;
    if (ends.first.empty() || !absl::SimpleAtoi(ends.first, &lo) ||
        !absl::SimpleAtoi(ends.second, &hi) || lo < 0 || hi < lo) {
      return Bad("SLURM_JOB_NODELIST", list, absl::StrCat("'", r, "' is not a range N or N-M"));
    }
    if (hi - lo >= kMaxTasks || static_cast<int64_t>(out.size()) + hi - lo >= kMaxTasks) {
      return Bad("SLURM_JOB_NODELIST", list, "expands to too many hosts");
    }
    const size_t width = ends.first.size();
    for (int64_t v = lo; v <= hi; ++v) {
      std::string digits = absl::StrCat(v);
      if (digits.size() < width) digits.insert(0, width - digits.size(), '0');
      out.push_back(std::move(digits));
    }
  }
  return out;
}

std::string Get(const std::map<std::string, std::string>& vars, const std::string& name) {
  auto it = vars.find(name);
  return it == vars.end() ? std::string() : it->second;
}

absl::StatusOr<TaskPlacement> FromSlurm(const std::map<std::string, std::string>& vars) {
  std::string list_var = "SLURM_STEP_NODELIST";
  std::string list = Get(vars, list_var);
  if (list.empty()) list = Get(vars, list_var = "SLURM_JOB_NODELIST");
  if (list.empty()) {
    return absl::InvalidArgumentError(
        "SLURM_JOB_NODELIST (or SLURM_STEP_NODELIST) is not set: is this process running under "
        "srun or sbatch?");
  }
  absl::StatusOr<std::vector<std::string>> hosts = ExpandHostList(list);
  if (!hosts.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(list_var, ": ", hosts.status().message()));
  }
  std::string counts_var = "SLURM_STEP_TASKS_PER_NODE";
  std::string counts_text = Get(vars, counts_var);
  if (counts_text.empty()) counts_text = Get(vars, counts_var = "SLURM_TASKS_PER_NODE");
  std::vector<int> counts;
  if (counts_text.empty()) {
    counts.assign(hosts->size(), 1);  // one task per host, as srun starts by default
  } else {
    absl::StatusOr<std::vector<int>> c = ExpandTasksPerNode(counts_text);
    if (!c.ok())
      return absl::InvalidArgumentError(absl::StrCat(counts_var, ": ", c.status().message()));
    counts = *std::move(c);
  }
  if (counts.size() != hosts->size()) {
    return Bad(counts_var, counts_text,
               absl::StrCat("gives ", counts.size(), " hosts' task counts, but ", list_var, "='",
                            list, "' names ", hosts->size(), " hosts"));
  }
  int total = 0;
  for (int c : counts) total += c;
  const std::string ntasks = Get(vars, "SLURM_NTASKS");
  int declared = 0;
  if (!ntasks.empty() && (!absl::SimpleAtoi(ntasks, &declared) || declared != total)) {
    return Bad("SLURM_NTASKS", ntasks,
               absl::StrCat("does not match the ", total, " tasks of ", counts_var, "='",
                            counts_text, "'"));
  }
  const std::string procid = Get(vars, "SLURM_PROCID");
  int rank = 0;
  if (procid.empty()) return absl::InvalidArgumentError("SLURM_PROCID is not set");
  if (!absl::SimpleAtoi(procid, &rank) || rank < 0 || rank >= total) {
    return Bad("SLURM_PROCID", procid, absl::StrCat("is not a rank of the ", total, " tasks"));
  }
  // The port is read through its row of the settings table (its range, its message), as every
  // variable is; only the rule that spans it and the task counts is checked here.
  std::map<std::string, std::string> port_var;
  if (auto it = vars.find("TENSORVERBS_SLURM_PORT"); it != vars.end()) port_var.insert(*it);
  absl::StatusOr<Config> port_config = Config::FromEnvironment(port_var);
  if (!port_config.ok()) return port_config.status();
  const int base_port = port_config->slurm_port;
  int most_per_host = 0;
  for (int c : counts) most_per_host = std::max(most_per_host, c);
  if (base_port + most_per_host - 1 > 65535) {
    return Bad(
        "TENSORVERBS_SLURM_PORT", absl::StrCat(base_port),
        absl::StrCat("leaves fewer ports than the ", most_per_host, " tasks of the busiest host"));
  }
  // Jobs by rank ranges, in the order given.
  std::vector<std::pair<std::string, int>> jobs;
  const std::string jobs_text = Get(vars, "TENSORVERBS_SLURM_JOBS");
  if (jobs_text.empty()) {
    jobs.emplace_back("worker", total);
  } else {
    int sum = 0;
    for (absl::string_view part : absl::StrSplit(jobs_text, ',')) {
      std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(part, ':');
      const std::string name(absl::StripAsciiWhitespace(kv.first));
      int n = 0;
      if (name.empty() || !absl::SimpleAtoi(kv.second, &n) || n < 1) {
        return Bad("TENSORVERBS_SLURM_JOBS", jobs_text,
                   absl::StrCat("'", part, "' is not JOB:COUNT with a count of at least 1"));
      }
      for (const auto& [existing, count] : jobs) {
        if (existing == name) {
          return Bad("TENSORVERBS_SLURM_JOBS", jobs_text, absl::StrCat("job '", name, "' twice"));
        }
      }
      jobs.emplace_back(name, n);
      sum += n;
    }
    if (sum != total) {
      return Bad("TENSORVERBS_SLURM_JOBS", jobs_text,
                 absl::StrCat("counts ", sum, " tasks, but Slurm started ", total));
    }
  }
  std::vector<std::string> addresses;
  for (size_t h = 0; h < hosts->size(); ++h) {
    for (int k = 0; k < counts[h]; ++k) {
      addresses.push_back(absl::StrCat((*hosts)[h], ":", base_port + k));
    }
  }
  std::map<std::string, std::vector<std::string>> spec;
  TaskPlacement placement;
  int next = 0;
  for (const auto& [name, n] : jobs) {
    std::vector<std::string>& tasks = spec[name];
    for (int i = 0; i < n; ++i, ++next) {
      if (next == rank) {
        placement.job = name;
        placement.task = i;
      }
      tasks.push_back(addresses[next]);
    }
  }
  ASSIGN_OR_RETURN(placement.cluster, ClusterSpec::FromJobs(std::move(spec)));
  return placement;
}

absl::StatusOr<TaskPlacement> FromTfConfig(const std::map<std::string, std::string>& vars) {
  const std::string text = Get(vars, "TF_CONFIG");
  if (text.empty()) return absl::InvalidArgumentError("TF_CONFIG is not set");
  nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) {
    return absl::InvalidArgumentError("TF_CONFIG is not a JSON object");
  }
  TaskPlacement placement;
  absl::StatusOr<ClusterSpec> cluster = ClusterSpec::FromJson(text);
  if (!cluster.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("TF_CONFIG: ", cluster.status().message()));
  }
  placement.cluster = *std::move(cluster);
  const nlohmann::json task = json.contains("task") ? json["task"] : nlohmann::json();
  if (!task.is_object() || !task.contains("type") || !task["type"].is_string() ||
      !task.contains("index") || !task["index"].is_number_integer()) {
    return absl::InvalidArgumentError(
        "TF_CONFIG has no \"task\": {\"type\": JOB, \"index\": N} naming this task");
  }
  placement.job = task["type"].get<std::string>();
  placement.task = task["index"].get<int>();
  if (absl::Status s = placement.cluster.TaskAddress(placement.job, placement.task).status();
      !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("TF_CONFIG's task: ", s.message()));
  }
  return placement;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ExpandHostList(absl::string_view list) {
  std::vector<std::string> hosts;
  for (absl::string_view item : SplitTopLevel(absl::StripAsciiWhitespace(list))) {
    if (item.empty()) return Bad("SLURM_JOB_NODELIST", list, "an empty host name");
    // Each bracket multiplies what came before it: "r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2.
    std::vector<std::string> names = {""};
    size_t i = 0;
    while (i < item.size()) {
      const size_t open = item.find('[', i);
      const absl::string_view text =
          item.substr(i, open == absl::string_view::npos ? absl::string_view::npos : open - i);
      if (text.find(']') != absl::string_view::npos) {
        return Bad("SLURM_JOB_NODELIST", list, "a ']' without its '['");
      }
      for (std::string& n : names) n.append(text.data(), text.size());
      if (open == absl::string_view::npos) break;
      const size_t close = item.find(']', open);
      if (close == absl::string_view::npos) {
        return Bad("SLURM_JOB_NODELIST", list, "a '[' without its ']'");
      }
      ASSIGN_OR_RETURN(std::vector<std::string> numbers,
                       ExpandRanges(item.substr(open + 1, close - open - 1), list));
      if (names.size() * numbers.size() + hosts.size() > static_cast<size_t>(kMaxTasks)) {
        return Bad("SLURM_JOB_NODELIST", list, "expands to too many hosts");
      }
      std::vector<std::string> product;
      for (const std::string& n : names) {
        for (const std::string& v : numbers) product.push_back(n + v);
      }
      names = std::move(product);
      i = close + 1;
    }
    for (std::string& n : names) hosts.push_back(std::move(n));
  }
  return hosts;
}

absl::StatusOr<std::vector<int>> ExpandTasksPerNode(absl::string_view counts) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(absl::StripAsciiWhitespace(counts), ',')) {
    int n = 0, repeat = 1;
    const size_t paren = part.find('(');
    absl::string_view count = part.substr(0, paren);
    if (paren != absl::string_view::npos) {
      absl::string_view rep = part.substr(paren);
      if (rep.size() < 4 || rep.substr(0, 2) != "(x" || rep.back() != ')' ||
          !absl::SimpleAtoi(rep.substr(2, rep.size() - 3), &repeat) || repeat < 1) {
        return Bad("SLURM_TASKS_PER_NODE", counts, absl::StrCat("'", part, "' is not N or N(xM)"));
      }
    }
    if (!absl::SimpleAtoi(count, &n) || n < 1) {
      return Bad("SLURM_TASKS_PER_NODE", counts, absl::StrCat("'", part, "' is not N or N(xM)"));
    }
    if (static_cast<int64_t>(out.size()) + repeat > kMaxTasks || n > kMaxTasks) {
      return Bad("SLURM_TASKS_PER_NODE", counts, "counts too many tasks");
    }
    out.insert(out.end(), repeat, n);
  }
  return out;
}

absl::StatusOr<TaskPlacement> PlacementFromVariables(
    absl::string_view source, const std::map<std::string, std::string>& variables) {
  if (source == "slurm") return FromSlurm(variables);
  if (source == "tf_config") return FromTfConfig(variables);
  return absl::InvalidArgumentError(
      absl::StrCat("unknown placement source '", source, "': give slurm or tf_config"));
}

absl::StatusOr<TaskPlacement> PlacementFromEnvironment(absl::string_view source) {
  return PlacementFromVariables(source, EnvironmentVariables({}));
}

}  // namespace tensorverbs
