#include "src/fabric/shmem/peer_connection.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "src/common/status_macros.h"
#include "src/fabric/shmem/shmem.h"

namespace tensorverbs::fabric::shmem {

absl::Status PeerConnection::Open(uint64_t uid, uint64_t id, absl::string_view peer_address) {
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

void PeerConnection::Close() {
  if (out_ != nullptr) munmap(out_, out_bytes_);
  out_ = nullptr;
  for (int* fd : {&conn_fd_, &peer_bell_fd_, &peer_pidfd_}) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
  }
}

std::string PeerConnection::LocalAddress() const {
  return absl::StrCat("shmem:", absl::Hex(d_.uid, absl::kZeroPad16), ":", shared_.id);
}

absl::Status PeerConnection::Ask(RequestType type, uint64_t id, Reply* reply, int* fds, int max_fds,
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

absl::Status PeerConnection::Break(absl::Status status) {
  if (broken_.ok()) broken_ = status;
  return broken_;
}

absl::Status PeerConnection::Usable() const {
  if (!broken_.ok()) return broken_;
  if (shared_.peer_gone.load(std::memory_order_acquire)) return PeerGone();
  return absl::OkStatus();
}

absl::Status PeerConnection::PeerGone() const {
  return absl::UnavailableError(
      absl::StrCat("shmem: the peer of ", LocalAddress(), " (pid ", peer_pid_,
                   ") is gone: its process exited or it closed the endpoint"));
}

void PeerConnection::CheckConnection() {
  if (conn_fd_ < 0 || !broken_.ok()) return;
  pollfd p{conn_fd_, POLLRDHUP, 0};
  if (poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
    (void)Break(PeerGone());
  }
}

absl::Status PeerConnection::CrossMemory(const PendingOp& op, char* local, size_t offset,
                                         size_t length) {
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

bool PeerConnection::RingFull() const {
  const uint64_t head = Atomic(out_->head).load(std::memory_order_acquire);
  return out_tail_ - head >= out_capacity_;
}

bool PeerConnection::RingInconsistent() const {
  const uint64_t head = Atomic(out_->head).load(std::memory_order_acquire);
  return out_tail_ - head > out_capacity_;
}

void PeerConnection::Publish(uint32_t imm, uint64_t byte_len) {
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

}  // namespace tensorverbs::fabric::shmem
