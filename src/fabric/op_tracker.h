// OpTracker: the bookkeeping every fabric backend needs for one endpoint's operations.
//
// It owns the operation records (pooled, so posting allocates nothing in steady state), keeps
// at most `queue_depth` of them in the provider at once and queues the rest, reports each
// operation exactly once — completed, failed, or timed out after `op_timeout` — and ignores the
// provider's late return of an operation it already reported. Backends supply how to issue an
// operation and translate their completions. Used only on the endpoint's progress thread.
#ifndef TENSORVERBS_FABRIC_OP_TRACKER_H_
#define TENSORVERBS_FABRIC_OP_TRACKER_H_

#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/fabric/fabric.h"

namespace tensorverbs::fabric {

class OpTracker;

struct Op {
  // Scratch space the backend hands to its library as the operation context (libfabric's
  // fi_context2). First, so the library's context pointer is the Op's address.
  alignas(16) unsigned char provider[64];
  // What a context handed back by the library is (ofi: an operation, or one of the backend's
  // own contexts laid out the same way); at the same offset in each, after `provider`.
  uint32_t context_tag = 0;
  CompletionKind kind = CompletionKind::kWrite;
  bool with_imm = false;
  uint32_t imm = 0;
  void* buf = nullptr;
  size_t len = 0;
  void* desc = nullptr;  // libfabric descriptor
  uint32_t lkey = 0;     // verbs local key
  uint64_t remote_addr = 0;
  uint64_t remote_key = 0;
  uint64_t context = 0;
  absl::Time posted;
  bool issued = false;       // handed to the provider
  bool data_posted = false;  // a write posted in two parts (ofi): its data part is posted
  bool timed_out = false;    // reported as DeadlineExceeded; the provider may still return it
  bool returned = false;     // the provider gave it back with an error not yet reported (Defer)
  void* aux = nullptr;       // a backend's second context for the operation (ofi: a split write)
  // The tracker that reported and frees it; null once its endpoint is gone and the record waits
  // for the provider to return it (Orphan).
  OpTracker* tracker = nullptr;
  Op* prev = nullptr;  // live ops, in posting order
  Op* next = nullptr;
};

class OpTracker {
 public:
  // Hands `op` to the provider: true if issued, false if the provider is full (retry later),
  // or an error (the operation failed).
  using IssueFn = absl::FunctionRef<absl::StatusOr<bool>(Op*)>;

  OpTracker(Endpoint* owner, size_t queue_depth, absl::Duration op_timeout, std::string name);
  OpTracker(const OpTracker&) = delete;
  OpTracker& operator=(const OpTracker&) = delete;
  ~OpTracker();

  // A fresh record of a post, stamped with the posting time; the backend adds its own fields
  // (descriptor or key, translated remote address), then Submits it.
  Op* NewOp(CompletionKind kind, bool with_imm, uint32_t imm, const LocalBuffer& local,
            const RemoteBuffer& remote, uint64_t context);
  // Issues `op` now if credits allow and nothing is queued, else queues it. An immediate
  // provider error forgets the op and is returned (the post failed; no completion follows).
  absl::Status Submit(Op* op, IssueFn issue);
  // The provider returned `op`: fills `c` unless the op was already reported; frees the record.
  bool Complete(Op* op, absl::Status status, Completion* c);
  // The provider returned `op` with an error where there is no room to report it now.
  void Defer(Op* op, absl::Status status);
  // Issues queued ops while credits allow, then reports deferred failures and timed-out ops.
  size_t Drain(IssueFn issue, absl::Span<Completion> out);

  size_t live() const { return live_; }

  // The endpoint is going while its provider endpoint stays (ofi's shared endpoints): the
  // records the provider still holds are handed to `adopt`, with `tracker` cleared, and must be
  // freed (delete) by whoever adopts them once the provider returns them or closes; the rest are
  // freed now, unreported, as the contract drops a destroyed endpoint's operations.
  void Orphan(absl::FunctionRef<void(Op*)> adopt);

 private:
  void Release(Op* op);
  void Fill(Op* op, absl::Status status, Completion* c);

  Endpoint* const owner_;
  const size_t queue_depth_;
  const absl::Duration op_timeout_;
  const std::string name_;
  Op* head_ = nullptr;
  Op* tail_ = nullptr;
  std::vector<Op*> free_;
  std::deque<Op*> queued_;
  std::deque<std::pair<Op*, absl::Status>> deferred_;
  size_t in_flight_ = 0;
  size_t live_ = 0;  // submitted and not yet reported
};

}  // namespace tensorverbs::fabric

#endif  // TENSORVERBS_FABRIC_OP_TRACKER_H_
