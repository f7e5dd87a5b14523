// DeviceCopyQueue: a ShmemEndpoint's device copies (DomainOptions::device_memory): it starts the
// GPU copy of each queued operation with GPU memory on either side, polls the copies the GPU
// runs and counts them, and owns the page-locked bounce buffer that copies between GPU memory and
// a peer's private memory go through.
//
// Owned by ShmemEndpoint, which owns the operations: the queue only moves an operation's phase on
// (kCopying, then kCopied or kFailed) and never completes one; RunPending does, in posting order.
// Progress thread only; no lock, no callbacks. Its destructor releases nothing: the endpoint
// drains the copies first (Drain) and then releases the bounce buffer (ReleaseBounce), or
// forgets it if a copy never finished (leaked(), AbandonBounce).
#ifndef TENSORVERBS_FABRIC_SHMEM_DEVICE_COPY_QUEUE_H_
#define TENSORVERBS_FABRIC_SHMEM_DEVICE_COPY_QUEUE_H_

#include <cstddef>
#include <deque>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/fabric/device_memory.h"
#include "src/fabric/shmem/peer_connection.h"
#include "src/fabric/shmem/peer_mappings.h"
#include "src/fabric/shmem/pending_op.h"

namespace tensorverbs::fabric::shmem {

// A bounced operation (GPU memory and a peer's private memory) moves in chunks of at most this
// many bytes, so its buffer stays small and page-locked once.
inline constexpr size_t kMaxBounceBytes = size_t{8} << 20;

class DeviceCopyQueue {
 public:
  // `conn` and `mappings` are the endpoint's; `device` the domain's GPU runtime (null: host
  // memory only, and every device copy fails). All outlive this.
  DeviceCopyQueue(PeerConnection& conn, PeerMappings& mappings, DeviceMemory* device)
      : conn_(conn), mappings_(mappings), device_(device) {}
  DeviceCopyQueue(const DeviceCopyQueue&) = delete;
  DeviceCopyQueue& operator=(const DeviceCopyQueue&) = delete;

  // Device copies the GPU still runs (a bounced operation counts once, whichever chunk runs).
  int running() const { return running_; }
  // Whether Drain gave up on a copy: what it may touch must stay mapped.
  bool leaked() const { return leak_device_memory_; }

  // Starts every queued device copy, up to kMaxDeviceCopies running, also past host operations
  // queued ahead of them (control messages between tensors): the GPU then runs one copy after
  // another with no gap for the completions in between. Completions and immediates still go in
  // posting order (RunPending); only the bytes of a device write may land before those of a host
  // write posted earlier, which the protocol never aims at the same memory.
  void StartQueued(std::deque<PendingOp>& pending);

  // Starts `op`'s device copy: kCopying, or kFailed with the reason. Leaves `op` queued while an
  // earlier bounced operation holds the bounce buffer.
  void Start(PendingOp& op);

  // Moves every finished device copy on (kCopied, or kFailed with its error), wherever it is in
  // the queue: running() counts the copies the GPU still runs, so a copy that finished behind a
  // host write waiting for ring room no longer keeps the progress thread polling.
  void Poll(std::deque<PendingOp>& pending);

  // Waits (up to 10 s) for the device copies still running, at teardown. Memory a copy that
  // never finished may still touch is then left mapped and imported: a leak, not a fault.
  void Drain(std::deque<PendingOp>& pending);

  void ReleaseBounce();
  // Forgets the bounce buffer without unmapping it: a copy may still use it.
  void AbandonBounce();

 private:
  // At most this many device copies in flight per endpoint.
  static constexpr int kMaxDeviceCopies = 64;

  // The peer's side of a device copy.
  absl::StatusOr<DeviceMemory::Side> RemoteSide(const PendingOp& op, int device);

  // Local GPU memory and the peer's private memory (a region that is not from its pool): the
  // kernel's cross-memory copy cannot reach GPU memory, so the bytes go through the page-locked
  // bounce buffer, one operation at a time, in chunks of at most kMaxBounceBytes. A write copies
  // a chunk device-to-host into it, then (Poll) to the peer; a read copies a chunk from the peer
  // into it, then host-to-device. Leaves `op` queued while an earlier operation holds the buffer.
  void StartBounced(PendingOp& op, int device);

  // A bounce buffer of at least `bytes` (at most kMaxBounceBytes are asked for), page-locked
  // where the runtime allows (else its copies are synchronous, and still correct). It grows to
  // the largest chunk and stays until the endpoint closes.
  absl::Status EnsureBounce(size_t bytes);

  // A bounced operation's chunk copy ended with `copied`: a write's chunk goes on to the peer
  // if it succeeded and the peer may still be written (a failed copy left nothing worth
  // sending), and the next chunk starts. Returns the operation's outcome so far.
  absl::Status FinishBounceChunk(PendingOp& op, absl::Status copied);
  // Starts the device copy of bounced `op`'s next chunk (a read brings it from the peer first).
  absl::Status StartBounceChunk(PendingOp& op);

  absl::Status DeviceError(const PendingOp& op, const absl::Status& s) const;

  PeerConnection& conn_;
  PeerMappings& mappings_;
  DeviceMemory* const device_;
  int running_ = 0;
  bool leak_device_memory_ = false;  // a copy never finished: keep what it may touch
  // The bounce buffer between GPU memory and peers' private memory (StartBounced).
  char* bounce_ = nullptr;
  size_t bounce_bytes_ = 0;
  bool bounce_pinned_ = false;
  bool bounce_busy_ = false;
};

}  // namespace tensorverbs::fabric::shmem

#endif  // TENSORVERBS_FABRIC_SHMEM_DEVICE_COPY_QUEUE_H_
