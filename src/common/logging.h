// Leveled logging to stderr: LOG(INFO|WARNING|ERROR|FATAL), VLOG(n), CHECK, DCHECK.
//
// The threshold is read once from TENSORVERBS_LOG_LEVEL through common/config (error, warning,
// info, or debug / a number N for VLOG(N)); the default is warning. Any thread may log; each
// line is written with one write() so lines from different threads do not interleave.
// CHECK is for programming invariants only: nothing a peer, the network or a config value does
// may reach a CHECK.
#ifndef TENSORVERBS_COMMON_LOGGING_H_
#define TENSORVERBS_COMMON_LOGGING_H_

#include <sstream>
#include <string_view>

#include "src/common/log_severity.h"

namespace tensorverbs {

namespace logging_internal {

// True when a message of `severity` (and, for kVerbose, `verbosity`) is to be written.
bool ShouldLog(LogSeverity severity, int verbosity = 0);

// Overrides the environment's threshold (tools' --v flag and tests).
void SetMinSeverity(LogSeverity severity, int verbosity);

class LogMessage {
 public:
  LogMessage(const char* file, int line, LogSeverity severity);
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  ~LogMessage();  // Writes the line; aborts for kFatal.
  std::ostream& stream() { return stream_; }

 private:
  LogSeverity severity_;
  std::ostringstream stream_;
};

// Makes `cond ? (void)0 : Voidify() & stream` type-check.
struct Voidify {
  void operator&(std::ostream&) {}
};

}  // namespace logging_internal
}  // namespace tensorverbs

#define TV_LOG_SEVERITY_INFO ::tensorverbs::LogSeverity::kInfo
#define TV_LOG_SEVERITY_WARNING ::tensorverbs::LogSeverity::kWarning
#define TV_LOG_SEVERITY_ERROR ::tensorverbs::LogSeverity::kError
#define TV_LOG_SEVERITY_FATAL ::tensorverbs::LogSeverity::kFatal

#define LOG(severity)                                                              \
  !::tensorverbs::logging_internal::ShouldLog(TV_LOG_SEVERITY_##severity)          \
      ? (void)0                                                                    \
      : ::tensorverbs::logging_internal::Voidify() &                               \
            ::tensorverbs::logging_internal::LogMessage(__FILE__, __LINE__,        \
                                                        TV_LOG_SEVERITY_##severity) \
                .stream()

#define VLOG(level)                                                                   \
  !::tensorverbs::logging_internal::ShouldLog(::tensorverbs::LogSeverity::kVerbose,   \
                                              (level))                                \
      ? (void)0                                                                       \
      : ::tensorverbs::logging_internal::Voidify() &                                  \
            ::tensorverbs::logging_internal::LogMessage(                              \
                __FILE__, __LINE__, ::tensorverbs::LogSeverity::kVerbose)             \
                .stream()

#define CHECK(cond)                                                                   \
  (cond) ? (void)0                                                                    \
         : ::tensorverbs::logging_internal::Voidify() &                               \
               ::tensorverbs::logging_internal::LogMessage(                           \
                   __FILE__, __LINE__, ::tensorverbs::LogSeverity::kFatal)            \
                       .stream()                                                      \
                   << "Check failed: " #cond " "

// Sanitizer builds keep DCHECKs (TENSORVERBS_DCHECK_ALWAYS_ON), so the thread-ownership and
// state-machine checks run under the ASan and TSan suites.
#if defined(NDEBUG) && !defined(TENSORVERBS_DCHECK_ALWAYS_ON)
#define DCHECK(cond) \
  while (false) CHECK(cond)
#else
#define DCHECK(cond) CHECK(cond)
#endif

#endif  // TENSORVERBS_COMMON_LOGGING_H_
