// ShmemEndpoint: one end of a connection of the same-host fabric (shmem.h says how the fabric
// works). The domain (shmem.cc) creates it and drives it from its progress thread: every
// method runs there, except that the descriptor server (domain_state.cc) finds it through
// DomainState and touches only its EndpointShared. It owns its inbound ring and the queue of
// operations posted to it, and completes each operation once, in posting order, to
// DomainState::local (Completion::endpoint is this endpoint); immediates that arrive in its ring
// come out of TakeInbound.
//
// Its parts, one concern each, are its members and live as long as it does:
// PeerConnection (peer_connection.h) the connection to the peer and the peer's ring we publish
// in; PeerMappings (peer_mappings.h) the peer's regions mapped and GPU allocations imported;
// DeviceCopyQueue (device_copy_queue.h) the device copies (DomainOptions::device_memory) and
// the bounce buffer; SharedWrites (shared_writes.h) the writes whose copy the peer's progress
// thread shares, both sides. The endpoint releases what they hold when destroyed, after the
// device copies it started have finished, and decides what a copy that never finished keeps.
#ifndef TENSORVERBS_FABRIC_SHMEM_ENDPOINT_H_
#define TENSORVERBS_FABRIC_SHMEM_ENDPOINT_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/fabric/endpoint_base.h"
#include "src/fabric/shmem/device_copy_queue.h"
#include "src/fabric/shmem/domain_state.h"
#include "src/fabric/shmem/peer_connection.h"
#include "src/fabric/shmem/peer_mappings.h"
#include "src/fabric/shmem/pending_op.h"
#include "src/fabric/shmem/shared_writes.h"
#include "src/fabric/shmem/wire.h"

namespace tensorverbs::fabric::shmem {

class ShmemEndpoint final : public EndpointBase {
 public:
  ShmemEndpoint(std::shared_ptr<DomainState> d, std::shared_ptr<EndpointShared> shared,
                absl::Duration op_timeout);

  ~ShmemEndpoint() override;

  std::string LocalAddress() const override;

  absl::Status Connect(absl::string_view peer_address) override;

  size_t Outstanding() const override { return outstanding_; }

  // Progress thread: runs queued operations, so what waits for room in the peer's ring goes
  // as soon as there is some, or fails when the peer is gone or the operation too old. Device
  // copies start as soon as they are queued and complete in posting order with the rest: an
  // immediate is published once the copies posted before it are done. Every endpoint's every
  // turn: an empty queue costs one check here (no device copy runs without its operation queued).
  void RunPending() {
    if (!pending_.empty()) RunQueued();
  }

  // Moves up to out.size() immediates that arrived into `out`. Every endpoint's every turn:
  // an empty ring costs one load here.
  size_t TakeInbound(absl::Span<Completion> out) {
    if (ring_broken_ || Atomic(in_->tail).load(std::memory_order_acquire) == in_head_) return 0;
    return TakeArrived(out);
  }

  // Whether our connection to the peer's descriptor server has closed: then the peer process
  // is gone even if it never connected back to us (which is how we usually learn it).
  void CheckConnection() { conn_.CheckConnection(); }

  int conn_fd() const { return conn_.conn_fd(); }
  // Whether the peer is known to be gone (or the connection broke): its hung-up connection
  // then has nothing more to say, and a sleep that still watched it would end at once.
  bool PeerKnownGone() const { return !conn_.Usable().ok(); }
  bool HasInbound() const;
  bool HasPending() const { return !pending_.empty(); }
  // Device copies this endpoint has running.
  int device_copies() const { return copies_.running(); }
  void SetSleeping(uint32_t v) { Atomic(in_->sleeping).store(v, std::memory_order_seq_cst); }
  // Progress thread, each Poll: copies the parts of the peer's shared write into our memory that
  // the peer has not claimed yet, if it offered one (SharedWrites::Help). A mapping it needs may
  // evict another only while no device copy runs, which may move bytes through any.
  void HelpWithSharedWrite() {
    if (ring_broken_) return;
    shares_.Help(/*may_evict=*/copies_.running() == 0);
  }
  void Delivered() { --outstanding_; }

 protected:
  absl::Status Post(CompletionKind kind, bool with_imm, uint32_t imm, const LocalBuffer& local,
                    const RemoteBuffer& remote, uint64_t context) override;

 private:
  // RunPending once an operation is queued.
  void RunQueued();

  // TakeInbound once the ring shows an entry.
  size_t TakeArrived(absl::Span<Completion> out);

  // Releases everything Connect acquired; the endpoint is unconnected afterwards.
  void Disconnect();

  // Moves host operation `op`'s bytes: through our mapping of the peer's region, shared with the
  // peer where SharedWrites says so, else by the kernel's cross-memory copy.
  absl::Status Copy(const PendingOp& op);

  void Complete(const PendingOp& op, absl::Status status);

  const absl::Duration op_timeout_;
  std::shared_ptr<DomainState> d_;
  std::shared_ptr<EndpointShared> shared_;
  RingHeader* const in_;
  uint64_t in_head_ = 0;
  bool ring_broken_ = false;

  std::deque<PendingOp> pending_;
  size_t outstanding_ = 0;

  // After d_ and shared_, which they refer to; each refers only to those declared before it.
  // Their destructors release nothing (~ShmemEndpoint does, in its order).
  PeerConnection conn_;
  PeerMappings mappings_;
  DeviceCopyQueue copies_;
  SharedWrites shares_;
};

}  // namespace tensorverbs::fabric::shmem

#endif  // TENSORVERBS_FABRIC_SHMEM_ENDPOINT_H_
