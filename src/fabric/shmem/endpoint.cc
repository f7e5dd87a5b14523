#include "src/fabric/shmem/endpoint.h"

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
#include "src/fabric/shmem/region.h"
#include "src/fabric/shmem/wire.h"

namespace tensorverbs::fabric::shmem {

ShmemEndpoint::ShmemEndpoint(std::shared_ptr<DomainState> d, std::shared_ptr<EndpointShared> shared,
                             absl::Duration op_timeout)
    : op_timeout_(op_timeout),
      d_(std::move(d)),
      shared_(std::move(shared)),
      in_(static_cast<RingHeader*>(shared_->ring->data())) {
  d_->live.push_back(this);
  struct stat st {};
  if (fstat(shared_->ring->fd(), &st) == 0) in_ring_inode_ = st.st_ino;
}

ShmemEndpoint::~ShmemEndpoint() {
  // Copies the GPU still runs read or write memory this endpoint maps: they finish first.
  DrainDeviceCopies();
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

std::string ShmemEndpoint::LocalAddress() const {
  return absl::StrCat("shmem:", absl::Hex(d_->uid, absl::kZeroPad16), ":", shared_->id);
}

absl::Status ShmemEndpoint::Connect(absl::string_view peer_address) {
  if (conn_fd_ >= 0) return absl::FailedPreconditionError("shmem: endpoint already connected");
  std::vector<absl::string_view> parts = absl::StrSplit(peer_address, ':');
  uint64_t uid = 0, id = 0;
  if (parts.size() != 3 || parts[0] != "shmem" || !absl::SimpleHexAtoi(parts[1], &uid) ||
      !absl::SimpleAtoi(parts[2], &id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shmem: '", absl::CHexEscape(peer_address), "' is not a shmem address"));
  }
  absl::Status s = ConnectTo(uid, id, peer_address);
  if (!s.ok()) {
    Disconnect();
    return absl::Status(s.code(), absl::StrCat(s.message(), " (connecting to ", peer_address, ")"));
  }
  return absl::OkStatus();
}

void ShmemEndpoint::RunPending() {
  StartDeviceCopies();
  PollDeviceCopies();
  while (!pending_.empty()) {
    Op& op = pending_.front();
    if (op.phase == Phase::kCopying) return;  // the GPU is still copying
    absl::Status status = op.phase == Phase::kFailed ? op.error : Usable();
    if (status.ok() && op.phase == Phase::kQueued && op.device) {
      StartDeviceCopy(op);  // only when more were in flight than StartDeviceCopies starts
      if (op.phase == Phase::kCopying || op.phase == Phase::kQueued) return;
      if (op.phase == Phase::kFailed) status = op.error;
    }
    if (status.ok() && op.with_imm && RingFull()) {
      const uint64_t head = Atomic(out_->head).load(std::memory_order_acquire);
      if (out_tail_ - head > out_capacity_) {
        status = Break(absl::DataLossError("shmem: the peer left its ring inconsistent"));
      } else if (CoarseNow() - op.posted < op_timeout_) {
        return;  // the peer has not consumed yet; retried from Poll
      } else {
        status = absl::DeadlineExceededError(absl::StrCat("shmem: the peer of ", LocalAddress(),
                                                          " took no immediate for ",
                                                          absl::FormatDuration(op_timeout_)));
      }
    } else if (status.ok()) {
      if (op.phase == Phase::kQueued) status = Copy(op);
      if (status.ok() && op.with_imm) Publish(op.imm, op.length);
    }
    Complete(op, std::move(status));
    pending_.pop_front();
  }
}

size_t ShmemEndpoint::TakeInbound(absl::Span<Completion> out) {
  if (ring_broken_) return 0;
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

void ShmemEndpoint::CheckConnection() {
  if (conn_fd_ < 0 || !broken_.ok()) return;
  pollfd p{conn_fd_, POLLRDHUP, 0};
  if (poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
    (void)Break(PeerGone());
  }
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
  if (conn_fd_ < 0) return absl::FailedPreconditionError("shmem: endpoint is not connected");
  if (key.domain != peer_uid_) {
    return absl::InvalidArgumentError(
        "shmem: the remote key belongs to another domain than this endpoint's peer");
  }
  const uint32_t needed = kind == CompletionKind::kRead ? kAccessRemoteRead : kAccessRemoteWrite;
  if ((key.access & needed) == 0) {
    return absl::PermissionDeniedError("shmem: the remote region does not allow this access");
  }
  RETURN_IF_ERROR(Usable());
  Op op;
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

absl::Status ShmemEndpoint::PeerGone() const {
  return absl::UnavailableError(
      absl::StrCat("shmem: the peer of ", LocalAddress(), " (pid ", peer_pid_,
                   ") is gone: its process exited or it closed the endpoint"));
}

absl::Status ShmemEndpoint::Usable() const {
  if (!broken_.ok()) return broken_;
  if (shared_->peer_gone.load(std::memory_order_acquire)) return PeerGone();
  return absl::OkStatus();
}

absl::Status ShmemEndpoint::Break(absl::Status status) {
  if (broken_.ok()) broken_ = status;
  return broken_;
}

absl::Status ShmemEndpoint::ConnectTo(uint64_t uid, uint64_t id, absl::string_view peer_address) {
  conn_fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (conn_fd_ < 0) {
    return absl::UnavailableError(absl::StrCat("shmem: socket: ", std::strerror(errno)));
  }
  SetTimeouts(conn_fd_);
  socklen_t len;
  sockaddr_un addr = SocketAddress(uid, &len);
  if (connect(conn_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    return absl::UnavailableError(
        absl::StrCat("shmem: no peer domain there (", std::strerror(errno),
                     "): is the peer on this host, in this network namespace, and still running?"));
  }
  ucred cred{};
  if (!PeerCredentials(conn_fd_, &cred)) {
    return absl::UnavailableError("shmem: the peer's process is unknown (SO_PEERCRED)");
  }
  if (cred.uid != geteuid()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "shmem: the peer runs as user ", cred.uid, ", not ", geteuid(),
        "; the shmem fabric connects processes of one user (use TENSORVERBS_FABRIC=ofi)"));
  }
  if (cred.pid == 0) {
    return absl::UnavailableError(
        "shmem: the peer is in another PID namespace; the shmem fabric needs one (use "
        "TENSORVERBS_FABRIC=ofi)");
  }
  peer_uid_ = uid;
  peer_pid_ = cred.pid;
  peer_pidfd_ = PidfdOpen(cred.pid);  // -1 on old kernels: then liveness is the socket's alone
  Reply reply{};
  int fds[2] = {-1, -1};
  int nfds = 0;
  RETURN_IF_ERROR(Ask(kHello, id, &reply, fds, 2, &nfds));
  absl::Cleanup close_fds = [&] {
    for (int i = 0; i < nfds; ++i) {
      if (fds[i] >= 0) close(fds[i]);
    }
  };
  if (nfds != 2) return absl::DataLossError("shmem: the peer sent no ring");
  const uint64_t ring_bytes = sizeof(RingHeader) + uint64_t{reply.capacity} * sizeof(RingEntry);
  if (reply.capacity == 0 || reply.capacity > (1u << 20) || reply.size < ring_bytes) {
    return absl::DataLossError("shmem: the peer described a malformed ring");
  }
  RETURN_IF_ERROR(CheckPeerMemory(fds[0], ring_bytes, "ring").status());
  struct stat st {};
  if (fstat(fds[0], &st) == 0) out_ring_inode_ = st.st_ino;
  const int flags = fcntl(fds[1], F_GETFL);
  if (flags < 0 || fcntl(fds[1], F_SETFL, flags | O_NONBLOCK) != 0) {
    return absl::DataLossError("shmem: the peer's doorbell is not a descriptor we can use");
  }
  void* ring = mmap(nullptr, ring_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
  if (ring == MAP_FAILED) {
    return absl::UnavailableError(
        absl::StrCat("shmem: mapping the peer's ring: ", std::strerror(errno)));
  }
  out_ = static_cast<RingHeader*>(ring);
  out_bytes_ = ring_bytes;
  if (Atomic(out_->magic).load(std::memory_order_acquire) != kRingMagic ||
      out_->capacity != reply.capacity) {
    return absl::DataLossError("shmem: the peer's ring is not one");
  }
  out_capacity_ = reply.capacity;
  out_tail_ = Atomic(out_->tail).load(std::memory_order_acquire);
  peer_bell_fd_ = fds[1];
  fds[1] = -1;  // kept
  return absl::OkStatus();
}

void ShmemEndpoint::Disconnect() {
  if (leak_device_memory_) {
    mappings_.clear();
    device_mappings_.clear();
    bounce_ = nullptr;  // a copy may still use it: left mapped
    bounce_bytes_ = 0;
    bounce_pinned_ = false;
  }
  ReleaseBounce();
  for (auto& [id, m] : mappings_) Unmap(m);
  mappings_.clear();
  for (auto& [id, m] : device_mappings_) d_->device->Close(m.device, m.base);
  device_mappings_.clear();
  if (out_ != nullptr) munmap(out_, out_bytes_);
  out_ = nullptr;
  for (int* fd : {&conn_fd_, &peer_bell_fd_, &peer_pidfd_}) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
  }
}

absl::Status ShmemEndpoint::Ask(RequestType type, uint64_t id, Reply* reply, int* fds, int max_fds,
                                int* nfds, size_t reply_bytes) {
  *nfds = 0;
  Request request{kRequestMagic, type, id};
  if (!SendWithFds(conn_fd_, &request, sizeof(request), nullptr, 0)) {
    return Break(absl::UnavailableError(absl::StrCat("shmem: the peer (pid ", peer_pid_,
                                                     ") does not answer: ", std::strerror(errno))));
  }
  const ssize_t n = RecvWithFds(conn_fd_, reply, reply_bytes, fds, max_fds, nfds);
  const bool matches = n == static_cast<ssize_t>(reply_bytes) && reply->magic == kReplyMagic &&
                       reply->type == type && reply->id == id;
  if (!matches || reply->status != kOk) {
    for (int i = 0; i < *nfds; ++i) close(fds[i]);
    *nfds = 0;
  }
  if (!matches) {
    return Break(absl::UnavailableError(
        absl::StrCat("shmem: the peer (pid ", peer_pid_, ") ",
                     n == 0  ? "hung up"
                     : n < 0 ? absl::StrCat("did not answer: ", std::strerror(errno))
                             : std::string("answered something else"))));
  }
  if (reply->status != kOk) {
    return absl::InvalidArgumentError(
        absl::StrCat("shmem: the peer refused: ", ReplyText(reply->status)));
  }
  return absl::OkStatus();
}

auto ShmemEndpoint::MapRegion(const PackedKey& key) -> absl::StatusOr<Mapping*> {
  if (auto it = mappings_.find(key.region); it != mappings_.end()) {
    Mapping& m = it->second;
    if (m.key.base != key.base || m.key.length != key.length || m.key.offset != key.offset) {
      return absl::DataLossError(
          "shmem: a remote key describes its region differently than when it was mapped");
    }
    return &m;
  }
  Reply reply{};
  int fd = -1;
  int nfds = 0;
  RETURN_IF_ERROR(Ask(kRegion, key.region, &reply, &fd, 1, &nfds));
  absl::Cleanup close_fd = [fd] { close(fd); };
  if (nfds != 1) return absl::DataLossError("shmem: the peer sent no descriptor for a region");
  if (key.offset > reply.size || key.length > reply.size - key.offset) {
    return absl::DataLossError("shmem: a remote key does not fit its region's memory");
  }
  RETURN_IF_ERROR(CheckPeerMemory(fd, key.offset + key.length, "region").status());
  const auto page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t start = key.offset / page * page;
  const size_t map_length = key.offset + key.length - start;
  const bool writable = (reply.access & kAccessRemoteWrite) != 0;
  // Populated at once, as an RDMA registration pins the whole region: no page faults later,
  // in the middle of a transfer.
  void* addr = mmap(nullptr, map_length, PROT_READ | (writable ? PROT_WRITE : 0),
                    MAP_SHARED | MAP_POPULATE, fd, static_cast<off_t>(start));
  if (addr == MAP_FAILED) {
    const int error = errno;
    if (error == ENOMEM || error == EAGAIN) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "shmem: mapping a peer's region of ", map_length, " bytes: ", std::strerror(error),
          " (this process is out of memory or address space; check ulimit -v)"));
    }
    return absl::UnavailableError(absl::StrCat("shmem: mapping a peer's region of ", map_length,
                                               " bytes: ", std::strerror(error)));
  }
  // Device copies may still be moving bytes through a mapping: none goes while they run.
  if (mappings_.size() >= kMaxMappingsPerEndpoint && device_copies_ == 0) {
    auto oldest = std::min_element(
        mappings_.begin(), mappings_.end(),
        [](const auto& a, const auto& b) { return a.second.order < b.second.order; });
    Unmap(oldest->second);
    mappings_.erase(oldest);
  }
  Counters().regions_mapped.fetch_add(1, std::memory_order_relaxed);
  const uint64_t local_base = reinterpret_cast<uint64_t>(addr) + (key.offset - start);
  Mapping& m = mappings_[key.region];
  m = Mapping{addr, map_length, local_base - key.base, key, writable, ++mapping_order_, false};
  return &m;
}

void ShmemEndpoint::Unmap(const Mapping& m) {
  if (m.pinned) d_->device->UnregisterHost(m.addr);
  munmap(m.addr, m.map_length);
}

absl::Status ShmemEndpoint::Copy(const Op& op) {
  if (op.length == 0) return absl::OkStatus();
  const bool read = op.kind == CompletionKind::kRead;
  if (op.key.flags & kKeyShared) {
    ASSIGN_OR_RETURN(Mapping * m, MapRegion(op.key));
    if (!read && !m->writable) {
      return absl::PermissionDeniedError("shmem: the peer mapped this region read-only");
    }
    char* there = reinterpret_cast<char*>(op.remote_addr + m->delta);
    if (read) {
      d_->copy_helpers->Copy(op.local, there, op.length, /*streaming=*/false);
    } else if (ShouldShare(op)) {
      RETURN_IF_ERROR(SharedCopy(op, there));
    } else {
      d_->copy_helpers->Copy(there, op.local, op.length, op.length >= kStreamingCopyBytes);
    }
    Counters().mapped_ops.fetch_add(1, std::memory_order_relaxed);
    Counters().mapped_bytes.fetch_add(op.length, std::memory_order_relaxed);
    return absl::OkStatus();
  }
  return CrossMemory(op, op.local, 0, op.length);
}

absl::Status ShmemEndpoint::CrossMemory(const Op& op, char* local, size_t offset, size_t length) {
  const bool read = op.kind == CompletionKind::kRead;
  if (peer_pidfd_ >= 0) {
    pollfd p{peer_pidfd_, POLLIN, 0};
    if (poll(&p, 1, 0) > 0) return Break(PeerGone());
  }
  size_t done = 0;
  while (done < length) {
    iovec mine{local + done, length - done};
    iovec theirs{reinterpret_cast<void*>(op.remote_addr + offset + done), length - done};
    const ssize_t n = read ? process_vm_readv(peer_pid_, &mine, 1, &theirs, 1, 0)
                           : process_vm_writev(peer_pid_, &mine, 1, &theirs, 1, 0);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      const int e = n < 0 ? errno : EFAULT;
      if (e == ESRCH) return Break(PeerGone());
      return absl::UnavailableError(absl::StrCat(
          "shmem: cross-memory ", read ? "read from" : "write to", " pid ", peer_pid_, ": ",
          std::strerror(e),
          e == EPERM ? " (ptrace scope forbids it; register memory from SharedMemory)" : ""));
    }
    done += static_cast<size_t>(n);
  }
  Counters().cross_memory_ops.fetch_add(1, std::memory_order_relaxed);
  Counters().cross_memory_bytes.fetch_add(length, std::memory_order_relaxed);
  return absl::OkStatus();
}

bool ShmemEndpoint::RingFull() const {
  const uint64_t head = Atomic(out_->head).load(std::memory_order_acquire);
  return out_tail_ - head >= out_capacity_;
}

void ShmemEndpoint::Publish(uint32_t imm, uint64_t byte_len) {
  RingEntry& e = Entries(out_)[out_tail_ % out_capacity_];
  Atomic(e.imm).store(imm, std::memory_order_relaxed);
  Atomic(e.byte_len).store(byte_len, std::memory_order_relaxed);
  ++out_tail_;
  // Sequentially consistent store, then load: with the reader's store of `sleeping` and its
  // load of `tail` (both seq_cst) at least one side sees the other's, so a reader never
  // sleeps on a published immediate without its doorbell being rung.
  Atomic(out_->tail).store(out_tail_, std::memory_order_seq_cst);
  if (Atomic(out_->sleeping).load(std::memory_order_seq_cst) != 0) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(peer_bell_fd_, &one, sizeof(one));
  }
}

void ShmemEndpoint::Complete(const Op& op, absl::Status status) {
  Completion c;
  c.kind = op.kind;
  c.endpoint = this;
  c.context = op.context;
  c.status = std::move(status);
  d_->local.push_back(std::move(c));
}

}  // namespace tensorverbs::fabric::shmem
