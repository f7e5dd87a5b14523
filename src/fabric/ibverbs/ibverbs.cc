#include "src/fabric/ibverbs/ibverbs.h"

#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"
#include "src/fabric/ibverbs/device_selection.h"
#include "src/fabric/ibverbs/ibverbs_internal.h"
#include "src/fabric/ibverbs/inventory.h"
#include "src/fabric/pci_topology.h"

namespace tensorverbs::fabric::ibverbs {
namespace {

class IbvDomain final : public Domain {
 public:
  explicit IbvDomain(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {
    caps_.backend = "ibverbs";
    caps_.provider = absl::StrCat(shared_->selection.device, ":", shared_->selection.port);
    caps_.family = "ibverbs";
    caps_.max_message_size = std::min<uint64_t>(shared_->attr.max_mr_size, UINT32_MAX);
    caps_.virtual_addressing = true;
    caps_.queue_depth = shared_->options.queue_depth;
    caps_.channel_keys = caps_.endpoint_bound_keys = shared_->windows;
  }
  const Capabilities& capabilities() const override { return caps_; }

  // A window bound to the endpoint's queue pair over the bindable registration that holds the
  // range (registering one if none does). Before the endpoint is connected there is no queue
  // pair to bind to: the range gets a registration of its own (its own key, dropped with it,
  // but not bound to the endpoint), which is what a channel's message slots get.
  absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemoryFor(Endpoint& endpoint, void* addr,
                                                                  size_t length,
                                                                  uint32_t access) override {
    if (!shared_->windows) return Domain::RegisterMemoryFor(endpoint, addr, length, access);
    auto& ep = static_cast<IbvEndpoint&>(endpoint);
    if (!ep.connected()) return RegisterMemory(addr, length, access);
    if (addr == nullptr || length == 0) {
      return absl::InvalidArgumentError("ibverbs: cannot register an empty range");
    }
    ibv_mr* mr = nullptr;
    bool owned = false;
    const auto a = reinterpret_cast<uintptr_t>(addr);
    auto it = shared_->bindable.upper_bound(a);
    if (it != shared_->bindable.begin()) {
      const IbvRegion* r = std::prev(it)->second;
      if (r->Contains(addr, length)) mr = r->mr();
    }
    if (mr == nullptr) {
      ASSIGN_OR_RETURN(mr, Register(addr, length, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND));
      owned = true;
    }
    int flags = 0;
    if (access & kAccessRemoteWrite) flags |= IBV_ACCESS_REMOTE_WRITE;
    if (access & kAccessRemoteRead) flags |= IBV_ACCESS_REMOTE_READ;
    absl::StatusOr<std::pair<ibv_mw*, uint32_t>> window = ep.BindWindow(mr, addr, length, flags);
    if (!window.ok()) {
      if (owned) ibv_dereg_mr(mr);
      return window.status();
    }
    return std::unique_ptr<MemoryRegion>(
        new IbvWindow(shared_, window->first, window->second, mr, owned, addr, length));
  }

  absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemory(void* addr, size_t length,
                                                               uint32_t access) override {
    if (addr == nullptr || length == 0) {
      return absl::InvalidArgumentError("ibverbs: cannot register an empty range");
    }
    int flags = IBV_ACCESS_LOCAL_WRITE;
    if (access & kAccessRemoteWrite) flags |= IBV_ACCESS_REMOTE_WRITE;
    if (access & kAccessRemoteRead) flags |= IBV_ACCESS_REMOTE_READ;
    // Bindable where windows work, so channels' windows need no registration of their own.
    if (shared_->windows) flags |= IBV_ACCESS_MW_BIND;
    ASSIGN_OR_RETURN(ibv_mr * mr, Register(addr, length, flags));
    return std::unique_ptr<MemoryRegion>(
        new IbvRegion(shared_, mr, addr, length, shared_->windows));
  }

  absl::StatusOr<std::unique_ptr<Endpoint>> CreateEndpoint() override {
    if (!shared_->device_error.ok()) return shared_->device_error;
    auto ep = std::make_unique<IbvEndpoint>(shared_);
    RETURN_IF_ERROR(ep->Init());
    return std::unique_ptr<Endpoint>(std::move(ep));
  }

  absl::Status Wait(absl::Duration timeout) override {
    Domain* self = this;
    return SleepOn(absl::MakeConstSpan(&self, 1), timeout);
  }

  absl::StatusOr<bool> PrepareToSleep(std::vector<pollfd>* fds, absl::Duration* timeout) override {
    (void)timeout;
    bool ready = false;
    if (shared_->cq != nullptr) ready |= ArmSharedAndCheck();
    for (IbvEndpoint* ep : shared_->endpoints) ready |= ep->ArmAndCheck();
    if (ready) return false;
    fds->push_back({shared_->channel->fd, POLLIN, 0});
    fds->push_back({shared_->ctx->async_fd, POLLIN, 0});
    fds->push_back({shared_->wake.fd(), POLLIN, 0});
    return true;
  }

  void FinishSleep(absl::Span<const pollfd> fds) override {
    if (fds.size() < 3) return;
    if (fds[2].revents != 0) shared_->wake.Drain();
    if (fds[0].revents == 0) return;
    // Drain the channel (its fd is non-blocking); the events are acknowledged in batches.
    ibv_cq* cq = nullptr;
    void* cq_context = nullptr;
    while (ibv_get_cq_event(shared_->channel, &cq, &cq_context) == 0) {
      if (cq == shared_->cq) {
        // Acknowledging takes a lock in the library: once per batch, not per event.
        if (++shared_->cq_unacked_events >= kEventAckBatch) {
          ibv_ack_cq_events(shared_->cq, shared_->cq_unacked_events);
          shared_->cq_unacked_events = 0;
        }
        continue;
      }
      for (IbvEndpoint* ep : shared_->endpoints) {
        if (ep->cq() == cq) ep->AckEvent();
      }
    }
  }

  void Interrupt() override { shared_->wake.Signal(); }

  absl::StatusOr<size_t> Poll(absl::Span<Completion> out) override {
    ReadAsyncEvents();
    size_t produced = 0;
    if (shared_->cq != nullptr) produced += PollShared(out);
    const size_t n = shared_->endpoints.size();
    for (size_t i = 0; i < n && produced < out.size(); ++i) {
      produced += shared_->endpoints[(next_ + i) % n]->Progress(out.subspan(produced));
    }
    if (n > 0) next_ = (next_ + 1) % n;
    return produced + DrainActive(shared_->active, out.subspan(produced));
  }

 private:
  static constexpr unsigned int kEventAckBatch = 64;

  // The shared CQ's completions, stashed first, each handed to its queue pair's endpoint; one of
  // a queue pair that is gone is dropped (its room given back all the same).
  size_t PollShared(absl::Span<Completion> out) {
    size_t produced = 0;
    std::vector<ibv_wc>& stash = shared_->stash;
    ibv_wc wc[32];
    while (produced < out.size()) {
      const int room = static_cast<int>(std::min<size_t>(32, out.size() - produced));
      int n;
      const bool from_stash = !stash.empty();
      if (from_stash) {
        n = std::min(static_cast<int>(stash.size()), room);
        std::copy_n(stash.begin(), n, wc);
        stash.erase(stash.begin(), stash.begin() + n);
      } else {
        n = ibv_poll_cq(shared_->cq, room, wc);
      }
      if (n < 0) {
        LOG(WARNING) << "ibverbs: ibv_poll_cq failed on " << shared_->selection.device;
        break;
      }
      if (n == 0) break;
      for (int i = 0; i < n; ++i) {
        if (!from_stash) GiveBack(*shared_, wc[i]);  // a stashed one gave back as it was taken
        auto it = shared_->by_qp.find(wc[i].qp_num);
        if (it != shared_->by_qp.end() && it->second->Handle(wc[i], &out[produced])) ++produced;
      }
    }
    return produced;
  }

  // Arms the shared CQ, then collects what arrived before arming (a completion that raced the
  // arming would raise no event). Returns whether anything is ready.
  bool ArmSharedAndCheck() {
    if (ibv_req_notify_cq(shared_->cq, 0) != 0) return true;  // cannot arm: let the caller poll
    TakeCompletions(*shared_);
    return !shared_->stash.empty();
  }

  absl::StatusOr<ibv_mr*> Register(void* addr, size_t length, int flags) {
    ibv_mr* mr = ibv_reg_mr(shared_->pd, addr, length, flags);
    if (mr == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat(Errno("ibv_reg_mr", errno), " registering ", length,
                       " bytes; check the memlock limit (ulimit -l)"));
    }
    return mr;
  }

  // The async fd is non-blocking, so this never waits: no extra thread is needed.
  void ReadAsyncEvents() {
    ibv_async_event event;
    while (ibv_get_async_event(shared_->ctx, &event) == 0) {
      const char* what = ibv_event_type_str(event.event_type);
      switch (event.event_type) {
        case IBV_EVENT_QP_FATAL:
        case IBV_EVENT_QP_REQ_ERR:
        case IBV_EVENT_QP_ACCESS_ERR:
          if (auto it = shared_->by_qp.find(event.element.qp->qp_num); it != shared_->by_qp.end()) {
            it->second->SetError(
                absl::UnavailableError(absl::StrCat("ibverbs: queue pair error: ", what)));
          }
          break;
        case IBV_EVENT_DEVICE_FATAL:
        case IBV_EVENT_PORT_ERR:
        case IBV_EVENT_SRQ_ERR:  // every channel's receives are on it
          if (shared_->device_error.ok()) {
            shared_->device_error = absl::UnavailableError(
                absl::StrCat("ibverbs (", shared_->selection.device, " port ",
                             shared_->selection.port, "): ", what));
          }
          break;
        default:
          break;
      }
      LOG(WARNING) << "ibverbs: async event on " << shared_->selection.device << ": " << what;
      ibv_ack_async_event(&event);
    }
  }

  std::shared_ptr<Shared> shared_;
  Capabilities caps_;
  size_t next_ = 0;
};

// One completion queue and one shared receive queue for every queue pair of the domain, where the
// device has shared receive queues and a CQ large enough for the receives and a useful number of
// sends. Elsewhere each endpoint keeps its own (as before), which is logged once.
absl::Status OpenSharedQueues(Shared& shared) {
  const ibv_device_attr& attr = shared.attr;
  const uint32_t srq_depth =
      std::min<uint32_t>(kSrqDepth, static_cast<uint32_t>(std::max(attr.max_srq_wr, 0)));
  const size_t max_cqe = static_cast<size_t>(std::max(attr.max_cqe, 0));
  const size_t send_room = max_cqe > srq_depth + kSharedBindRoom
                               ? std::min(kSharedSendRoom, max_cqe - srq_depth - kSharedBindRoom)
                               : 0;
  if (attr.max_srq <= 0 || srq_depth == 0 || send_room < kMinSharedSendRoom) {
    LOG(INFO) << "ibverbs: " << shared.selection.device
              << " has no shared receive queue (or too small a completion queue): each channel "
                 "gets a completion queue and receive queue of its own";
    return absl::OkStatus();
  }
  ibv_srq_init_attr init{};
  init.attr.max_wr = srq_depth;
  init.attr.max_sge = 1;
  shared.srq = ibv_create_srq(shared.pd, &init);
  if (shared.srq == nullptr) {
    LOG(INFO) << "ibverbs: " << Errno("ibv_create_srq", errno)
              << ": each channel gets a receive queue of its own";
    return absl::OkStatus();
  }
  const int cqe = static_cast<int>(srq_depth + send_room + kSharedBindRoom);
  shared.cq = ibv_create_cq(shared.ctx, cqe, nullptr, shared.channel, 0);
  if (shared.cq == nullptr) {
    // A device may refuse a CQ this large for want of memory though its max_cqe allows it:
    // channels then keep queues of their own, as on a device without shared receive queues.
    LOG(INFO) << "ibverbs: " << Errno("ibv_create_cq", errno) << " (the domain's, of " << cqe
              << " entries): each channel gets a completion queue and receive queue of its own";
    ibv_destroy_srq(shared.srq);
    shared.srq = nullptr;
    return absl::OkStatus();
  }
  shared.send_room = send_room;
  shared.send_reserve = send_room / 4;
  shared.fair_sends = std::clamp<size_t>(shared.send_reserve / 4, 1, kFairSends);
  shared.bind_room = shared.bind_total = kSharedBindRoom;
  for (uint32_t i = 0; i < srq_depth; ++i) RETURN_IF_ERROR(PostSharedReceive(shared));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Domain>> OpenIbverbsDomain(const DomainOptions& options,
                                                          const RdmaConfig& config) {
  ASSIGN_OR_RETURN(Inventory inventory, ReadInventory());
  // The NIC nearest the GPU the task's tensors live on, where the domain reaches GPU memory.
  const std::string gpu = options.device_memory != nullptr
                              ? PciPathOfBusId(options.device_memory->PciBusId(0))
                              : std::string();
  ASSIGN_OR_RETURN(Selection selection, SelectDevice(inventory, config, CurrentNumaNode(), gpu));
  auto shared = std::make_shared<Shared>();
  shared->selection = selection;
  shared->config = config;
  shared->options = options;
  shared->options.queue_depth =
      std::min(options.queue_depth, static_cast<size_t>(config.queue_depth));

  int num = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (list == nullptr) return absl::UnavailableError(Errno("ibv_get_device_list", errno));
  for (int i = 0; i < num && shared->ctx == nullptr; ++i) {
    if (selection.device == ibv_get_device_name(list[i])) shared->ctx = ibv_open_device(list[i]);
  }
  ibv_free_device_list(list);
  if (shared->ctx == nullptr) {
    return absl::UnavailableError(absl::StrCat("ibverbs: cannot open ", selection.device));
  }
  if (ibv_query_device(shared->ctx, &shared->attr) != 0) {
    return absl::UnavailableError(Errno("ibv_query_device", errno));
  }
  shared->pd = ibv_alloc_pd(shared->ctx);
  if (shared->pd == nullptr) return absl::UnavailableError(Errno("ibv_alloc_pd", errno));
  // Type-2 windows, where the device says so and one can be allocated (some drivers leave
  // alloc_mw out).
  if ((shared->attr.device_cap_flags &
       (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_WINDOW_TYPE_2B)) != 0) {
    if (ibv_mw* probe = ibv_alloc_mw(shared->pd, IBV_MW_TYPE_2); probe != nullptr) {
      ibv_dealloc_mw(probe);
      shared->windows = true;
    } else {
      LOG(INFO) << "ibverbs: " << selection.device
                << " reports type-2 memory windows but cannot allocate one ("
                << std::strerror(errno) << "): one key per region for every peer";
    }
  }
  shared->channel = ibv_create_comp_channel(shared->ctx);
  if (shared->channel == nullptr) {
    return absl::UnavailableError(Errno("ibv_create_comp_channel", errno));
  }
  RETURN_IF_ERROR(OpenSharedQueues(*shared));
  // Both are read without blocking on the progress thread; Wait blocks on them with poll().
  for (int fd : {shared->ctx->async_fd, shared->channel->fd}) {
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  }
  LOG(INFO) << "ibverbs: using " << selection.reason;
  return std::unique_ptr<Domain>(new IbvDomain(std::move(shared)));
}

}  // namespace tensorverbs::fabric::ibverbs
