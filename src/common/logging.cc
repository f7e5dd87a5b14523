#include "src/common/logging.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "src/common/config.h"

namespace tensorverbs {
namespace logging_internal {
namespace {

struct Threshold {
  std::atomic<int> min_severity{-2};  // -2: not yet read from the environment
  std::atomic<int> verbosity{0};
};

Threshold& GetThreshold() {
  static Threshold threshold;
  return threshold;
}

void EnsureInitialized() {
  Threshold& t = GetThreshold();
  if (t.min_severity.load(std::memory_order_acquire) != -2) return;
  const Config& config = Config::Get();
  t.verbosity.store(config.log_verbosity, std::memory_order_relaxed);
  int expected = -2;
  t.min_severity.compare_exchange_strong(expected, static_cast<int>(config.log_severity),
                                         std::memory_order_release);
}

char SeverityLetter(LogSeverity s) {
  switch (s) {
    case LogSeverity::kVerbose:
      return 'V';
    case LogSeverity::kInfo:
      return 'I';
    case LogSeverity::kWarning:
      return 'W';
    case LogSeverity::kError:
      return 'E';
    case LogSeverity::kFatal:
      return 'F';
  }
  return '?';
}

}  // namespace

bool ShouldLog(LogSeverity severity, int verbosity) {
  if (severity == LogSeverity::kFatal) return true;
  EnsureInitialized();
  Threshold& t = GetThreshold();
  if (severity == LogSeverity::kVerbose) {
    return verbosity <= t.verbosity.load(std::memory_order_relaxed);
  }
  return static_cast<int>(severity) >= t.min_severity.load(std::memory_order_relaxed);
}

void SetMinSeverity(LogSeverity severity, int verbosity) {
  Threshold& t = GetThreshold();
  t.verbosity.store(verbosity, std::memory_order_relaxed);
  t.min_severity.store(static_cast<int>(severity), std::memory_order_release);
}

LogMessage::LogMessage(const char* file, int line, LogSeverity severity) : severity_(severity) {
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  auto now = std::chrono::system_clock::now();
  std::time_t secs = std::chrono::system_clock::to_time_t(now);
  int micros = static_cast<int>(
      std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() %
      1000000);
  std::tm tm_buf;
  localtime_r(&secs, &tm_buf);
  char prefix[64];
  std::snprintf(prefix, sizeof(prefix), "%c%02d%02d %02d:%02d:%02d.%06d %d ",
                SeverityLetter(severity), tm_buf.tm_mon + 1, tm_buf.tm_mday, tm_buf.tm_hour,
                tm_buf.tm_min, tm_buf.tm_sec, micros, static_cast<int>(getpid()));
  stream_ << prefix << base << ':' << line << "] ";
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  std::string line = stream_.str();
  // One write per line keeps concurrent lines whole.
  ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
  if (severity_ == LogSeverity::kFatal) std::abort();
}

}  // namespace logging_internal
}  // namespace tensorverbs
