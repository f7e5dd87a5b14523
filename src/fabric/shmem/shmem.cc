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
#include "src/fabric/shmem/endpoint.h"
#include "src/fabric/shmem/region.h"
#include "src/fabric/shmem/wire.h"

namespace tensorverbs::fabric::shmem {
namespace {

// DomainOptions::copy_threads at most.
constexpr int kMaxCopyThreads = 64;

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
    // First the peers' shared writes, while their writers are still copying: every part we take
    // is one they need not.
    for (ShmemEndpoint* ep : live) ep->HelpWithSharedWrite();
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
    Domain* self = this;
    return SleepOn(absl::MakeConstSpan(&self, 1), timeout);
  }

  absl::StatusOr<bool> PrepareToSleep(std::vector<pollfd>* fds, absl::Duration* timeout) override {
    asleep_ = false;
    if (!d_->local.empty() || *timeout <= absl::ZeroDuration()) return false;
    std::vector<ShmemEndpoint*>& live = d_->live;
    // While device copies run the progress thread does not sleep: a finished copy rings no bell,
    // and a timed sleep would add the timer's slack (tens of microseconds) to every tensor's
    // completion (measured: docs/perf/history.md). The copies bound how long it polls.
    for (ShmemEndpoint* ep : live) {
      if (ep->device_copies() > 0) return false;
    }
    asleep_ = true;
    bool pending = false;
    for (ShmemEndpoint* ep : live) {
      ep->SetSleeping(1);
      pending |= ep->HasPending();
    }
    // Operations waiting for room in a peer's ring are retried soon: the peer rings no bell
    // when it makes room.
    if (pending) *timeout = std::min(*timeout, absl::Microseconds(100));
    for (ShmemEndpoint* ep : live) {
      if (ep->HasInbound()) return false;
    }
    // The doorbell, and our connections to the peers' servers: one that closes means its peer
    // is gone, which the next Poll reports. Once it has, that connection is left out: it stays
    // hung up until the channel closes the endpoint, and every sleep would end at once, the
    // thread spinning through them (a peer timeout's worth, with no operation to fail).
    fds->push_back({d_->bell_fd, POLLIN, 0});
    for (ShmemEndpoint* ep : live) {
      if (ep->conn_fd() >= 0 && !ep->PeerKnownGone()) {
        fds->push_back({ep->conn_fd(), POLLRDHUP, 0});
      }
    }
    return true;
  }

  void FinishSleep(absl::Span<const pollfd> fds) override {
    if (!asleep_) return;
    asleep_ = false;
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents != 0) next_connection_check_ = absl::InfinitePast();
    }
    for (ShmemEndpoint* ep : d_->live) ep->SetSleeping(0);
    uint64_t value;
    [[maybe_unused]] ssize_t r = read(d_->bell_fd, &value, sizeof(value));
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
  bool asleep_ = false;  // PrepareToSleep told the peers to ring; FinishSleep takes it back
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
  d->peer_copy = options.peer_copy;
  d->peer_window_bytes = options.peer_window_bytes;
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
