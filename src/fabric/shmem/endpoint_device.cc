#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/common/coarse_clock.h"
#include "src/common/logging.h"
#include "src/common/mutex.h"
#include "src/common/shared_memory.h"
#include "src/common/status_macros.h"
#include "src/fabric/endpoint_base.h"
#include "src/fabric/shmem/copy.h"
#include "src/fabric/shmem/domain_state.h"
#include "src/fabric/shmem/endpoint.h"
#include "src/fabric/shmem/wire.h"

namespace tensorverbs::fabric::shmem {

auto ShmemEndpoint::MapDevice(const PackedKey& key, int device)
    -> absl::StatusOr<const DeviceMapping*> {
  if (auto it = device_mappings_.find({key.region, device}); it != device_mappings_.end()) {
    const DeviceMapping& m = it->second;
    if (m.key.base != key.base || m.key.length != key.length) {
      return absl::DataLossError(
          "shmem: a remote key describes its device region differently than when it was "
          "imported");
    }
    return &m;
  }
  DeviceRegionReply reply{};
  int fd = -1;
  int nfds = 0;
  RETURN_IF_ERROR(Ask(kDeviceRegion, key.region, &reply.reply, &fd, 1, &nfds, sizeof(reply)));
  for (int i = 0; i < nfds; ++i) close(fd);
  if (reply.handle_size == 0 || reply.handle_size > kMaxDeviceHandle) {
    return absl::DataLossError("shmem: the peer sent a malformed device handle");
  }
  if (key.length > reply.reply.size) {
    return absl::DataLossError("shmem: a remote key does not fit its device region");
  }
  absl::StatusOr<void*> base =
      d_->device->Import(device, absl::string_view(reply.handle, reply.handle_size));
  if (!base.ok()) {
    return absl::Status(
        base.status().code(),
        absl::StrCat("shmem: importing the GPU memory of pid ", peer_pid_,
                     " (its cuda:", reply.device, ") failed: ", base.status().message()));
  }
  if (device_mappings_.size() >= kMaxMappingsPerEndpoint && device_copies_ == 0) {
    auto first = device_mappings_.begin();
    d_->device->Close(first->second.device, first->second.base);
    device_mappings_.erase(first);
  }
  Counters().device_regions_imported.fetch_add(1, std::memory_order_relaxed);
  DeviceMapping& m = device_mappings_[{key.region, device}];
  m = DeviceMapping{*base, key, device};
  return &m;
}

auto ShmemEndpoint::RemoteSide(const Op& op, int device) -> absl::StatusOr<DeviceMemory::Side> {
  const bool read = op.kind == CompletionKind::kRead;
  if (op.key.flags & kKeyDevice) {
    if (d_->device == nullptr) {
      return absl::FailedPreconditionError(
          "shmem: the peer's region is GPU memory, and this process has no GPU runtime to "
          "reach it (the peer should not have offered it: see `tensorverbs info`)");
    }
    ASSIGN_OR_RETURN(const DeviceMapping* m, MapDevice(op.key, device));
    return DeviceMemory::Side{static_cast<char*>(m->base) + (op.remote_addr - op.key.base), true};
  }
  ASSIGN_OR_RETURN(Mapping * m, MapRegion(op.key));
  if (!read && !m->writable) {
    return absl::PermissionDeniedError("shmem: the peer mapped this region read-only");
  }
  if (!m->pinned) {
    // Page-locked once, so copies reach it by DMA and never block this thread; if the
    // runtime refuses, they still work, synchronously.
    absl::Status pinned = d_->device->RegisterHost(m->addr, m->map_length);
    if (pinned.ok()) {
      m->pinned = true;
    } else {
      VLOG(1) << "shmem: a peer's region stays pageable for device copies: " << pinned;
    }
  }
  return DeviceMemory::Side{reinterpret_cast<char*>(op.remote_addr + m->delta), false};
}

void ShmemEndpoint::StartDeviceCopy(Op& op) {
  auto fail = [&](const absl::Status& s) {
    op.phase = Phase::kFailed;
    op.error = DeviceError(op, s);
  };
  if (d_->device == nullptr) {
    fail(absl::FailedPreconditionError("this process has no GPU runtime"));
    return;
  }
  // The local GPU that runs the copy: the local buffer's, else device 0 (the peer's ordinal
  // names a GPU in its process, which may be another one here, or none).
  const int device = op.local_device >= 0 ? op.local_device : 0;
  if ((op.key.flags & (kKeyDevice | kKeyShared)) == 0) {
    StartBouncedCopy(op, device);
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
      d_->device->StartCopy(device, read ? local : *remote, read ? *remote : local, op.length);
  if (!ticket.ok()) {
    fail(ticket.status());
    return;
  }
  op.ticket = *ticket;
  op.phase = Phase::kCopying;
  ++device_copies_;
  Counters().device_ops.fetch_add(1, std::memory_order_relaxed);
  Counters().device_bytes.fetch_add(op.length, std::memory_order_relaxed);
}

void ShmemEndpoint::StartBouncedCopy(Op& op, int device) {
  if (bounce_busy_) return;
  if (absl::Status s = EnsureBounce(std::min(op.length, kMaxBounceBytes)); !s.ok()) {
    op.phase = Phase::kFailed;
    op.error = DeviceError(op, s);
    return;
  }
  op.bounce = true;
  op.bounce_done = 0;
  op.copy_device = device;
  if (absl::Status s = StartBounceChunk(op); !s.ok()) {
    op.phase = Phase::kFailed;
    op.error = DeviceError(op, s);
    return;
  }
  op.phase = Phase::kCopying;
  bounce_busy_ = true;
  ++device_copies_;
  Counters().device_ops.fetch_add(1, std::memory_order_relaxed);
  Counters().device_bytes.fetch_add(op.length, std::memory_order_relaxed);
  Counters().device_bounced_ops.fetch_add(1, std::memory_order_relaxed);
}

absl::Status ShmemEndpoint::StartBounceChunk(Op& op) {
  const bool read = op.kind == CompletionKind::kRead;
  const size_t offset = op.bounce_done;
  op.bounce_chunk = std::min(op.length - offset, bounce_bytes_);
  if (read) RETURN_IF_ERROR(CrossMemory(op, bounce_, offset, op.bounce_chunk));
  const DeviceMemory::Side local{op.local + offset, true};
  const DeviceMemory::Side bounce{bounce_, false};
  ASSIGN_OR_RETURN(op.ticket, d_->device->StartCopy(op.copy_device, read ? local : bounce,
                                                    read ? bounce : local, op.bounce_chunk));
  return absl::OkStatus();
}

absl::Status ShmemEndpoint::EnsureBounce(size_t bytes) {
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
  bounce_pinned_ = d_->device->RegisterHost(bounce_, bounce_bytes_).ok();
  return absl::OkStatus();
}

void ShmemEndpoint::ReleaseBounce() {
  if (bounce_ == nullptr) return;
  if (bounce_pinned_) d_->device->UnregisterHost(bounce_);
  munmap(bounce_, bounce_bytes_);
  bounce_ = nullptr;
  bounce_bytes_ = 0;
  bounce_pinned_ = false;
}

absl::Status ShmemEndpoint::FinishBounceChunk(Op& op, absl::Status copied) {
  RETURN_IF_ERROR(copied);
  RETURN_IF_ERROR(Usable());
  if (op.kind != CompletionKind::kRead) {
    RETURN_IF_ERROR(CrossMemory(op, bounce_, op.bounce_done, op.bounce_chunk));
  }
  op.bounce_done += op.bounce_chunk;
  if (op.bounce_done < op.length) return StartBounceChunk(op);
  return absl::OkStatus();
}

void ShmemEndpoint::StartDeviceCopies() {
  if (device_copies_ >= kMaxDeviceCopies || !Usable().ok()) return;
  for (Op& op : pending_) {
    if (device_copies_ >= kMaxDeviceCopies) break;
    if (op.device && op.phase == Phase::kQueued) StartDeviceCopy(op);
  }
}

void ShmemEndpoint::PollDeviceCopies() {
  if (device_copies_ == 0) return;
  for (Op& op : pending_) {
    if (op.phase != Phase::kCopying) continue;
    absl::StatusOr<bool> done = d_->device->CopyDone(op.ticket);
    if (done.ok() && !*done) break;  // copies on a stream finish in order
    --device_copies_;
    absl::Status status = done.status();
    if (op.bounce) {
      status = FinishBounceChunk(op, std::move(status));
      if (status.ok() && op.bounce_done < op.length) {
        ++device_copies_;  // its next chunk runs
        continue;
      }
      bounce_busy_ = false;
    }
    if (status.ok()) {
      op.phase = Phase::kCopied;
    } else {
      op.phase = Phase::kFailed;
      op.error = DeviceError(op, status);
    }
  }
}

void ShmemEndpoint::DrainDeviceCopies() {
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (device_copies_ > 0) {
    PollDeviceCopies();
    if (device_copies_ == 0) break;
    if (absl::Now() > give_up) {
      LOG(ERROR) << "shmem: " << device_copies_ << " device copies of endpoint " << LocalAddress()
                 << " have not finished after 10 s; leaving the memory they use mapped";
      leak_device_memory_ = true;
      return;
    }
    absl::SleepFor(absl::Microseconds(20));
  }
}

absl::Status ShmemEndpoint::DeviceError(const Op& op, const absl::Status& s) const {
  return absl::Status(
      s.code(),
      absl::StrCat("shmem: device ", op.kind == CompletionKind::kRead ? "read" : "write", " of ",
                   op.length, " bytes with the peer of ", LocalAddress(), ": ", s.message()));
}

}  // namespace tensorverbs::fabric::shmem
