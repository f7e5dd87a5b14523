#include "src/common/config.h"

#include <cstdio>
#include <mutex>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/common/settings.h"
#include "src/common/status_macros.h"

extern char** environ;

namespace tensorverbs {
namespace {

constexpr char kPrefix[] = "TENSORVERBS_";

absl::Status Invalid(const std::string& name, const std::string& raw, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("environment variable ", name, "='", raw, "' is invalid: ", why));
}

// Parses the value `raw` of `name` (the row's variable or its alias) into `config`.
absl::Status Apply(const Setting& s, const std::string& name, const std::string& raw,
                   Config& config) {
  const std::string text(absl::StripAsciiWhitespace(raw));
  switch (s.kind) {
    case SettingKind::kInteger: {
      int64_t value = 0;
      if (!absl::SimpleAtoi(text, &value) || value < s.min || value > s.max) {
        return Invalid(name, raw, absl::StrCat("expected an integer in [", s.min, ", ", s.max, "]"));
      }
      if (s.check != nullptr) {
        if (const char* why = s.check(value); why != nullptr) return Invalid(name, raw, why);
      }
      if (s.set_int != nullptr) s.set_int(config, value);
      return absl::OkStatus();
    }
    case SettingKind::kChoice: {
      const std::string v = absl::AsciiStrToLower(text);
      for (const std::string& c : s.choices) {
        if (v == c) {
          if (s.set_text != nullptr) s.set_text(config, v);
          return absl::OkStatus();
        }
      }
      return Invalid(name, raw, absl::StrCat("expected one of ", absl::StrJoin(s.choices, ", ")));
    }
    case SettingKind::kText:
      if (s.set_text != nullptr) s.set_text(config, text);
      return absl::OkStatus();
    case SettingKind::kCustom:
      if (absl::Status status = s.parse(text, config); !status.ok()) {
        return Invalid(name, raw, status.message());
      }
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

struct ProcessConfig {
  Config config;
  absl::Status status;
};

const ProcessConfig& GetProcessConfig() {
  static const ProcessConfig* process = [] {
    auto* p = new ProcessConfig;
    absl::StatusOr<Config> parsed = Config::FromEnvironment(EnvironmentVariables({kPrefix, "RDMA_"}));
    if (parsed.ok()) {
      p->config = *std::move(parsed);
    } else {
      p->status = parsed.status();
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

std::map<std::string, std::string> EnvironmentVariables(const std::vector<std::string>& prefixes) {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    absl::string_view entry(*e);
    const size_t eq = entry.find('=');
    if (eq == absl::string_view::npos) continue;
    const absl::string_view name = entry.substr(0, eq);
    bool wanted = prefixes.empty();
    for (const std::string& p : prefixes) wanted |= absl::StartsWith(name, p);
    if (wanted) env.emplace(std::string(name), std::string(entry.substr(eq + 1)));
  }
  return env;
}

const std::vector<std::string>& Config::KnownVariables() {
  static const std::vector<std::string>* names = [] {
    auto* v = new std::vector<std::string>;
    for (const Setting& s : Settings()) {
      v->push_back(s.variable);
      if (s.alias != nullptr) v->push_back(s.alias);
    }
    return v;
  }();
  return *names;
}

absl::StatusOr<Config> Config::FromEnvironment(const std::map<std::string, std::string>& env) {
  Config config;
  // A variable set to nothing (or blanks) is the same as unset, as `VAR= command` means.
  auto find = [&env](const char* name) {
    auto it = name != nullptr ? env.find(name) : env.end();
    return it != env.end() && absl::StripAsciiWhitespace(it->second).empty() ? env.end() : it;
  };
  for (const Setting& s : Settings()) {
    auto a = find(s.variable);
    auto b = find(s.alias);
    if (a != env.end() && b != env.end() &&
        absl::StripAsciiWhitespace(a->second) != absl::StripAsciiWhitespace(b->second)) {
      return absl::InvalidArgumentError(absl::StrCat("environment variables ", s.variable, "='",
                                                     a->second, "' and its alias ", s.alias, "='",
                                                     b->second, "' disagree; set only ",
                                                     s.variable));
    }
    if (a != env.end()) {
      RETURN_IF_ERROR(Apply(s, s.variable, a->second, config));
    } else if (b != env.end()) {
      RETURN_IF_ERROR(Apply(s, s.alias, b->second, config));
    }
  }
  // The one rule that spans rows.
  const int tls_files =
      !config.tls_cert_file.empty() + !config.tls_key_file.empty() + !config.tls_ca_file.empty();
  if (tls_files != 0 && tls_files != 3) {
    return absl::InvalidArgumentError(
        "TENSORVERBS_TLS_CERT, TENSORVERBS_TLS_KEY and TENSORVERBS_TLS_CA: mutual TLS needs all "
        "three (this task's certificate, its private key and the cluster's CA), or none");
  }

  for (const auto& [name, value] : env) {
    if (absl::StartsWith(name, kPrefix) && FindSetting(name) == nullptr) {
      config.warnings.push_back(
          absl::StrCat("unknown environment variable ", name,
                       " is ignored; known variables: ", absl::StrJoin(KnownVariables(), ", ")));
    }
  }
  return config;
}

const Config& Config::Defaults() {
  static const Config* defaults = new Config();
  return *defaults;
}

const Config& Config::Get() { return GetProcessConfig().config; }

absl::Status Config::EnvironmentStatus() { return GetProcessConfig().status; }

}  // namespace tensorverbs
