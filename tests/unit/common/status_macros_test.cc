#include "src/common/status_macros.h"

#include <gtest/gtest.h>

namespace tensorverbs {
namespace {

absl::Status Fails() { return absl::NotFoundError("nope"); }
absl::StatusOr<int> Value(bool ok) {
  if (!ok) return absl::InvalidArgumentError("bad");
  return 7;
}

absl::Status UsesReturnIfError(bool fail, int* reached) {
  if (fail) RETURN_IF_ERROR(Fails());
  RETURN_IF_ERROR(absl::OkStatus());
  *reached = 1;
  return absl::OkStatus();
}

absl::StatusOr<int> UsesAssignOrReturn(bool ok) {
  ASSIGN_OR_RETURN(int v, Value(ok));
  ASSIGN_OR_RETURN(v, Value(ok));  // plain assignment form too
  return v * 2;
}

TEST(StatusMacros, ReturnIfErrorPropagates) {
  int reached = 0;
  EXPECT_EQ(UsesReturnIfError(true, &reached).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reached, 0);
  EXPECT_TRUE(UsesReturnIfError(false, &reached).ok());
  EXPECT_EQ(reached, 1);
}

TEST(StatusMacros, AssignOrReturn) {
  EXPECT_EQ(*UsesAssignOrReturn(true), 14);
  absl::StatusOr<int> r = UsesAssignOrReturn(false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "bad");
}

}  // namespace
}  // namespace tensorverbs
