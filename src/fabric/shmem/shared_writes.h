// SharedWrites: both sides of a ShmemEndpoint's shared writes (wire.h's SharedWrite), host
// writes whose copy the peer's progress thread helps with. As the writer it offers a large
// write in the peer's ring, copies the parts the peer does not claim and waits for those it did
// (Copy); as the reader it copies the parts of the peer's offer in our ring that the peer has not
// claimed yet (Help). The two sides run on their domains' progress threads, in two processes
// (or two domains of one), and order the bytes by the ring's `state` and `done` words.
//
// Owned by ShmemEndpoint and called by it on the progress thread. It takes DomainState::mu for
// a moment (to lend a source region, and to look up a destination region) and never holds it
// while calling another part, so nothing under it asks the peer anything. No callbacks; a peer
// that stops mid-write breaks the endpoint's PeerConnection.
#ifndef TENSORVERBS_FABRIC_SHMEM_SHARED_WRITES_H_
#define TENSORVERBS_FABRIC_SHMEM_SHARED_WRITES_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "src/fabric/shmem/domain_state.h"
#include "src/fabric/shmem/peer_connection.h"
#include "src/fabric/shmem/peer_mappings.h"
#include "src/fabric/shmem/pending_op.h"
#include "src/fabric/shmem/wire.h"

namespace tensorverbs::fabric::shmem {

// Host writes of at least this many bytes (and below what CopyHelpers shares) are offered to
// the peer to copy part of (SharedWrite): its progress thread, polling anyway on another core,
// copies parts into its own memory while this one copies the rest. At 256 KiB sharing cost
// more than it saved (docs/perf/history.md: the single recv's latency 7 -> 12 us).
inline constexpr size_t kMinSharedWriteBytes = size_t{512} << 10;
// A shared write's parts: at least this many bytes, and at most kMaxSharedWriteParts of them.
inline constexpr size_t kMinSharedWritePart = size_t{64} << 10;
inline constexpr uint32_t kMaxSharedWriteParts = 8;
// SharedWrite::state: the write's sequence number in the high half, the next part to claim in
// the low half.
inline constexpr uint64_t kSharedWritePartMask = 0xffffffffu;

// Tests only: a function the reader runs after each part of a peer's shared write it claims,
// before it copies it: how a test makes a reader stall mid-part. Null (none) unless a test
// sets one; process-wide.
void SetClaimHookForTesting(void (*hook)());

class SharedWrites {
 public:
  // All references are the endpoint's and outlive this. `in` is the endpoint's inbound ring,
  // whose SharedWrite the peer offers its writes in; `in_ring_inode` its memfd's inode, which
  // the peer's mapping of it has too (the key both sides tell TSan their order by).
  SharedWrites(DomainState& d, EndpointShared& shared, PeerConnection& conn, PeerMappings& mappings,
               RingHeader* in, uint64_t in_ring_inode, absl::Duration op_timeout)
      : d_(d),
        shared_(shared),
        conn_(conn),
        mappings_(mappings),
        in_(in),
        in_ring_inode_(in_ring_inode),
        op_timeout_(op_timeout) {}
  SharedWrites(const SharedWrites&) = delete;
  SharedWrites& operator=(const SharedWrites&) = delete;

  // Whether host write `op` is offered to the peer to share (kMinSharedWriteBytes says why):
  // its source is our shareable memory, and the peer is polling (not asleep on its doorbell).
  bool ShouldShare(const PendingOp& op) const;

  // Writes `op`'s bytes to `there` (our mapping of the peer's memory) with the peer: publishes
  // the job in the peer's ring, copies every part the peer has not claimed, and waits for the
  // parts it did. The peer then reads the source through a read-only mapping of its region,
  // lent to this endpoint's peer alone (EndpointShared::lent_for_reading).
  absl::Status Copy(const PendingOp& op, char* there);

  // Copies the parts of the peer's shared write into our memory that the peer has not claimed
  // yet, if it offered one. A write it describes wrongly (a destination that is not our
  // shareable, remotely writable memory; a source outside its key) is left to the peer to copy
  // alone. `may_evict`: mapping the source may evict another mapping (no device copy runs).
  // Runs on every endpoint each turn, so the usual case, nothing on offer, is two loads here.
  void Help(bool may_evict) {
    SharedWrite& w = in_->share;
    const uint64_t s = Atomic(w.state).load(std::memory_order_acquire);
    if ((s & kSharedWritePartMask) >= Atomic(w.parts).load(std::memory_order_relaxed)) return;
    HelpWithOffer(may_evict);
  }

 private:
  // Help once the peer's ring shows a part unclaimed.
  void HelpWithOffer(bool may_evict);

  // Waits for `parts` parts of a shared write the peer claimed; fails if the peer goes or
  // takes longer than the operation timeout.
  absl::Status AwaitPeerParts(uint64_t parts);

  DomainState& d_;
  EndpointShared& shared_;
  PeerConnection& conn_;
  PeerMappings& mappings_;
  RingHeader* const in_;
  // The inode of our inbound ring: the same ring has the same one on both sides, which Copy
  // (with the peer's, PeerConnection::out_ring_inode) and Help tell TSan their order by.
  const uint64_t in_ring_inode_;
  const absl::Duration op_timeout_;
  // The sequence number of our last shared write, and the last one of the peer's we refused to
  // help with.
  uint64_t share_seq_ = 0;
  uint64_t refused_seq_ = 0;
};

}  // namespace tensorverbs::fabric::shmem

#endif  // TENSORVERBS_FABRIC_SHMEM_SHARED_WRITES_H_
