#include "src/fabric/shmem/device_copy_queue.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"
#include "src/fabric/shmem/shmem.h"
#include "src/fabric/shmem/wire.h"

namespace tensorverbs::fabric::shmem {

void DeviceCopyQueue::StartQueued(std::deque<PendingOp>& pending) {
  if (running_ >= kMaxDeviceCopies || !conn_.Usable().ok()) return;
  for (PendingOp& op : pending) {
    if (running_ >= kMaxDeviceCopies) break;
    if (op.device && op.phase == CopyPhase::kQueued) Start(op);
  }
}

void DeviceCopyQueue::Start(PendingOp& op) {
  auto fail = [&](const absl::Status& s) {
    op.phase = CopyPhase::kFailed;
    op.error = DeviceError(op, s);
  };
  if (device_ == nullptr) {
    fail(absl::FailedPreconditionError("this process has no GPU runtime"));
    return;
  }
  // The local GPU that runs the copy: the local buffer's, else device 0 (the peer's ordinal
  // names a GPU in its process, which may be another one here, or none).
  const int device = op.local_device >= 0 ? op.local_device : 0;
  if ((op.key.flags & (kKeyDevice | kKeyShared)) == 0) {
    StartBounced(op, device);
    return;
  }
  absl::StatusOr<DeviceMemory::Side> remote = RemoteSide(op, device);
  if (!remote.ok()) {
    fail(remote.status());
    return;
  }
  const DeviceMemory::Side local{op.local, op.local_device >= 0};
  const bool read = op.kind == CompletionKind::kRead;
  absl::StatusOr<uint64_t> ticket =
      device_->StartCopy(device, read ? local : *remote, read ? *remote : local, op.length);
  if (!ticket.ok()) {
    fail(ticket.status());
    return;
  }
  op.ticket = *ticket;
  op.phase = CopyPhase::kCopying;
  ++running_;
  Counters().device_ops.fetch_add(1, std::memory_order_relaxed);
  Counters().device_bytes.fetch_add(op.length, std::memory_order_relaxed);
}

void DeviceCopyQueue::Poll(std::deque<PendingOp>& pending) {
  if (running_ == 0) return;
  for (PendingOp& op : pending) {
    if (op.phase != CopyPhase::kCopying) continue;
    absl::StatusOr<bool> done = device_->CopyDone(op.ticket);
    if (done.ok() && !*done) break;  // copies on a stream finish in order
    --running_;
    absl::Status status = done.status();
    if (op.bounce) {
      status = FinishBounceChunk(op, std::move(status));
      if (status.ok() && op.bounce_done < op.length) {
        ++running_;  // its next chunk runs
        continue;
      }
      bounce_busy_ = false;
    }
    if (status.ok()) {
      op.phase = CopyPhase::kCopied;
    } else {
      op.phase = CopyPhase::kFailed;
      op.error = DeviceError(op, status);
    }
  }
}

void DeviceCopyQueue::Drain(std::deque<PendingOp>& pending) {
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (running_ > 0) {
    Poll(pending);
    if (running_ == 0) break;
    if (absl::Now() > give_up) {
      LOG(ERROR) << "shmem: " << running_ << " device copies of endpoint " << conn_.LocalAddress()
                 << " have not finished after 10 s; leaving the memory they use mapped";
      leak_device_memory_ = true;
      return;
    }
    absl::SleepFor(absl::Microseconds(20));
  }
}

void DeviceCopyQueue::ReleaseBounce() {
  if (bounce_ == nullptr) return;
  if (bounce_pinned_) device_->UnregisterHost(bounce_);
  munmap(bounce_, bounce_bytes_);
  bounce_ = nullptr;
  bounce_bytes_ = 0;
  bounce_pinned_ = false;
}

void DeviceCopyQueue::AbandonBounce() {
  bounce_ = nullptr;  // a copy may still use it: left mapped
  bounce_bytes_ = 0;
  bounce_pinned_ = false;
}

auto DeviceCopyQueue::RemoteSide(const PendingOp& op, int device)
    -> absl::StatusOr<DeviceMemory::Side> {
  const bool read = op.kind == CompletionKind::kRead;
  if (op.key.flags & kKeyDevice) {
    if (device_ == nullptr) {
      return absl::FailedPreconditionError(
          "shmem: the peer's region is GPU memory, and this process has no GPU runtime to "
          "reach it (the peer should not have offered it: see `tensorverbs info`)");
    }
    ASSIGN_OR_RETURN(const PeerMappings::DeviceMapping* m,
                     mappings_.MapDevice(op.key, device, /*may_evict=*/running_ == 0));
    return DeviceMemory::Side{static_cast<char*>(m->base) + (op.remote_addr - op.key.base), true};
  }
  ASSIGN_OR_RETURN(PeerMappings::Mapping * m,
                   mappings_.Map(op.key, op.remote_addr, op.length, /*may_evict=*/running_ == 0));
  if (!read && !m->writable) {
    return absl::PermissionDeniedError("shmem: the peer mapped this region read-only");
  }
  mappings_.PinForDevice(*m);
  return DeviceMemory::Side{reinterpret_cast<char*>(op.remote_addr + m->delta), false};
}

void DeviceCopyQueue::StartBounced(PendingOp& op, int device) {
  if (bounce_busy_) return;
  if (absl::Status s = EnsureBounce(std::min(op.length, kMaxBounceBytes)); !s.ok()) {
    op.phase = CopyPhase::kFailed;
    op.error = DeviceError(op, s);
    return;
  }
  op.bounce = true;
  op.bounce_done = 0;
  op.copy_device = device;
  if (absl::Status s = StartBounceChunk(op); !s.ok()) {
    op.phase = CopyPhase::kFailed;
    op.error = DeviceError(op, s);
    return;
  }
  op.phase = CopyPhase::kCopying;
  bounce_busy_ = true;
  ++running_;
  Counters().device_ops.fetch_add(1, std::memory_order_relaxed);
  Counters().device_bytes.fetch_add(op.length, std::memory_order_relaxed);
  Counters().device_bounced_ops.fetch_add(1, std::memory_order_relaxed);
}

absl::Status DeviceCopyQueue::EnsureBounce(size_t bytes) {
  if (bounce_bytes_ >= bytes) return absl::OkStatus();
  ReleaseBounce();
  const size_t size = std::max<size_t>(bytes, size_t{64} << 10);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                 -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "shmem: a ", size, "-byte bounce buffer for GPU memory: ", std::strerror(errno)));
  }
  bounce_ = static_cast<char*>(p);
  bounce_bytes_ = size;
  bounce_pinned_ = device_->RegisterHost(bounce_, bounce_bytes_).ok();
  return absl::OkStatus();
}

absl::Status DeviceCopyQueue::FinishBounceChunk(PendingOp& op, absl::Status copied) {
  RETURN_IF_ERROR(copied);
  RETURN_IF_ERROR(conn_.Usable());
  if (op.kind != CompletionKind::kRead) {
    RETURN_IF_ERROR(conn_.CrossMemory(op, bounce_, op.bounce_done, op.bounce_chunk));
  }
  op.bounce_done += op.bounce_chunk;
  if (op.bounce_done < op.length) return StartBounceChunk(op);
  return absl::OkStatus();
}

absl::Status DeviceCopyQueue::StartBounceChunk(PendingOp& op) {
  const bool read = op.kind == CompletionKind::kRead;
  const size_t offset = op.bounce_done;
  op.bounce_chunk = std::min(op.length - offset, bounce_bytes_);
  if (read) RETURN_IF_ERROR(conn_.CrossMemory(op, bounce_, offset, op.bounce_chunk));
  const DeviceMemory::Side local{op.local + offset, true};
  const DeviceMemory::Side bounce{bounce_, false};
  ASSIGN_OR_RETURN(op.ticket, device_->StartCopy(op.copy_device, read ? local : bounce,
                                                 read ? bounce : local, op.bounce_chunk));
  return absl::OkStatus();
}

absl::Status DeviceCopyQueue::DeviceError(const PendingOp& op, const absl::Status& s) const {
  return absl::Status(
      s.code(),
      absl::StrCat("shmem: device ", op.kind == CompletionKind::kRead ? "read" : "write", " of ",
                   op.length, " bytes with the peer of ", conn_.LocalAddress(), ": ", s.message()));
}

}  // namespace tensorverbs::fabric::shmem
