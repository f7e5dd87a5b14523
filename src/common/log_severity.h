// LogSeverity: the levels of common/logging.h, apart from its macros so that Config (which
// holds the threshold) can be included beside other libraries' LOG and CHECK, as the torch
// backend is.
#ifndef TENSORVERBS_COMMON_LOG_SEVERITY_H_
#define TENSORVERBS_COMMON_LOG_SEVERITY_H_

namespace tensorverbs {

enum class LogSeverity { kVerbose = -1, kInfo = 0, kWarning = 1, kError = 2, kFatal = 3 };

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_LOG_SEVERITY_H_
