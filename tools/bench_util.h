// Helpers the `tensorverbs bench` subcommands share: size lists, percentiles, CPU time, a memcpy
// baseline, the line protocol the launcher speaks with its peer processes, and PNG plots.
//
// Everything here runs on a tool's main thread, except CpuSeconds (any thread).
#ifndef TENSORVERBS_TOOLS_BENCH_UTIL_H_
#define TENSORVERBS_TOOLS_BENCH_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "tensorverbs/parsed_key.h"
#include "src/support/subprocess.h"

namespace tensorverbs::tools {

// "4B", "4KiB", "1MiB", "2GiB" (also K, M, G) -> bytes; 1 B .. 4 GiB.
absl::StatusOr<size_t> ParseSize(absl::string_view text);
// A comma-separated list of sizes, in the order given.
absl::StatusOr<std::vector<size_t>> ParseSizeList(absl::string_view text);
// A comma-separated list of counts in lo..hi, in the order given (empty text: none);
// InvalidArgument naming `flag` and the range for a bad one.
absl::StatusOr<std::vector<int>> ParseCountList(absl::string_view text, absl::string_view flag,
                                                int lo, int hi);
// The shortest exact name: 4B, 4KiB, 64MiB.
std::string SizeName(size_t bytes);

// The p-quantile (0..1) of `values` (sorted in place); 0 for an empty vector.
double Percentile(std::vector<double>& values, double p);

// A figure measured several times: its median and range.
struct Spread {
  double median = 0, min = 0, max = 0;
};
// The median and range of `values`; zeros for an empty vector.
Spread SpreadOf(std::vector<double> values);
// "12.3 [11.9-13.0]" with `precision` decimals (just the value for one repetition).
std::string FormatSpread(const Spread& s, int precision, int repeat);

// User plus system CPU time of this process so far, in seconds.
double CpuSeconds();

// Bandwidth of memcpy between two pre-faulted buffers of `bytes`, in GB/s (10^9 B/s), the best
// of a few repetitions: the ceiling for any transport that copies once.
double MeasureMemcpyGbps(size_t bytes);

// Fills `bytes` at `data` with a pattern derived from `seed` (fast: a xorshift per 8 bytes), so
// that a receiver can check what it got against BenchPatternCrc.
void FillBenchPattern(void* data, size_t bytes, uint32_t seed);
// CRC-32C of the pattern FillBenchPattern writes.
uint32_t BenchPatternCrc(size_t bytes, uint32_t seed);

// Keys of the tensors `src_device` sends to `dst_device`, one per name.
std::vector<ParsedKey> MakeKeys(const std::string& src_device, uint64_t src_incarnation,
                                const std::string& dst_device,
                                const std::vector<std::string>& names);

// Sends one command line to a peer process.
absl::Status Tell(support::Subprocess& peer, const std::string& line);
// Reads the peer's next line and checks it starts with `prefix`; returns the rest of the line.
// A line starting with "error " becomes that error.
absl::StatusOr<std::string> Expect(support::Subprocess& peer, absl::string_view prefix,
                                   absl::Duration timeout = absl::Seconds(600));

// Writes `rows` (pretty-printed) to `path` and says where on stdout; false, with a message on
// stderr naming `tool`, if the file cannot be written.
bool WriteJsonRows(const std::string& path, const nlohmann::json& rows, const char* tool);

// One line series of a plot.
struct PlotSeries {
  std::string title;
  std::vector<double> x;
  std::vector<double> y;
};

struct PlotPanel {
  std::string title;
  std::string x_label;
  std::string y_label;
  bool log_x = true;
  bool log_y = false;
  std::vector<PlotSeries> series;
  // Labelled ticks on x (e.g. tensor sizes); empty: gnuplot's own.
  std::vector<std::pair<double, std::string>> x_ticks;
};

// Draws the panels side by side into a PNG with gnuplot (Debian's gnuplot-nox). Unavailable
// when gnuplot is not installed or fails; the message says which.
absl::Status WritePngPlot(const std::string& path, const std::string& title,
                          const std::vector<PlotPanel>& panels);

}  // namespace tensorverbs::tools

#endif  // TENSORVERBS_TOOLS_BENCH_UTIL_H_
