// PendingOp: one operation a ShmemEndpoint accepted and has not completed yet, queued in posting
// order in its pending list, and CopyPhase, how far its device copy got. ShmemEndpoint owns the
// queue; DeviceCopyQueue moves an operation's phase on and SharedWrites and PeerConnection read
// it, all on the progress thread. Only ShmemEndpoint::RunPending completes one (once).
#ifndef TENSORVERBS_FABRIC_SHMEM_PENDING_OP_H_
#define TENSORVERBS_FABRIC_SHMEM_PENDING_OP_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "src/fabric/fabric.h"
#include "src/fabric/shmem/wire.h"

namespace tensorverbs::fabric::shmem {

class ShmemRegion;

// An operation's device copy: not started, running on the GPU, done, or refused.
enum class CopyPhase { kQueued, kCopying, kCopied, kFailed };

struct PendingOp {
  CompletionKind kind;
  bool with_imm;
  uint32_t imm;
  char* local;
  size_t length;
  PackedKey key;
  uint64_t remote_addr;
  uint64_t context;
  absl::Time posted;
  const ShmemRegion* local_region = nullptr;  // where the local buffer is registered
  int local_device = -1;                      // the local buffer is GPU memory of this ordinal
  bool device = false;  // either side is GPU memory: a device copy moves the bytes
  CopyPhase phase = CopyPhase::kQueued;
  uint64_t ticket = 0;
  absl::Status error;  // kFailed
  // GPU memory and the peer's private memory: the bytes go through the bounce buffer, a
  // chunk at a time; the chunk in flight is [bounce_done, bounce_done + bounce_chunk).
  bool bounce = false;
  size_t bounce_done = 0;
  size_t bounce_chunk = 0;
  int copy_device = 0;  // the GPU that runs the copies
};

}  // namespace tensorverbs::fabric::shmem

#endif  // TENSORVERBS_FABRIC_SHMEM_PENDING_OP_H_
