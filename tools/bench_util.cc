#include "tools/bench_util.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/common/checksum.h"
#include "src/common/status_macros.h"

namespace tensorverbs::tools {

absl::StatusOr<size_t> ParseSize(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  const absl::string_view original = text;
  uint64_t mult = 1;
  for (auto [suffix, m] : std::vector<std::pair<const char*, uint64_t>>{{"GiB", 1ull << 30},
                                                                        {"MiB", 1ull << 20},
                                                                        {"KiB", 1ull << 10},
                                                                        {"G", 1ull << 30},
                                                                        {"M", 1ull << 20},
                                                                        {"K", 1ull << 10},
                                                                        {"B", 1}}) {
    if (absl::ConsumeSuffix(&text, suffix)) {
      mult = m;
      break;
    }
  }
  uint64_t n = 0;
  if (!absl::SimpleAtoi(text, &n) || n == 0 || n > (uint64_t{4} << 30) / mult) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad size '", original, "' (use 4B, 4KiB, 1MiB, ... up to 4GiB)"));
  }
  return static_cast<size_t>(n * mult);
}

absl::StatusOr<std::vector<size_t>> ParseSizeList(absl::string_view text) {
  std::vector<size_t> sizes;
  for (absl::string_view s : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    ASSIGN_OR_RETURN(size_t n, ParseSize(s));
    sizes.push_back(n);
  }
  if (sizes.empty()) return absl::InvalidArgumentError("no sizes given");
  return sizes;
}

absl::StatusOr<std::vector<int>> ParseCountList(absl::string_view text, absl::string_view flag,
                                                int lo, int hi) {
  std::vector<int> counts;
  for (absl::string_view s : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int n = 0;
    if (!absl::SimpleAtoi(s, &n) || n < lo || n > hi) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": bad count '", s, "' (", lo, "..", hi, ")"));
    }
    counts.push_back(n);
  }
  return counts;
}

std::string SizeName(size_t n) {
  if (n >= (size_t{1} << 30) && n % (size_t{1} << 30) == 0) return absl::StrCat(n >> 30, "GiB");
  if (n >= (size_t{1} << 20) && n % (size_t{1} << 20) == 0) return absl::StrCat(n >> 20, "MiB");
  if (n >= 1024 && n % 1024 == 0) return absl::StrCat(n >> 10, "KiB");
  return absl::StrCat(n, "B");
}

double Percentile(std::vector<double>& values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t i = std::min(values.size() - 1, static_cast<size_t>(p * values.size()));
  return values[i];
}

Spread SpreadOf(std::vector<double> values) {
  Spread s;
  if (values.empty()) return s;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  s.median = n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
  s.min = values.front();
  s.max = values.back();
  return s;
}

std::string FormatSpread(const Spread& s, int precision, int repeat) {
  if (repeat <= 1) return absl::StrFormat("%.*f", precision, s.median);
  return absl::StrFormat("%.*f [%.*f-%.*f]", precision, s.median, precision, s.min, precision,
                         s.max);
}

double CpuSeconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  auto seconds = [](const timeval& tv) { return tv.tv_sec + tv.tv_usec / 1e6; };
  return seconds(ru.ru_utime) + seconds(ru.ru_stime);
}

double MeasureMemcpyGbps(size_t bytes) {
  const size_t len = std::max<size_t>(bytes, 64);
  auto map = [len]() -> char* {
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    madvise(p, len, MADV_HUGEPAGE);
    std::memset(p, 0x5A, len);  // fault the pages in outside the measurement
    return static_cast<char*>(p);
  };
  char* src = map();
  char* dst = map();
  double best = 0;
  if (src != nullptr && dst != nullptr) {
    // Enough repetitions for ~50 ms of copying per round; the best round is the ceiling.
    const int reps = static_cast<int>(std::clamp<size_t>((size_t{1} << 30) / len, 1, 100000));
    for (int round = 0; round < 3; ++round) {
      const absl::Time t0 = absl::Now();
      for (int i = 0; i < reps; ++i) {
        std::memcpy(dst, src, bytes);
        asm volatile("" : : "r"(dst) : "memory");  // keep every copy
      }
      const double s = absl::ToDoubleSeconds(absl::Now() - t0);
      if (s > 0) best = std::max(best, static_cast<double>(bytes) * reps / s / 1e9);
    }
  }
  if (src != nullptr) munmap(src, len);
  if (dst != nullptr) munmap(dst, len);
  return best;
}

void FillBenchPattern(void* data, size_t bytes, uint32_t seed) {
  auto* out = static_cast<unsigned char*>(data);
  uint64_t x = 0x9e3779b97f4a7c15ULL * (uint64_t{seed} + 1);
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(out + i, &x, 8);
  }
  for (; i < bytes; ++i) out[i] = static_cast<unsigned char>(seed + i);
}

uint32_t BenchPatternCrc(size_t bytes, uint32_t seed) {
  std::vector<unsigned char> buf(bytes);
  FillBenchPattern(buf.data(), bytes, seed);
  return Crc32c(buf.data(), bytes);
}

std::vector<ParsedKey> MakeKeys(const std::string& src_device, uint64_t src_incarnation,
                                const std::string& dst_device,
                                const std::vector<std::string>& names) {
  std::vector<ParsedKey> keys;
  keys.reserve(names.size());
  for (const std::string& name : names) {
    keys.push_back(
        *ParsedKey::Parse(ParsedKey::Create(src_device, src_incarnation, dst_device, name)));
  }
  return keys;
}

absl::Status Tell(support::Subprocess& peer, const std::string& line) {
  if (!support::WriteLine(peer, line)) {
    return absl::InternalError(
        absl::StrCat("the bench peer (pid ", peer.pid(), ") closed its input; did it crash?"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Expect(support::Subprocess& peer, absl::string_view prefix,
                                   absl::Duration timeout) {
  absl::StatusOr<std::string> line = peer.ReadLine(timeout);
  if (!line.ok()) {
    return absl::Status(line.status().code(),
                        absl::StrCat("waiting for '", prefix, "' from the bench peer (pid ",
                                     peer.pid(), "): ", line.status().message()));
  }
  if (absl::StartsWith(*line, "error ")) {
    return absl::InternalError(absl::StrCat("bench peer: ", line->substr(6)));
  }
  if (!absl::StartsWith(*line, prefix)) {
    return absl::InternalError(
        absl::StrCat("bench peer said '", *line, "' where '", prefix, "' was expected"));
  }
  return std::string(absl::StripAsciiWhitespace(absl::string_view(*line).substr(prefix.size())));
}

bool WriteJsonRows(const std::string& path, const nlohmann::json& rows, const char* tool) {
  std::ofstream out(path);
  out << rows.dump(2) << "\n";
  out.close();
  if (!out) {
    std::fprintf(stderr, "%s: cannot write %s: %s\n", tool, path.c_str(), std::strerror(errno));
    return false;
  }
  std::printf("\nJSON rows: %s\n", path.c_str());
  return true;
}

absl::Status WritePngPlot(const std::string& path, const std::string& title,
                          const std::vector<PlotPanel>& panels) {
  const char* gnuplot = "/usr/bin/gnuplot";
  if (access(gnuplot, X_OK) != 0) {
    return absl::UnavailableError(
        "gnuplot is not installed (Debian package gnuplot-nox; scripts/install-deps.sh installs "
        "it)");
  }
  // gnuplot's data and script go next to the plot, where the caller can write, rather than
  // into a shared /tmp that the caller (a test with its own directory, say) never chose.
  std::string dir_template =
      (std::filesystem::path(path).parent_path() / ".tensorverbs-plot-XXXXXX").string();
  if (mkdtemp(dir_template.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", dir_template, ": ", std::strerror(errno)));
  }
  const std::string dir = dir_template;
  // Text goes through gnuplot's enhanced mode, where '_' means subscript; file names do not.
  auto quote = [](const std::string& s) {
    return absl::StrCat("\"", absl::StrReplaceAll(s, {{"\"", "'"}, {"_", "\\\\_"}}), "\"");
  };
  auto quote_file = [](const std::string& s) {
    return absl::StrCat("\"", absl::StrReplaceAll(s, {{"\\", "\\\\"}, {"\"", "\\\""}}), "\"");
  };
  std::string script = absl::StrCat(
      "set terminal pngcairo size ", 640 * std::max<size_t>(panels.size(), 1),
      ",520 font 'sans,10'\n", "set output ", quote_file(path), "\n", "set multiplot layout 1,",
      panels.size(), " title ", quote(title), "\n", "set key top left box opaque\n", "set grid\n");
  std::vector<std::string> files;
  for (size_t p = 0; p < panels.size(); ++p) {
    const PlotPanel& panel = panels[p];
    absl::StrAppend(&script, "set title ", quote(panel.title), "\n", "set xlabel ",
                    quote(panel.x_label), "\n", "set ylabel ", quote(panel.y_label), "\n",
                    panel.log_x ? "set logscale x 2\n" : "unset logscale x\n",
                    panel.log_y ? "set logscale y\nset format y '%g'\n"
                                : "unset logscale y\nset format y '%g'\n");
    if (panel.x_ticks.empty()) {
      absl::StrAppend(&script, "set xtics autofreq\n");
    } else {
      std::vector<std::string> ticks;
      for (const auto& [x, label] : panel.x_ticks) {
        ticks.push_back(absl::StrCat(quote(label), " ", x));
      }
      absl::StrAppend(&script, "set xtics (", absl::StrJoin(ticks, ", "), ")\n");
    }
    std::vector<std::string> plots;
    for (size_t s = 0; s < panel.series.size(); ++s) {
      const PlotSeries& series = panel.series[s];
      if (series.x.empty()) continue;
      const std::string file = absl::StrCat(dir, "/p", p, "s", s, ".dat");
      std::ofstream out(file);
      for (size_t i = 0; i < series.x.size() && i < series.y.size(); ++i) {
        out << series.x[i] << " " << series.y[i] << "\n";
      }
      files.push_back(file);
      plots.push_back(absl::StrCat(quote_file(file), " using 1:2 with linespoints lw 2 title ",
                                   quote(series.title)));
    }
    if (plots.empty()) {
      absl::StrAppend(&script, "plot 0 notitle\n");
    } else {
      absl::StrAppend(&script, "plot ", absl::StrJoin(plots, ", "), "\n");
    }
  }
  absl::StrAppend(&script, "unset multiplot\n");
  const std::string script_file = dir + "/plot.gp";
  std::ofstream(script_file) << script;
  absl::Status result;
  absl::StatusOr<std::unique_ptr<support::Subprocess>> child = support::Subprocess::Start(gnuplot, {script_file});
  if (!child.ok()) {
    result = child.status();
  } else {
    (*child)->ReadAll(absl::Seconds(60));
    absl::StatusOr<int> rc = (*child)->Wait(absl::Seconds(10));
    if (!rc.ok() || *rc != 0) {
      result = absl::UnavailableError(absl::StrCat("gnuplot failed to draw ", path));
    }
  }
  for (const std::string& f : files) unlink(f.c_str());
  unlink(script_file.c_str());
  rmdir(dir.c_str());
  return result;
}

}  // namespace tensorverbs::tools
