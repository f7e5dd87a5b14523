// GdrPull: grpc+gdr's receiving side of one tensor over a channel the receiver owns. The
// meta-data came in the gRPC RecvTensor response (a RemoteTensorRef); the pull reads the bytes
// with RDMA reads (in pieces of at most kMaxTransferPiece) into the destination, or into a
// registered proxy when the destination is not registered, then releases the sender's tensor
// with a zero-byte write whose immediate is the tensor key. A pull with no destination (the
// receiver refused the tensor) only releases it, and so does one that ends before reading
// (its deadline passed while queued, the destination cannot be read into): no tensor waits at
// the sender for its lease to end.
//
// Its rows are one table, kPullTable in gdr_pull.cc (state_table.h; drawn in
// docs/architecture/state-machines.md): Issue posts the reads (kReading) or, with nothing to
// read, releases at once (kDone); the last read releases and delivers (kDone); a close ends it
// in any state. Whether `done` has run (the recv ended: deadline, close) is beside the state,
// not a state: a pull that ended while reading keeps its memory until its reads complete or
// the channel closes.
//
// Owned by its channel's ReceivingSide (by request index, from the same index space as recvs);
// every method runs on the transport's progress thread. `done` runs exactly once, on the progress
// thread. A pull that ends early (deadline, channel closed) keeps its memory until its reads
// complete or the channel closes.
#ifndef TENSORVERBS_PROTOCOL_GDR_PULL_H_
#define TENSORVERBS_PROTOCOL_GDR_PULL_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "src/common/state_table.h"
#include "src/protocol/remote_tensor.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::protocol {

class Channel;
class ReceivingSide;

class GdrPull {
 public:
  using Done = absl::AnyInvocable<void(const absl::Status&) &&>;
  enum class State { kQueued, kReading, kDone };
  static constexpr int kStates = 3;
  enum class Event { kIssue, kReadDone, kClose };
  static constexpr int kEvents = 3;

  GdrPull(ReceivingSide* side, uint32_t index, RemoteTensorRef ref, Tensor dest,
          absl::Time deadline, Done done);

  // Posts the reads. When nothing could be posted it ends the pull and the receiving side
  // forgets it; when a read fails midway it closes the channel.
  void Issue();
  // One read completed; after the last, releases the tensor at the sender, ends the pull and
  // the channel forgets it.
  void OnReadDone();
  // Runs `done` with `status` if it has not run.
  void End(const absl::Status& status);
  // The channel closed: the machine ends (after End, which tells the recv).
  void Closed();

  bool finished() const { return !done_; }
  State state() const { return state_; }
  absl::Time deadline() const { return deadline_; }
  // The memory the reads may still write into.
  std::vector<Tensor> TakeMemory();

 private:
  // Ends the pull with `status` (nullopt: the release's own outcome, for a pull with nothing
  // to read), releases the tensor at the sender and has the channel forget it; nothing was
  // posted.
  void FinishUnread(std::optional<absl::Status> status);
  // Posts the zero-byte write that lets the sender drop the tensor.
  absl::Status PostRelease();
  static absl::Status ReleaseFailed(const Channel* channel, const absl::Status& status);
  // The one place the state changes; checks in debug and sanitizer builds that the move is a
  // row of kPullTable.
  void TransitionTo(State next, Event event);

  ReceivingSide* const side_;
  Channel* const channel_;  // side_'s
  const uint32_t index_;
  const RemoteTensorRef ref_;
  Tensor dest_;
  Tensor staging_;  // registered proxy when dest is not registered
  const absl::Time deadline_;
  Done done_;
  int reads_left_ = 0;
  State state_ = State::kQueued;
};

// The table, for the diagrams and the tests.
StateTableView PullStateTable();

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_GDR_PULL_H_
