#include "src/fabric/shmem/endpoint.h"

#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "src/common/coarse_clock.h"
#include "src/common/logging.h"
#include "src/common/mutex.h"
#include "src/common/status_macros.h"
#include "src/fabric/shmem/copy.h"
#include "src/fabric/shmem/region.h"
#include "src/fabric/shmem/shmem.h"

namespace tensorverbs::fabric::shmem {
namespace {

// The inode of the memfd `fd`, or 0 if unknown: what both sides of a ring tell TSan their
// order by (SharedWrites).
uint64_t InodeOf(int fd) {
  struct stat st {};
  if (fstat(fd, &st) == 0) return st.st_ino;
  return 0;
}

}  // namespace

ShmemEndpoint::ShmemEndpoint(std::shared_ptr<DomainState> d, std::shared_ptr<EndpointShared> shared,
                             absl::Duration op_timeout)
    : op_timeout_(op_timeout),
      d_(std::move(d)),
      shared_(std::move(shared)),
      in_(static_cast<RingHeader*>(shared_->ring->data())),
      conn_(*d_, *shared_),
      mappings_(conn_, d_->device.get(), d_->peer_window_bytes),
      copies_(conn_, mappings_, d_->device.get()),
      shares_(*d_, *shared_, conn_, mappings_, in_, InodeOf(shared_->ring->fd()), op_timeout) {
  d_->live.push_back(this);
}

ShmemEndpoint::~ShmemEndpoint() {
  // Copies the GPU still runs read or write memory this endpoint maps: they finish first.
  copies_.Drain(pending_);
  {
    MutexLock lock(&d_->mu);
    d_->endpoints.erase(shared_->id);
    // The peer that writes into our ring learns at once that nobody reads it any more.
    if (shared_->client_fd >= 0) shutdown(shared_->client_fd, SHUT_RDWR);
  }
  auto& live = d_->live;
  live.erase(std::remove(live.begin(), live.end(), this), live.end());
  // Completions of this endpoint, delivered or not, die with it (as on every backend).
  auto& q = d_->local;
  q.erase(
      std::remove_if(q.begin(), q.end(), [&](const Completion& c) { return c.endpoint == this; }),
      q.end());
  Disconnect();
}

std::string ShmemEndpoint::LocalAddress() const { return conn_.LocalAddress(); }

absl::Status ShmemEndpoint::Connect(absl::string_view peer_address) {
  if (conn_.connected()) {
    return absl::FailedPreconditionError("shmem: endpoint already connected");
  }
  std::vector<absl::string_view> parts = absl::StrSplit(peer_address, ':');
  uint64_t uid = 0, id = 0;
  if (parts.size() != 3 || parts[0] != "shmem" || !absl::SimpleHexAtoi(parts[1], &uid) ||
      !absl::SimpleAtoi(parts[2], &id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shmem: '", absl::CHexEscape(peer_address), "' is not a shmem address"));
  }
  absl::Status s = conn_.Open(uid, id, peer_address);
  if (!s.ok()) {
    Disconnect();
    return absl::Status(s.code(), absl::StrCat(s.message(), " (connecting to ", peer_address, ")"));
  }
  return absl::OkStatus();
}

void ShmemEndpoint::RunQueued() {
  copies_.StartQueued(pending_);
  copies_.Poll(pending_);
  while (!pending_.empty()) {
    PendingOp& op = pending_.front();
    if (op.phase == CopyPhase::kCopying) return;  // the GPU is still copying
    absl::Status status = op.phase == CopyPhase::kFailed ? op.error : conn_.Usable();
    if (status.ok() && op.phase == CopyPhase::kQueued && op.device) {
      copies_.Start(op);  // only when more were in flight than StartQueued starts
      if (op.phase == CopyPhase::kCopying || op.phase == CopyPhase::kQueued) return;
      if (op.phase == CopyPhase::kFailed) status = op.error;
    }
    if (status.ok() && op.with_imm && conn_.RingFull()) {
      if (conn_.RingInconsistent()) {
        status = conn_.Break(absl::DataLossError("shmem: the peer left its ring inconsistent"));
      } else if (CoarseNow() - op.posted < op_timeout_) {
        return;  // the peer has not consumed yet; retried from Poll
      } else {
        status = absl::DeadlineExceededError(absl::StrCat("shmem: the peer of ", LocalAddress(),
                                                          " took no immediate for ",
                                                          absl::FormatDuration(op_timeout_)));
      }
    } else if (status.ok()) {
      if (op.phase == CopyPhase::kQueued) status = Copy(op);
      if (status.ok() && op.with_imm) conn_.Publish(op.imm, op.length);
    }
    Complete(op, std::move(status));
    pending_.pop_front();
  }
}

size_t ShmemEndpoint::TakeArrived(absl::Span<Completion> out) {
  const uint64_t tail = Atomic(in_->tail).load(std::memory_order_acquire);
  if (tail - in_head_ > kRingCapacity) {
    LOG(ERROR) << "shmem: endpoint " << LocalAddress()
               << ": the peer left its ring inconsistent; ignoring it from now on";
    ring_broken_ = true;
    return 0;
  }
  size_t n = 0;
  while (n < out.size() && in_head_ != tail) {
    RingEntry& e = Entries(in_)[in_head_ % kRingCapacity];
    Completion& c = out[n++];
    c = Completion();
    c.kind = CompletionKind::kRemoteWriteImm;
    c.endpoint = this;
    c.imm = Atomic(e.imm).load(std::memory_order_relaxed);
    c.byte_len = Atomic(e.byte_len).load(std::memory_order_relaxed);
    ++in_head_;
  }
  if (n > 0) Atomic(in_->head).store(in_head_, std::memory_order_release);
  return n;
}

bool ShmemEndpoint::HasInbound() const {
  return !ring_broken_ && Atomic(in_->tail).load(std::memory_order_seq_cst) != in_head_;
}

absl::Status ShmemEndpoint::Post(CompletionKind kind, bool with_imm, uint32_t imm,
                                 const LocalBuffer& local, const RemoteBuffer& remote,
                                 uint64_t context) {
  if (remote.key.size() != sizeof(PackedKey)) {
    return absl::InvalidArgumentError("shmem: malformed remote key");
  }
  PackedKey key;
  std::memcpy(&key, remote.key.data(), sizeof(key));
  if (key.magic != kKeyMagic) return absl::InvalidArgumentError("shmem: malformed remote key");
  RETURN_IF_ERROR(CheckRanges("shmem", local, remote, key.base, key.length));
  if (!conn_.connected()) return absl::FailedPreconditionError("shmem: endpoint is not connected");
  if (key.domain != conn_.peer_uid()) {
    return absl::InvalidArgumentError(
        "shmem: the remote key belongs to another domain than this endpoint's peer");
  }
  const uint32_t needed = kind == CompletionKind::kRead ? kAccessRemoteRead : kAccessRemoteWrite;
  if ((key.access & needed) == 0) {
    return absl::PermissionDeniedError("shmem: the remote region does not allow this access");
  }
  RETURN_IF_ERROR(conn_.Usable());
  PendingOp op;
  op.kind = kind;
  op.with_imm = with_imm;
  op.imm = imm;
  op.local = static_cast<char*>(local.addr);
  op.length = local.length;
  // Regions passed to this endpoint are this domain's (CheckRanges held them to their range).
  op.local_region = static_cast<const ShmemRegion*>(local.region);
  op.local_device = op.local_region != nullptr ? op.local_region->device() : -1;
  op.device = local.length > 0 && (op.local_device >= 0 || (key.flags & kKeyDevice) != 0);
  op.key = key;
  op.remote_addr = remote.addr;
  op.context = context;
  op.posted = CoarseNow();  // for a timeout of seconds, on every post: the cheap clock
  pending_.push_back(op);
  ++outstanding_;
  RunPending();
  return absl::OkStatus();
}

void ShmemEndpoint::Disconnect() {
  // A device copy that never finished (Drain gave up) may still touch the peer's memory we
  // map and the bounce buffer: forget them rather than release them under it.
  if (copies_.leaked()) {
    mappings_.Abandon();
    copies_.AbandonBounce();
  }
  copies_.ReleaseBounce();
  mappings_.ReleaseAll();
  conn_.Close();
}

absl::Status ShmemEndpoint::Copy(const PendingOp& op) {
  if (op.length == 0) return absl::OkStatus();
  const bool read = op.kind == CompletionKind::kRead;
  if (op.key.flags & kKeyShared) {
    // A device copy may move bytes through any mapping: none is evicted while one runs.
    ASSIGN_OR_RETURN(PeerMappings::Mapping * m,
                     mappings_.Map(op.key, op.remote_addr, op.length,
                                   /*may_evict=*/copies_.running() == 0));
    if (!read && !m->writable) {
      return absl::PermissionDeniedError("shmem: the peer mapped this region read-only");
    }
    char* there = reinterpret_cast<char*>(op.remote_addr + m->delta);
    if (read) {
      d_->copy_helpers->Copy(op.local, there, op.length, /*streaming=*/false);
    } else if (shares_.ShouldShare(op)) {
      RETURN_IF_ERROR(shares_.Copy(op, there));
    } else {
      d_->copy_helpers->Copy(there, op.local, op.length, op.length >= kStreamingCopyBytes);
    }
    Counters().mapped_ops.fetch_add(1, std::memory_order_relaxed);
    Counters().mapped_bytes.fetch_add(op.length, std::memory_order_relaxed);
    return absl::OkStatus();
  }
  return conn_.CrossMemory(op, op.local, 0, op.length);
}

void ShmemEndpoint::Complete(const PendingOp& op, absl::Status status) {
  Completion c;
  c.kind = op.kind;
  c.endpoint = this;
  c.context = op.context;
  c.status = std::move(status);
  d_->local.push_back(std::move(c));
}

}  // namespace tensorverbs::fabric::shmem
