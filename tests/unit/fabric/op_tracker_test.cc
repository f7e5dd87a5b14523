// OpTracker with a fake provider: the issue function records what it was handed and answers
// as the test says (issued, full, or an error).
#include "src/fabric/op_tracker.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "src/fabric/fabric.h"

namespace tensorverbs::fabric {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class OpTrackerTest : public ::testing::Test {
 protected:
  OpTrackerTest() {
    domain_ = *OpenDomain("loopback", {});
    endpoint_ = *domain_->CreateEndpoint();
  }

  // A tracker for the fixture's endpoint (only its identity is used: completions name it).
  std::unique_ptr<OpTracker> Tracker(size_t depth, absl::Duration timeout = absl::Hours(1)) {
    return std::make_unique<OpTracker>(endpoint_.get(), depth, timeout, "test endpoint");
  }

  Op* NewWrite(OpTracker& tracker, uint64_t context) {
    return tracker.NewOp(CompletionKind::kWrite, /*with_imm=*/false, 0, LocalBuffer{},
                         RemoteBuffer{}, context);
  }

  // The fake provider's answer to the next issue, and what it was handed.
  absl::StatusOr<bool> Issue(Op* op) {
    if (answer_.ok() && *answer_) issued_.push_back(op->context);
    return answer_;
  }
  auto IssueFn() {
    return [this](Op* op) { return Issue(op); };
  }

  std::unique_ptr<Domain> domain_;
  std::unique_ptr<Endpoint> endpoint_;
  absl::StatusOr<bool> answer_ = true;
  std::vector<uint64_t> issued_;  // contexts, in issue order
};

TEST_F(OpTrackerTest, QueueDepthCreditsQueueTheRestUntilOneCompletes) {
  auto tracker = Tracker(/*depth=*/2);
  Op* a = NewWrite(*tracker, 1);
  Op* b = NewWrite(*tracker, 2);
  Op* c = NewWrite(*tracker, 3);
  for (Op* op : {a, b, c}) ASSERT_TRUE(tracker->Submit(op, IssueFn()).ok());
  EXPECT_THAT(issued_, ElementsAre(1u, 2u)) << "two credits, two issued";
  EXPECT_EQ(tracker->live(), 3u);

  Completion out[4];
  EXPECT_EQ(tracker->Drain(IssueFn(), absl::MakeSpan(out)), 0u);
  EXPECT_THAT(issued_, ElementsAre(1u, 2u)) << "no credit freed yet";

  Completion done;
  ASSERT_TRUE(tracker->Complete(a, absl::OkStatus(), &done));
  EXPECT_EQ(done.context, 1u);
  EXPECT_EQ(done.kind, CompletionKind::kWrite);
  EXPECT_EQ(done.endpoint, endpoint_.get());
  EXPECT_TRUE(done.status.ok());
  EXPECT_EQ(tracker->live(), 2u);

  EXPECT_EQ(tracker->Drain(IssueFn(), absl::MakeSpan(out)), 0u);
  EXPECT_THAT(issued_, ElementsAre(1u, 2u, 3u)) << "the freed credit issued the queued op";
  EXPECT_EQ(tracker->live(), 2u);

  for (Op* op : {b, c}) ASSERT_TRUE(tracker->Complete(op, absl::OkStatus(), &done));
  EXPECT_EQ(tracker->live(), 0u);
}

TEST_F(OpTrackerTest, AFullProviderKeepsOpsQueuedInOrder) {
  auto tracker = Tracker(/*depth=*/8);
  answer_ = false;  // the provider's queue is full (EAGAIN)
  ASSERT_TRUE(tracker->Submit(NewWrite(*tracker, 1), IssueFn()).ok());
  answer_ = true;
  // Queued ops go first, so a later submit does not overtake the one waiting.
  ASSERT_TRUE(tracker->Submit(NewWrite(*tracker, 2), IssueFn()).ok());
  EXPECT_TRUE(issued_.empty());
  Completion out[4];
  EXPECT_EQ(tracker->Drain(IssueFn(), absl::MakeSpan(out)), 0u);
  EXPECT_THAT(issued_, ElementsAre(1u, 2u));
  EXPECT_EQ(tracker->live(), 2u);
}

TEST_F(OpTrackerTest, AnIssueErrorFailsThePostWithNoCompletion) {
  auto tracker = Tracker(/*depth=*/2);
  answer_ = absl::InternalError("provider refused");
  absl::Status s = tracker->Submit(NewWrite(*tracker, 7), IssueFn());
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(tracker->live(), 0u);
  answer_ = true;
  Completion out[4];
  EXPECT_EQ(tracker->Drain(IssueFn(), absl::MakeSpan(out)), 0u) << "a refused post reports nothing";
  // Its credit was never taken.
  ASSERT_TRUE(tracker->Submit(NewWrite(*tracker, 8), IssueFn()).ok());
  ASSERT_TRUE(tracker->Submit(NewWrite(*tracker, 9), IssueFn()).ok());
  EXPECT_THAT(issued_, ElementsAre(8u, 9u));
}

TEST_F(OpTrackerTest, AnErrorIssuingAQueuedOpIsReportedOnceByDrain) {
  auto tracker = Tracker(/*depth=*/1);
  Op* first = NewWrite(*tracker, 1);
  ASSERT_TRUE(tracker->Submit(first, IssueFn()).ok());
  ASSERT_TRUE(tracker->Submit(NewWrite(*tracker, 2), IssueFn()).ok());  // queued
  Completion done;
  ASSERT_TRUE(tracker->Complete(first, absl::OkStatus(), &done));
  // The post of op 2 already returned OK, so its failure must come as a completion.
  answer_ = absl::UnavailableError("peer gone");
  Completion out[4];
  ASSERT_EQ(tracker->Drain(IssueFn(), absl::MakeSpan(out)), 1u);
  EXPECT_EQ(out[0].context, 2u);
  EXPECT_EQ(out[0].status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(tracker->live(), 0u);
  EXPECT_EQ(tracker->Drain(IssueFn(), absl::MakeSpan(out)), 0u);
}

TEST_F(OpTrackerTest, DeferReportsTheErrorOnceInDrain) {
  auto tracker = Tracker(/*depth=*/4);
  Op* op = NewWrite(*tracker, 42);
  ASSERT_TRUE(tracker->Submit(op, IssueFn()).ok());
  tracker->Defer(op, absl::DataLossError("flushed"));
  EXPECT_EQ(tracker->live(), 1u) << "not reported yet";
  // No room this time: it waits for the next Drain.
  EXPECT_EQ(tracker->Drain(IssueFn(), absl::Span<Completion>()), 0u);
  Completion out[4];
  ASSERT_EQ(tracker->Drain(IssueFn(), absl::MakeSpan(out)), 1u);
  EXPECT_EQ(out[0].context, 42u);
  EXPECT_EQ(out[0].endpoint, endpoint_.get());
  EXPECT_EQ(out[0].status.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(tracker->live(), 0u);
  EXPECT_EQ(tracker->Drain(IssueFn(), absl::MakeSpan(out)), 0u);
  // Its credit came back.
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(tracker->Submit(NewWrite(*tracker, i), IssueFn()).ok());
  EXPECT_EQ(issued_.size(), 5u);
}

TEST_F(OpTrackerTest, ATimedOutOpIsReportedExactlyOnce) {
  auto tracker = Tracker(/*depth=*/1, /*timeout=*/absl::ZeroDuration());
  Op* issued = NewWrite(*tracker, 1);
  ASSERT_TRUE(tracker->Submit(issued, IssueFn()).ok());
  ASSERT_TRUE(tracker->Submit(NewWrite(*tracker, 2), IssueFn()).ok());  // queued behind it
  EXPECT_EQ(tracker->live(), 2u);

  Completion out[4];
  answer_ = false;  // the provider stays full: op 2 is never issued
  ASSERT_EQ(tracker->Drain(IssueFn(), absl::MakeSpan(out)), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(out[i].context, static_cast<uint64_t>(i + 1));
    EXPECT_EQ(out[i].status.code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_THAT(std::string(out[i].status.message()), HasSubstr("test endpoint"));
  }
  // The issued one may have lost its peer; the queued one never reached it, and says so.
  EXPECT_THAT(std::string(out[0].status.message()), HasSubstr("the peer may be gone"));
  EXPECT_THAT(std::string(out[1].status.message()), HasSubstr("was not issued"));
  EXPECT_EQ(tracker->live(), 0u);
  EXPECT_EQ(tracker->Drain(IssueFn(), absl::MakeSpan(out)), 0u);

  // The provider returns the issued op late: nothing more is reported.
  Completion late;
  EXPECT_FALSE(tracker->Complete(issued, absl::OkStatus(), &late));
  answer_ = true;
  EXPECT_EQ(tracker->Drain(IssueFn(), absl::MakeSpan(out)), 0u);
  EXPECT_THAT(issued_, ElementsAre(1u)) << "the timed-out queued op was dropped, not issued";
  EXPECT_EQ(tracker->live(), 0u);
}

TEST_F(OpTrackerTest, LiveCountsSubmittedOpsUntilReported) {
  auto tracker = Tracker(/*depth=*/16);
  std::vector<Op*> ops;
  for (uint64_t i = 0; i < 10; ++i) {
    ops.push_back(NewWrite(*tracker, i));
    ASSERT_TRUE(tracker->Submit(ops.back(), IssueFn()).ok());
    EXPECT_EQ(tracker->live(), i + 1);
  }
  Completion c;
  for (size_t i = 0; i < ops.size(); ++i) {
    ASSERT_TRUE(tracker->Complete(ops[i], absl::OkStatus(), &c));
    EXPECT_EQ(tracker->live(), ops.size() - i - 1);
  }
  // Records are pooled: a new burst reuses them and counts the same.
  for (uint64_t i = 0; i < 10; ++i) ASSERT_TRUE(tracker->Submit(NewWrite(*tracker, i), IssueFn()).ok());
  EXPECT_EQ(tracker->live(), 10u);
}

}  // namespace
}  // namespace tensorverbs::fabric
