// Shared writes (shared_writes.h): the writer's side is SharedWrites::Copy, the reader's
// SharedWrites::Help.
//
// Why: one core copying 1 MiB tensors into a window of destinations that overflow its cache
// runs at about two thirds of a warm memcpy, while the receiver's progress thread polls on the
// other core with nothing to do. Two cores sharing the copy run well past one core's speed, and
// the receiver's thread is already awake and watching our ring, so no thread needs waking (the
// domain's copy threads' wake-up costs more than half of a 1 MiB copy saves).
#include "src/fabric/shmem/shared_writes.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/common/coarse_clock.h"
#include "src/common/mutex.h"
#include "src/common/sanitizers.h"
#include "src/common/status_macros.h"
#include "src/fabric/shmem/copy.h"
#include "src/fabric/shmem/region.h"
#include "src/fabric/shmem/shmem.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tensorverbs::fabric::shmem {
namespace {

inline void CpuRelax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// Part `index` of a write of `length` bytes in parts of `part`, from `src` to `dst`.
void CopyPart(char* dst, const char* src, uint64_t length, uint64_t part, uint64_t index,
              bool streaming) {
  const uint64_t offset = index * part;
  const size_t n = static_cast<size_t>(std::min(part, length - offset));
  if (streaming) {
    StreamingCopy(dst + offset, src + offset, n);  // fenced: ordered before what follows
  } else {
    std::memcpy(dst + offset, src + offset, n);
  }
}

// What both sides of one ring tell TSan their order by (sanitizers.h): the ring's inode.
const void* TsanKey(uint64_t ring_inode) {
  static char keys[64];
  return &keys[ring_inode % sizeof(keys)];
}

}  // namespace

bool SharedWrites::ShouldShare(const PendingOp& op) const {
  return d_.peer_copy && op.length >= kMinSharedWriteBytes && !d_.copy_helpers->Shares(op.length) &&
         op.local_region != nullptr && op.local_region->shared() &&
         Atomic(conn_.out()->sleeping).load(std::memory_order_relaxed) == 0;
}

absl::Status SharedWrites::Copy(const PendingOp& op, char* there) {
  {
    MutexLock lock(&d_.mu);  // once per write of 512 KiB or more
    shared_.lent_for_reading.insert(op.local_region->id());
  }
  const uint64_t length = op.length;
  const uint64_t part =
      std::max<uint64_t>(kMinSharedWritePart, (length / kMaxSharedWriteParts + 4095) / 4096 * 4096);
  const uint64_t parts = (length + part - 1) / part;
  const bool streaming = length >= kStreamingCopyBytes;
  SharedWrite& w = conn_.out()->share;
  // Never seq 0, which a ring that saw no shared write holds.
  if ((++share_seq_ & kSharedWritePartMask) == 0) ++share_seq_;
  const uint64_t seq = share_seq_ & kSharedWritePartMask;
  const PackedKey key = op.local_region->Key();
  uint64_t words[sizeof(PackedKey) / 8];
  std::memcpy(words, &key, sizeof(key));
  for (size_t i = 0; i < std::size(words); ++i) {
    Atomic(w.src_key[i]).store(words[i], std::memory_order_relaxed);
  }
  Atomic(w.src_addr).store(reinterpret_cast<uint64_t>(op.local), std::memory_order_relaxed);
  Atomic(w.dst_region).store(op.key.region, std::memory_order_relaxed);
  Atomic(w.dst_addr).store(op.remote_addr, std::memory_order_relaxed);
  Atomic(w.length).store(length, std::memory_order_relaxed);
  Atomic(w.part).store(static_cast<uint32_t>(part), std::memory_order_relaxed);
  Atomic(w.parts).store(static_cast<uint32_t>(parts), std::memory_order_relaxed);
  Atomic(w.streaming).store(streaming ? 1u : 0u, std::memory_order_relaxed);
  Atomic(w.done).store(0, std::memory_order_relaxed);
  TsanRelease(TsanKey(conn_.out_ring_inode()));
  Atomic(w.state).store(seq << 32, std::memory_order_release);  // the job is on offer
  // Claim parts until none is left. The peer's ring is the peer's memory: whatever it does to
  // `state`, we copy each of our parts at most once and only within this write.
  uint64_t mine = 0;
  for (uint64_t claims = 0; claims < parts; ++claims) {
    const uint64_t s = Atomic(w.state).fetch_add(1, std::memory_order_acq_rel);
    const uint64_t index = s & kSharedWritePartMask;
    if ((s >> 32) != seq || index >= parts) break;
    CopyPart(there, op.local, length, part, index, streaming);
    ++mine;
  }
  Counters().shared_write_ops.fetch_add(1, std::memory_order_relaxed);
  if (mine == parts) return absl::OkStatus();
  Counters().shared_write_helped_ops.fetch_add(1, std::memory_order_relaxed);
  return AwaitPeerParts(parts - mine);
}

absl::Status SharedWrites::AwaitPeerParts(uint64_t parts) {
  SharedWrite& w = conn_.out()->share;
  const absl::Time start = CoarseNow();
  // A part takes microseconds; the peer's thread may be preempted mid-part, so after a while
  // this yields its core, and every 16 yields looks whether the peer is still there and the
  // time is up. On a loaded machine one yield can give the core away for a whole time slice:
  // looking every 65,536 yields, as it did, let a stalled reader hold a write seconds past the
  // timeout.
  for (uint64_t spins = 0; Atomic(w.done).load(std::memory_order_acquire) < parts; ++spins) {
    if (spins < 4096) {
      CpuRelax();
      continue;
    }
    sched_yield();
    if (spins % 16 != 0) continue;
    conn_.CheckConnection();
    RETURN_IF_ERROR(conn_.Usable());
    if (CoarseNow() - start > op_timeout_) {
      return conn_.Break(absl::DeadlineExceededError(
          absl::StrCat("shmem: the peer of ", conn_.LocalAddress(), " (pid ", conn_.peer_pid(),
                       ") claimed part of a shared write and did not finish it within ",
                       absl::FormatDuration(op_timeout_))));
    }
  }
  TsanAcquire(TsanKey(conn_.out_ring_inode()));
  return absl::OkStatus();
}

namespace {
std::atomic<void (*)()> claim_hook_for_testing{nullptr};
}  // namespace

void SetClaimHookForTesting(void (*hook)()) { claim_hook_for_testing.store(hook); }

void SharedWrites::HelpWithOffer(bool may_evict) {
  // ShmemEndpoint::HelpWithSharedWrite checked that our inbound ring is still trusted.
  if (!d_.peer_copy || !conn_.connected() || conn_.broken()) return;
  SharedWrite& w = in_->share;
  uint64_t s = Atomic(w.state).load(std::memory_order_acquire);
  const uint64_t seq = s >> 32;
  const uint64_t parts = Atomic(w.parts).load(std::memory_order_relaxed);
  if ((s & kSharedWritePartMask) >= parts || seq == refused_seq_) return;  // nothing on offer
  // The fields as they were at `s`, unless the peer has moved on to its next write since: then
  // no claim below succeeds, and what they said is never used.
  uint64_t words[sizeof(PackedKey) / 8];
  for (size_t i = 0; i < std::size(words); ++i) {
    words[i] = Atomic(w.src_key[i]).load(std::memory_order_relaxed);
  }
  PackedKey key;
  std::memcpy(&key, words, sizeof(key));
  const uint64_t src_addr = Atomic(w.src_addr).load(std::memory_order_relaxed);
  const uint64_t dst_region = Atomic(w.dst_region).load(std::memory_order_relaxed);
  const uint64_t dst_addr = Atomic(w.dst_addr).load(std::memory_order_relaxed);
  const uint64_t length = Atomic(w.length).load(std::memory_order_relaxed);
  const uint64_t part = Atomic(w.part).load(std::memory_order_relaxed);
  const bool streaming = Atomic(w.streaming).load(std::memory_order_relaxed) != 0;
  // Refuse what we could not copy safely: the bytes must come from inside the peer's key and
  // land inside one of our regions that a peer may write.
  bool sound = length > 0 && part > 0 && parts == (length + part - 1) / part &&
               parts <= kMaxSharedWriteParts && key.magic == kKeyMagic &&
               key.domain == conn_.peer_uid() && (key.flags & kKeyShared) != 0 &&
               (key.flags & kKeyDevice) == 0 && RangeInside(src_addr, length, key.base, key.length);
  if (sound) {
    MutexLock lock(&d_.mu);
    auto it = d_.regions.find(dst_region);
    sound = it != d_.regions.end() && it->second.fd >= 0 &&
            (it->second.access & kAccessRemoteWrite) != 0 &&
            RangeInside(dst_addr, length, it->second.base, it->second.length);
  }
  // Also what a torn read of a job being replaced looks like: refused only if still on offer.
  auto refuse = [&] {
    if ((Atomic(w.state).load(std::memory_order_acquire) >> 32) == seq) refused_seq_ = seq;
  };
  if (!sound) return refuse();
  // d_.mu is released: Map may ask the peer.
  absl::StatusOr<PeerMappings::Mapping*> m = mappings_.Map(key, src_addr, length, may_evict);
  if (!m.ok()) return refuse();
  const char* src = reinterpret_cast<const char*>(src_addr + (*m)->delta);
  char* dst = reinterpret_cast<char*>(dst_addr);
  uint64_t copied = 0;
  // At most `parts` claims: a peer that keeps resetting `state` cannot keep us copying.
  for (uint64_t claims = 0;
       claims < parts && (s >> 32) == seq && (s & kSharedWritePartMask) < parts;) {
    if (!Atomic(w.state).compare_exchange_weak(s, s + 1, std::memory_order_acq_rel,
                                               std::memory_order_acquire)) {
      continue;  // `s` is the state now
    }
    ++claims;
    if (auto* hook = claim_hook_for_testing.load(std::memory_order_relaxed)) hook();
    TsanAcquire(TsanKey(in_ring_inode_));
    CopyPart(dst, src, length, part, s & kSharedWritePartMask, streaming);
    TsanRelease(TsanKey(in_ring_inode_));
    Atomic(w.done).fetch_add(1, std::memory_order_release);
    copied += std::min(part, length - (s & kSharedWritePartMask) * part);
    ++s;
  }
  if (copied > 0) Counters().shared_write_bytes_copied.fetch_add(copied, std::memory_order_relaxed);
}

}  // namespace tensorverbs::fabric::shmem
