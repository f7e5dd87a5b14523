#include "src/fabric/op_tracker.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/common/coarse_clock.h"

namespace tensorverbs::fabric {

OpTracker::OpTracker(Endpoint* owner, size_t queue_depth, absl::Duration op_timeout,
                     std::string name)
    : owner_(owner), queue_depth_(queue_depth), op_timeout_(op_timeout), name_(std::move(name)) {}

OpTracker::~OpTracker() {
  for (Op* op = head_; op != nullptr;) delete std::exchange(op, op->next);
  for (Op* op : free_) delete op;
}

Op* OpTracker::NewOp(CompletionKind kind, bool with_imm, uint32_t imm, const LocalBuffer& local,
                     const RemoteBuffer& remote, uint64_t context) {
  Op* op;
  if (free_.empty()) {
    op = new Op();
  } else {
    op = free_.back();
    free_.pop_back();
    *op = Op();
  }
  op->tracker = this;
  op->prev = tail_;
  (tail_ ? tail_->next : head_) = op;
  tail_ = op;
  op->kind = kind;
  op->with_imm = with_imm;
  op->imm = imm;
  op->buf = local.length > 0 ? local.addr : nullptr;
  op->len = local.length;
  op->remote_addr = remote.addr;
  op->context = context;
  op->posted = CoarseNow();  // timeouts are seconds; the fine clock costs on every post
  ++live_;
  return op;
}

void OpTracker::Release(Op* op) {
  (op->prev ? op->prev->next : head_) = op->next;
  (op->next ? op->next->prev : tail_) = op->prev;
  free_.push_back(op);
}

absl::Status OpTracker::Submit(Op* op, IssueFn issue) {
  if (queued_.empty() && in_flight_ < queue_depth_) {
    absl::StatusOr<bool> issued = issue(op);
    if (!issued.ok()) {
      Release(op);
      --live_;
      return issued.status();
    }
    if (*issued) {
      op->issued = true;
      ++in_flight_;
      return absl::OkStatus();
    }
  }
  queued_.push_back(op);
  return absl::OkStatus();
}

void OpTracker::Fill(Op* op, absl::Status status, Completion* c) {
  *c = Completion();
  c->kind = op->kind;
  c->endpoint = owner_;
  c->context = op->context;
  c->status = std::move(status);
  --live_;
}

bool OpTracker::Complete(Op* op, absl::Status status, Completion* c) {
  if (op->issued) --in_flight_;
  const bool report = !op->timed_out;
  if (report) Fill(op, std::move(status), c);
  Release(op);
  return report;
}

void OpTracker::Defer(Op* op, absl::Status status) {
  op->returned = true;
  deferred_.emplace_back(op, std::move(status));
}

void OpTracker::Orphan(absl::FunctionRef<void(Op*)> adopt) {
  for (Op* op = head_; op != nullptr;) {
    Op* next = op->next;
    if (op->issued && !op->returned) {
      op->tracker = nullptr;
      op->prev = op->next = nullptr;
      adopt(op);
    } else {
      delete op;
    }
    op = next;
  }
  head_ = tail_ = nullptr;
  queued_.clear();
  deferred_.clear();
  in_flight_ = 0;
  live_ = 0;
}

size_t OpTracker::Drain(IssueFn issue, absl::Span<Completion> out) {
  while (!queued_.empty() && in_flight_ < queue_depth_) {
    Op* op = queued_.front();
    absl::StatusOr<bool> issued = issue(op);
    if (issued.ok() && !*issued) break;  // still full
    queued_.pop_front();
    if (issued.ok()) {
      op->issued = true;
      ++in_flight_;
    } else {
      deferred_.emplace_back(op, issued.status());
    }
  }
  size_t produced = 0;
  while (!deferred_.empty() && produced < out.size()) {
    auto [op, status] = std::move(deferred_.front());
    deferred_.pop_front();
    if (Complete(op, std::move(status), &out[produced])) ++produced;
  }
  if (head_ == nullptr) return produced;
  const absl::Time deadline = CoarseNow() - op_timeout_;
  for (Op* next = head_; next != nullptr && produced < out.size();) {
    Op* op = std::exchange(next, next->next);
    if (op->posted > deadline) break;  // in posting order
    if (op->timed_out) continue;
    if (std::any_of(deferred_.begin(), deferred_.end(),
                    [op](const auto& d) { return d.first == op; })) {
      continue;  // reported with its own error above, when there is room
    }
    // One that never left this side says nothing of its peer: the queue it waited for was full,
    // held by operations to other peers (a shared completion queue) or to this one.
    Fill(op,
         absl::DeadlineExceededError(
             op->issued ? absl::StrCat(name_, ": operation did not complete within ",
                                       absl::FormatDuration(op_timeout_), "; the peer may be gone")
                        : absl::StrCat(name_, ": operation was not issued within ",
                                       absl::FormatDuration(op_timeout_),
                                       ": the send queue or the device's completion queue stayed "
                                       "full, held by operations to peers that do not complete "
                                       "them")),
         &out[produced++]);
    if (!op->issued) {
      queued_.erase(std::find(queued_.begin(), queued_.end(), op));
      Release(op);
    } else {
      op->timed_out = true;  // freed when the provider returns it, or with the tracker
    }
  }
  return produced;
}

}  // namespace tensorverbs::fabric
