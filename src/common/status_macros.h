// RETURN_IF_ERROR and ASSIGN_OR_RETURN for absl::Status / absl::StatusOr.
//
// Debian's abseil (20220623) has no status macros, so the project carries these two. They are
// used everywhere a function propagates an error; they never log and never abort.
#ifndef TENSORVERBS_COMMON_STATUS_MACROS_H_
#define TENSORVERBS_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define TV_STATUS_CONCAT_INNER_(a, b) a##b
#define TV_STATUS_CONCAT_(a, b) TV_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status) and returns it from the enclosing function if not OK.
#define RETURN_IF_ERROR(expr)                                   \
  do {                                                          \
    ::absl::Status tv_status_ = (expr);                         \
    if (ABSL_PREDICT_FALSE(!tv_status_.ok())) return tv_status_; \
  } while (0)

// `ASSIGN_OR_RETURN(lhs, expr)`: evaluates `expr` (an absl::StatusOr<T>); on error returns its
// status, otherwise move-assigns the value to `lhs` (which may be a declaration).
#define ASSIGN_OR_RETURN(lhs, expr) \
  TV_ASSIGN_OR_RETURN_IMPL_(TV_STATUS_CONCAT_(tv_statusor_, __LINE__), lhs, expr)

#define TV_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr)          \
  auto statusor = (expr);                                       \
  if (ABSL_PREDICT_FALSE(!statusor.ok())) return statusor.status(); \
  lhs = std::move(statusor).value()

#endif  // TENSORVERBS_COMMON_STATUS_MACROS_H_
