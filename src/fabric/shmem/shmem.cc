#include "src/fabric/shmem/shmem.h"

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
#include "src/fabric/shmem/wire.h"

namespace tensorverbs::fabric::shmem {
namespace {

constexpr size_t kMaxMappingsPerEndpoint = 256;
// Writes of at least this many bytes into a peer's mapping use non-temporal stores. Measured
// (docs/PERFORMANCE.md): into destinations the writer has not touched lately
// (bench/copy_bench.cc) streaming stores beat memcpy at every size from 64 KiB, 1.3x at
// 4-64 MiB; but into a destination still in cache, as a pool chunk reused at once often is,
// memcpy won at 1 MiB (`bench fabric`: 0.72x memcpy streaming, 1.06x plain). From twice a
// core's L2 up a destination cannot be in that cache anyway.
constexpr size_t kStreamingCopyBytes = size_t{4} << 20;
// DomainOptions::copy_threads at most.
constexpr int kMaxCopyThreads = 64;

// ---- Regions --------------------------------------------------------------------------------

class ShmemRegion final : public MemoryRegion {
 public:
  ShmemRegion(std::shared_ptr<DomainState> d, uint64_t id, void* base, size_t length,
              uint32_t access, bool shared, uint64_t offset, int device = -1)
      : MemoryRegion(base, length),
        d_(std::move(d)),
        id_(id),
        access_(access),
        shared_(shared),
        offset_(offset),
        device_(device) {}
  ~ShmemRegion() override {
    MutexLock lock(&d_->mu);
    auto it = d_->regions.find(id_);
    if (it != d_->regions.end()) {
      if (it->second.fd >= 0) close(it->second.fd);
      d_->regions.erase(it);
    }
  }
  // The GPU the region is on, or -1 for host memory.
  int device() const { return device_; }
  RemoteKey PackRemoteKey() const override {
    PackedKey k{kKeyMagic,
                (shared_ ? kKeyShared : 0u) | (device_ >= 0 ? kKeyDevice : 0u),
                d_->uid,
                id_,
                reinterpret_cast<uint64_t>(base()),
                length(),
                offset_,
                access_,
                device_ >= 0 ? static_cast<uint32_t>(device_) : 0u};
    return RemoteKey(absl::string_view(reinterpret_cast<const char*>(&k), sizeof(k)));
  }

 private:
  std::shared_ptr<DomainState> d_;
  const uint64_t id_;
  const uint32_t access_;
  const bool shared_;
  const uint64_t offset_;
  const int device_;
};

}  // namespace

// ---- Endpoints ------------------------------------------------------------------------------

// Outside the anonymous namespace: DomainState (domain_state.h) lists the live ones.
class ShmemEndpoint final : public EndpointBase {
 public:
  ShmemEndpoint(std::shared_ptr<DomainState> d, std::shared_ptr<EndpointShared> shared,
                absl::Duration op_timeout)
      : op_timeout_(op_timeout),
        d_(std::move(d)),
        shared_(std::move(shared)),
        in_(static_cast<RingHeader*>(shared_->ring->data())) {
    d_->live.push_back(this);
  }

  ~ShmemEndpoint() override {
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

  std::string LocalAddress() const override {
    return absl::StrCat("shmem:", absl::Hex(d_->uid, absl::kZeroPad16), ":", shared_->id);
  }

  absl::Status Connect(absl::string_view peer_address) override {
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
      return absl::Status(s.code(),
                          absl::StrCat(s.message(), " (connecting to ", peer_address, ")"));
    }
    return absl::OkStatus();
  }

  size_t Outstanding() const override { return outstanding_; }

  // Progress thread: runs queued operations, so what waits for room in the peer's ring goes
  // as soon as there is some, or fails when the peer is gone or the operation too old. Device
  // copies start as soon as they are queued and complete in posting order with the rest: an
  // immediate is published once the copies posted before it are done.
  void RunPending() {
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

  // Moves up to out.size() immediates that arrived into `out`.
  size_t TakeInbound(absl::Span<Completion> out) {
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

  // Whether our connection to the peer's descriptor server has closed: then the peer process
  // is gone even if it never connected back to us (which is how we usually learn it).
  void CheckConnection() {
    if (conn_fd_ < 0 || !broken_.ok()) return;
    pollfd p{conn_fd_, POLLRDHUP, 0};
    if (poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
      (void)Break(PeerGone());
    }
  }

  int conn_fd() const { return conn_fd_; }
  bool HasInbound() const {
    return !ring_broken_ && Atomic(in_->tail).load(std::memory_order_seq_cst) != in_head_;
  }
  bool HasPending() const { return !pending_.empty(); }
  // Device copies this endpoint has running.
  int device_copies() const { return device_copies_; }
  void SetSleeping(uint32_t v) { Atomic(in_->sleeping).store(v, std::memory_order_seq_cst); }
  void Delivered() { --outstanding_; }

 protected:
  absl::Status Post(CompletionKind kind, bool with_imm, uint32_t imm, const LocalBuffer& local,
                    const RemoteBuffer& remote, uint64_t context) override {
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
    op.local_device =
        local.region != nullptr ? static_cast<const ShmemRegion*>(local.region)->device() : -1;
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

 private:
  // An operation's device copy: not started, running on the GPU, done, or refused.
  enum class Phase { kQueued, kCopying, kCopied, kFailed };
  struct Op {
    CompletionKind kind;
    bool with_imm;
    uint32_t imm;
    char* local;
    size_t length;
    PackedKey key;
    uint64_t remote_addr;
    uint64_t context;
    absl::Time posted;
    int local_device = -1;  // the local buffer is GPU memory of this ordinal
    bool device = false;    // either side is GPU memory: a device copy moves the bytes
    Phase phase = Phase::kQueued;
    uint64_t ticket = 0;
    absl::Status error;  // kFailed
    // GPU memory and the peer's private memory: the bytes go through the bounce buffer.
    bool bounce = false;
  };
  struct Mapping {
    void* addr;
    size_t map_length;
    uint64_t delta;  // remote address + delta = local address
    PackedKey key;   // the key it was mapped for: base, length and offset must match
    bool writable;
    uint64_t order;  // for eviction: the oldest mapping goes first
    bool pinned;     // page-locked for device copies
  };
  // A peer's GPU allocation, imported into this process.
  struct DeviceMapping {
    void* base;
    PackedKey key;  // the key it was imported for: base and length must match
    int device;     // the ordinal it was imported on
  };
  // At most this many device copies in flight per endpoint.
  static constexpr int kMaxDeviceCopies = 64;

  absl::Status PeerGone() const {
    return absl::UnavailableError(
        absl::StrCat("shmem: the peer of ", LocalAddress(), " (pid ", peer_pid_,
                     ") is gone: its process exited or it closed the endpoint"));
  }

  // OK while the peer may be written to.
  absl::Status Usable() const {
    if (!broken_.ok()) return broken_;
    if (shared_->peer_gone.load(std::memory_order_acquire)) return PeerGone();
    return absl::OkStatus();
  }

  // From now on every operation fails with `status`: the connection to the peer can no longer
  // be trusted (it hung up, timed out, or answered something else than what was asked).
  absl::Status Break(absl::Status status) {
    if (broken_.ok()) broken_ = status;
    return broken_;
  }

  absl::Status ConnectTo(uint64_t uid, uint64_t id, absl::string_view peer_address) {
    conn_fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (conn_fd_ < 0) {
      return absl::UnavailableError(absl::StrCat("shmem: socket: ", std::strerror(errno)));
    }
    SetTimeouts(conn_fd_);
    socklen_t len;
    sockaddr_un addr = SocketAddress(uid, &len);
    if (connect(conn_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
      return absl::UnavailableError(absl::StrCat(
          "shmem: no peer domain there (", std::strerror(errno),
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

  // Releases everything Connect acquired; the endpoint is unconnected afterwards.
  void Disconnect() {
    if (leak_device_memory_) {
      mappings_.clear();
      device_mappings_.clear();
      bounce_ = nullptr;
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

  // One request to the peer's descriptor server, answered at once or within the socket
  // timeout. A failure to get the answer breaks the endpoint: a late answer would otherwise
  // be read as the answer to the next request.
  // `reply` starts a message of `reply_bytes` (a Reply, or a DeviceRegionReply).
  absl::Status Ask(RequestType type, uint64_t id, Reply* reply, int* fds, int max_fds, int* nfds,
                   size_t reply_bytes = sizeof(Reply)) {
    *nfds = 0;
    Request request{kRequestMagic, type, id};
    if (!SendWithFds(conn_fd_, &request, sizeof(request), nullptr, 0)) {
      return Break(absl::UnavailableError(absl::StrCat(
          "shmem: the peer (pid ", peer_pid_, ") does not answer: ", std::strerror(errno))));
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

  // Where region `key` is mapped here, mapping it on first use.
  absl::StatusOr<Mapping*> MapRegion(const PackedKey& key) {
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

  void Unmap(const Mapping& m) {
    if (m.pinned) d_->device->UnregisterHost(m.addr);
    munmap(m.addr, m.map_length);
  }

  // Where the peer's GPU region `key` is in this process, importing it on first use.
  absl::StatusOr<const DeviceMapping*> MapDevice(const PackedKey& key, int device) {
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

  // The peer's side of a device copy.
  absl::StatusOr<DeviceMemory::Side> RemoteSide(const Op& op, int device) {
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

  // Starts `op`'s device copy: kCopying, or kFailed with the reason.
  void StartDeviceCopy(Op& op) {
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

  // Local GPU memory and the peer's private memory (a region that is not from its pool): the
  // kernel's cross-memory copy cannot reach GPU memory, so the bytes go through this endpoint's
  // page-locked bounce buffer, one operation at a time. A write copies device-to-host into it,
  // then (PollDeviceCopies) to the peer; a read copies from the peer into it, then
  // host-to-device. Leaves `op` queued while an earlier operation holds the buffer.
  void StartBouncedCopy(Op& op, int device) {
    if (bounce_busy_) return;
    auto fail = [&](const absl::Status& s) {
      op.phase = Phase::kFailed;
      op.error = DeviceError(op, s);
    };
    if (absl::Status s = EnsureBounce(op.length); !s.ok()) {
      fail(s);
      return;
    }
    const bool read = op.kind == CompletionKind::kRead;
    if (read) {
      if (absl::Status s = CrossMemory(op, bounce_); !s.ok()) {
        fail(s);
        return;
      }
    }
    const DeviceMemory::Side local{op.local, true};
    const DeviceMemory::Side bounce{bounce_, false};
    absl::StatusOr<uint64_t> ticket =
        d_->device->StartCopy(device, read ? local : bounce, read ? bounce : local, op.length);
    if (!ticket.ok()) {
      fail(ticket.status());
      return;
    }
    op.ticket = *ticket;
    op.phase = Phase::kCopying;
    op.bounce = true;
    bounce_busy_ = true;
    ++device_copies_;
    Counters().device_ops.fetch_add(1, std::memory_order_relaxed);
    Counters().device_bytes.fetch_add(op.length, std::memory_order_relaxed);
    Counters().device_bounced_ops.fetch_add(1, std::memory_order_relaxed);
  }

  // A bounce buffer of at least `bytes`, page-locked where the runtime allows (else its copies
  // are synchronous, and still correct). It grows to the largest operation and stays.
  absl::Status EnsureBounce(size_t bytes) {
    if (bounce_bytes_ >= bytes) return absl::OkStatus();
    ReleaseBounce();
    const size_t size = std::max<size_t>(bytes, size_t{64} << 10);
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "shmem: a ", size, "-byte bounce buffer for GPU memory: ", std::strerror(errno)));
    }
    bounce_ = static_cast<char*>(p);
    bounce_bytes_ = size;
    bounce_pinned_ = d_->device->RegisterHost(bounce_, bounce_bytes_).ok();
    return absl::OkStatus();
  }

  void ReleaseBounce() {
    if (bounce_ == nullptr) return;
    if (bounce_pinned_) d_->device->UnregisterHost(bounce_);
    munmap(bounce_, bounce_bytes_);
    bounce_ = nullptr;
    bounce_bytes_ = 0;
    bounce_pinned_ = false;
  }

  // A bounced operation's device copy ended with `copied`: a write's bytes go on to the peer
  // if it succeeded (a failed copy left nothing worth sending); either way the bounce buffer is
  // free again. Returns the operation's outcome.
  absl::Status FinishBouncedCopy(const Op& op, absl::Status copied) {
    bounce_busy_ = false;
    if (!copied.ok() || op.kind == CompletionKind::kRead) return copied;
    return CrossMemory(op, bounce_);
  }

  // Starts every queued device copy, up to kMaxDeviceCopies running, also past host operations
  // queued ahead of them (control messages between tensors): the GPU then runs one copy after
  // another with no gap for the completions in between. Completions and immediates still go in
  // posting order (RunPending); only the bytes of a device write may land before those of a host
  // write posted earlier, which the protocol never aims at the same memory.
  void StartDeviceCopies() {
    if (device_copies_ >= kMaxDeviceCopies || !Usable().ok()) return;
    for (Op& op : pending_) {
      if (device_copies_ >= kMaxDeviceCopies) break;
      if (op.device && op.phase == Phase::kQueued) StartDeviceCopy(op);
    }
  }

  // Moves every finished device copy on (kCopied, or kFailed with its error), wherever it is in
  // the queue: device_copies_ counts the copies the GPU still runs, so a copy that finished
  // behind a host write waiting for ring room no longer keeps the progress thread polling.
  void PollDeviceCopies() {
    if (device_copies_ == 0) return;
    for (Op& op : pending_) {
      if (op.phase != Phase::kCopying) continue;
      absl::StatusOr<bool> done = d_->device->CopyDone(op.ticket);
      if (done.ok() && !*done) break;  // copies on a stream finish in order
      --device_copies_;
      absl::Status status = done.status();
      if (op.bounce) status = FinishBouncedCopy(op, std::move(status));
      if (status.ok()) {
        op.phase = Phase::kCopied;
      } else {
        op.phase = Phase::kFailed;
        op.error = DeviceError(op, status);
      }
    }
  }

  // Waits (up to 10 s) for the device copies still running, at teardown. Memory a copy that
  // never finished may still touch is then left mapped and imported: a leak, not a fault.
  void DrainDeviceCopies() {
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

  absl::Status DeviceError(const Op& op, const absl::Status& s) const {
    return absl::Status(
        s.code(),
        absl::StrCat("shmem: device ", op.kind == CompletionKind::kRead ? "read" : "write", " of ",
                     op.length, " bytes with the peer of ", LocalAddress(), ": ", s.message()));
  }

  absl::Status Copy(const Op& op) {
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
      } else {
        d_->copy_helpers->Copy(there, op.local, op.length, op.length >= kStreamingCopyBytes);
      }
      Counters().mapped_ops.fetch_add(1, std::memory_order_relaxed);
      Counters().mapped_bytes.fetch_add(op.length, std::memory_order_relaxed);
      return absl::OkStatus();
    }
    return CrossMemory(op, op.local);
  }

  // `op` between `local` (host memory here) and the peer's private memory: the kernel's
  // cross-memory copy. The pidfd check first, so a recycled pid can never receive the bytes.
  absl::Status CrossMemory(const Op& op, char* local) {
    const bool read = op.kind == CompletionKind::kRead;
    if (peer_pidfd_ >= 0) {
      pollfd p{peer_pidfd_, POLLIN, 0};
      if (poll(&p, 1, 0) > 0) return Break(PeerGone());
    }
    size_t done = 0;
    while (done < op.length) {
      iovec mine{local + done, op.length - done};
      iovec theirs{reinterpret_cast<void*>(op.remote_addr + done), op.length - done};
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
    Counters().cross_memory_bytes.fetch_add(op.length, std::memory_order_relaxed);
    return absl::OkStatus();
  }

  bool RingFull() const {
    const uint64_t head = Atomic(out_->head).load(std::memory_order_acquire);
    return out_tail_ - head >= out_capacity_;
  }

  void Publish(uint32_t imm, uint64_t byte_len) {
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

  void Complete(const Op& op, absl::Status status) {
    Completion c;
    c.kind = op.kind;
    c.endpoint = this;
    c.context = op.context;
    c.status = std::move(status);
    d_->local.push_back(std::move(c));
  }

  const absl::Duration op_timeout_;
  std::shared_ptr<DomainState> d_;
  std::shared_ptr<EndpointShared> shared_;
  RingHeader* const in_;
  uint64_t in_head_ = 0;
  bool ring_broken_ = false;

  int conn_fd_ = -1;
  uint64_t peer_uid_ = 0;
  pid_t peer_pid_ = 0;
  int peer_pidfd_ = -1;
  int peer_bell_fd_ = -1;
  RingHeader* out_ = nullptr;
  size_t out_bytes_ = 0;
  uint32_t out_capacity_ = 0;
  uint64_t out_tail_ = 0;
  absl::Status broken_;

  std::deque<Op> pending_;
  size_t outstanding_ = 0;
  std::map<uint64_t, Mapping> mappings_;
  uint64_t mapping_order_ = 0;
  // By (region, the local device it was imported on).
  std::map<std::pair<uint64_t, int>, DeviceMapping> device_mappings_;
  bool leak_device_memory_ = false;  // a copy never finished: keep what it may touch
  int device_copies_ = 0;
  // The bounce buffer between GPU memory and peers' private memory (StartBouncedCopy).
  char* bounce_ = nullptr;
  size_t bounce_bytes_ = 0;
  bool bounce_pinned_ = false;
  bool bounce_busy_ = false;
};

// ---- The domain -----------------------------------------------------------------------------

namespace {

class ShmemDomain final : public Domain {
 public:
  ShmemDomain(std::shared_ptr<DomainState> d, const DomainOptions& options)
      : d_(std::move(d)), options_(options) {
    caps_.backend = "shmem";
    caps_.provider = "shmem";
    caps_.family = "shmem";
    caps_.max_message_size = uint64_t{1} << 40;
    caps_.virtual_addressing = true;
    caps_.queue_depth = kRingCapacity;
    caps_.shared_memory = true;
    caps_.device_memory = d_->device != nullptr;
  }

  const Capabilities& capabilities() const override { return caps_; }

  absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemory(void* addr, size_t length,
                                                               uint32_t access) override {
    if (addr == nullptr || length == 0) {
      return absl::InvalidArgumentError("shmem: cannot register an empty region");
    }
    SharedMemory::Location where;
    const bool shared = SharedMemory::Find(addr, length, &where);
    const uint64_t id = d_->next_id.fetch_add(1);
    {
      MutexLock lock(&d_->mu);
      d_->regions[id] = RegionEntry{reinterpret_cast<uint64_t>(addr),
                                    length,
                                    access,
                                    shared ? where.fd : -1,
                                    where.file_size,
                                    -1,
                                    {}};
    }
    return std::unique_ptr<MemoryRegion>(
        new ShmemRegion(d_, id, addr, length, access, shared, shared ? where.offset : 0));
  }

  absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterDeviceMemory(void* addr, size_t length,
                                                                     int device,
                                                                     uint32_t access) override {
    if (d_->device == nullptr) {
      return absl::UnimplementedError("shmem: this domain has no GPU runtime for device memory");
    }
    if (addr == nullptr || length == 0 || device < 0) {
      return absl::InvalidArgumentError("shmem: cannot register an empty device region");
    }
    absl::StatusOr<std::string> handle = d_->device->Export(device, addr);
    if (!handle.ok()) {
      return absl::Status(handle.status().code(),
                          absl::StrCat("shmem: exporting ", length, " bytes of cuda:", device,
                                       " for peers: ", handle.status().message()));
    }
    if (handle->empty() || handle->size() > kMaxDeviceHandle) {
      return absl::InternalError(absl::StrCat("shmem: ", d_->device->Name(), " exported a ",
                                              handle->size(), "-byte handle; at most ",
                                              kMaxDeviceHandle, " fit"));
    }
    const uint64_t id = d_->next_id.fetch_add(1);
    {
      MutexLock lock(&d_->mu);
      d_->regions[id] = RegionEntry{
          reinterpret_cast<uint64_t>(addr), length, access, -1, 0, device, *std::move(handle)};
    }
    return std::unique_ptr<MemoryRegion>(
        new ShmemRegion(d_, id, addr, length, access, false, 0, device));
  }

  absl::StatusOr<std::unique_ptr<Endpoint>> CreateEndpoint() override {
    auto shared = std::make_shared<EndpointShared>();
    shared->id = d_->next_id.fetch_add(1);
    ASSIGN_OR_RETURN(shared->ring, SharedMemory::Create(kRingBytes, "tensorverbs-shmem-ring"));
    auto* h = static_cast<RingHeader*>(shared->ring->data());
    h->capacity = kRingCapacity;
    Atomic(h->magic).store(kRingMagic, std::memory_order_release);
    {
      MutexLock lock(&d_->mu);
      d_->endpoints[shared->id] = shared;
    }
    return std::unique_ptr<Endpoint>(new ShmemEndpoint(d_, shared, options_.op_timeout));
  }

  absl::StatusOr<size_t> Poll(absl::Span<Completion> out) override {
    std::vector<ShmemEndpoint*>& live = d_->live;
    const absl::Time now = CoarseNow();  // every turn of a progress loop: the cheap clock
    if (now >= next_connection_check_) {
      for (ShmemEndpoint* ep : live) ep->CheckConnection();
      next_connection_check_ = now + kConnectionCheckInterval;
    }
    for (ShmemEndpoint* ep : live) ep->RunPending();
    size_t n = 0;
    while (n < out.size() && !d_->local.empty()) {
      Completion& c = d_->local.front();
      static_cast<ShmemEndpoint*>(c.endpoint)->Delivered();
      out[n++] = std::move(c);
      d_->local.pop_front();
    }
    // Each Poll starts the rings at the next endpoint, so a busy one cannot starve the others.
    const size_t count = live.size();
    for (size_t k = 0; k < count && n < out.size(); ++k) {
      n += live[(next_ring_ + k) % count]->TakeInbound(out.subspan(n));
    }
    if (count > 0) next_ring_ = (next_ring_ + 1) % count;
    return n;
  }

  absl::Status Wait(absl::Duration timeout) override {
    if (!d_->local.empty() || timeout <= absl::ZeroDuration()) return absl::OkStatus();
    std::vector<ShmemEndpoint*>& live = d_->live;
    // While device copies run the progress thread does not sleep: a finished copy rings no bell,
    // and a timed sleep would add the timer's slack (tens of microseconds) to every tensor's
    // completion (measured: docs/PERFORMANCE.md). The copies bound how long it polls.
    for (ShmemEndpoint* ep : live) {
      if (ep->device_copies() > 0) return absl::OkStatus();
    }
    bool pending = false;
    for (ShmemEndpoint* ep : live) {
      ep->SetSleeping(1);
      pending |= ep->HasPending();
    }
    // Operations waiting for room in a peer's ring are retried soon: the peer rings no bell
    // when it makes room.
    if (pending) timeout = std::min(timeout, absl::Microseconds(100));
    bool ready = false;
    for (ShmemEndpoint* ep : live) ready |= ep->HasInbound();
    if (!ready) {
      // The doorbell, and our connections to the peers' servers: one that closes means its
      // peer is gone, which the next Poll reports.
      fds_.clear();
      fds_.push_back({d_->bell_fd, POLLIN, 0});
      for (ShmemEndpoint* ep : live) {
        if (ep->conn_fd() >= 0) fds_.push_back({ep->conn_fd(), POLLRDHUP, 0});
      }
      const timespec ts = absl::ToTimespec(timeout);
      if (ppoll(fds_.data(), fds_.size(), &ts, nullptr) < 0 && errno != EINTR) {
        const int e = errno;
        for (ShmemEndpoint* ep : live) ep->SetSleeping(0);
        return absl::UnavailableError(absl::StrCat("shmem: ppoll: ", std::strerror(e)));
      }
      for (size_t i = 1; i < fds_.size(); ++i) {
        if (fds_[i].revents != 0) next_connection_check_ = absl::InfinitePast();
      }
    }
    for (ShmemEndpoint* ep : live) ep->SetSleeping(0);
    uint64_t value;
    [[maybe_unused]] ssize_t r = read(d_->bell_fd, &value, sizeof(value));
    return absl::OkStatus();
  }

  void Interrupt() override { d_->Ring(); }

 private:
  // How often Poll looks for peers whose connection closed (Wait notices at once).
  static constexpr absl::Duration kConnectionCheckInterval = absl::Milliseconds(10);

  std::shared_ptr<DomainState> d_;
  const DomainOptions options_;
  Capabilities caps_;
  absl::Time next_connection_check_ = absl::InfinitePast();
  size_t next_ring_ = 0;
  std::vector<pollfd> fds_;
};

}  // namespace

CopyCounters& Counters() {
  static auto* counters = new CopyCounters;
  return *counters;
}

absl::StatusOr<std::unique_ptr<Domain>> OpenShmemDomain(const DomainOptions& options) {
  auto d = std::make_shared<DomainState>();
  d->pid = getpid();
  d->device = options.device_memory;
  if (options.copy_threads < 0 || options.copy_threads > kMaxCopyThreads) {
    return absl::InvalidArgumentError(
        absl::StrCat("shmem: ", options.copy_threads, " copy threads; 0 to ", kMaxCopyThreads));
  }
  d->copy_helpers = std::make_unique<CopyHelpers>(options.copy_threads);
  if (getrandom(&d->uid, sizeof(d->uid), 0) != sizeof(d->uid)) {
    return absl::UnavailableError(absl::StrCat("shmem: getrandom: ", std::strerror(errno)));
  }
  d->bell_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  d->stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (d->bell_fd < 0 || d->stop_fd < 0) {
    return absl::UnavailableError(absl::StrCat("shmem: eventfd: ", std::strerror(errno)));
  }
  d->listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (d->listen_fd < 0) {
    return absl::UnavailableError(absl::StrCat("shmem: socket: ", std::strerror(errno)));
  }
  socklen_t len;
  sockaddr_un addr = SocketAddress(d->uid, &len);
  if (bind(d->listen_fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
      listen(d->listen_fd, 64) != 0) {
    return absl::UnavailableError(
        absl::StrCat("shmem: listening on @", SocketName(d->uid), ": ", std::strerror(errno)));
  }
  // Probe what the data path needs, so a host without it fails here with the reason.
  absl::StatusOr<std::unique_ptr<SharedMemory>> probe =
      SharedMemory::Create(4096, "tensorverbs-shmem-probe");
  if (!probe.ok()) {
    return absl::UnavailableError(absl::StrCat("shmem: ", probe.status().message()));
  }
  d->server = std::thread([raw = d.get()] { raw->Serve(); });
  return std::unique_ptr<Domain>(new ShmemDomain(std::move(d), options));
}

}  // namespace tensorverbs::fabric::shmem
