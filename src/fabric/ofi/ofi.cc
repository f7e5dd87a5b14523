#include "src/fabric/ofi/ofi.h"

#include <poll.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/common/logging.h"
#include "src/common/net_address.h"
#include "src/common/status_macros.h"
#include "src/fabric/ofi/ofi_internal.h"

namespace tensorverbs::fabric::ofi {

std::string FiError(absl::string_view what, int ret) {
  return absl::StrCat(what, ": ", fi_strerror(-ret), " (", ret, ")");
}

namespace {

constexpr uint32_t kApiVersion = FI_VERSION(1, 9);

class OfiDomain final : public Domain {
 public:
  explicit OfiDomain(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {
    caps_.backend = "ofi";
    caps_.provider = shared_->info->fabric_attr->prov_name;
    caps_.family = absl::StrCat("ofi/", caps_.provider);
    caps_.max_message_size = shared_->info->ep_attr->max_msg_size;
    caps_.virtual_addressing = shared_->virtual_addressing();
    caps_.queue_depth = shared_->options.queue_depth;
    // Each registration gets a key of its own from the provider (FI_MR_PROV_KEY), so a
    // registration per endpoint is a key per channel; the providers run here do not bind keys
    // to endpoints (no FI_MR_ENDPOINT), so a key is only as private as it is hard to learn.
    caps_.channel_keys = true;
  }

  const Capabilities& capabilities() const override { return caps_; }

  absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemoryFor(Endpoint& endpoint, void* addr,
                                                                  size_t length,
                                                                  uint32_t access) override {
    (void)endpoint;
    return RegisterMemory(addr, length, access);
  }

  absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemory(void* addr, size_t length,
                                                               uint32_t access) override {
    if (addr == nullptr || length == 0) {
      return absl::InvalidArgumentError("ofi: cannot register an empty range");
    }
    uint64_t fi_access = FI_READ | FI_WRITE;
    if (access & kAccessRemoteWrite) fi_access |= FI_REMOTE_WRITE;
    if (access & kAccessRemoteRead) fi_access |= FI_REMOTE_READ;
    // Application-chosen keys must be unique per domain; ignored under FI_MR_PROV_KEY.
    const uint64_t requested_key = shared_->next_key.fetch_add(1);
    fid_mr* mr = nullptr;
    int ret =
        fi_mr_reg(shared_->domain, addr, length, fi_access, 0, requested_key, 0, &mr, nullptr);
    if (ret) {
      return absl::ResourceExhaustedError(
          absl::StrCat(FiError("ofi: fi_mr_reg", ret), " registering ", length,
                       " bytes; check the memlock limit (ulimit -l)"));
    }
    return std::unique_ptr<MemoryRegion>(new OfiRegion(shared_, mr, addr, length));
  }

  absl::StatusOr<std::unique_ptr<Endpoint>> CreateEndpoint() override {
    std::shared_ptr<Port> port = port_;
    if (port == nullptr) {
      const bool shares = shared_->routed_data && shared_->options.ofi_shared_endpoint;
      port = std::make_shared<Port>(shared_, shares);
      RETURN_IF_ERROR(port->Init());
      if (shares) port_ = port;  // opened with the first endpoint, kept with the domain
    }
    auto ep = std::make_unique<OfiEndpoint>(shared_, std::move(port));
    RETURN_IF_ERROR(ep->Init());
    return std::unique_ptr<Endpoint>(std::move(ep));
  }

  absl::Status Wait(absl::Duration timeout) override {
    Domain* self = this;
    return SleepOn(absl::MakeConstSpan(&self, 1), timeout);
  }

  absl::StatusOr<bool> PrepareToSleep(std::vector<pollfd>* fds, absl::Duration* timeout) override {
    fds->push_back(pollfd{shared_->wake.fd(), POLLIN, 0});
    fids_.clear();
    for (Port* port : shared_->ports) {
      if (port->wait_fd() < 0) {
        // No wait object on this provider (shm): nap briefly on the interrupt fd alone, so a
        // local post (a new recv) ends the nap at once and peer traffic waits at most one nap.
        *timeout = std::min(*timeout, absl::Microseconds(50));
        return true;
      }
      fids_.push_back(port->cq_fid());
      fds->push_back(pollfd{port->wait_fd(), POLLIN, 0});
    }
    if (!fids_.empty()) {
      // fi_trywait drives pending progress and says whether blocking is safe (nothing to read).
      int ret = fi_trywait(shared_->fabric, fids_.data(), static_cast<int>(fids_.size()));
      if (ret == -FI_EAGAIN) return false;
      if (ret != 0) return absl::UnavailableError(FiError("ofi: fi_trywait", ret));
    }
    return true;
  }

  void FinishSleep(absl::Span<const pollfd> fds) override {
    if (!fds.empty() && fds[0].revents != 0) shared_->wake.Drain();
  }

  void Interrupt() override { shared_->wake.Signal(); }

  absl::StatusOr<size_t> Poll(absl::Span<Completion> out) override {
    size_t produced = 0;
    const size_t n = shared_->ports.size();
    for (size_t i = 0; i < n && produced < out.size(); ++i) {
      produced += shared_->ports[(next_port_ + i) % n]->Progress(out.subspan(produced));
    }
    if (n > 0) next_port_ = (next_port_ + 1) % n;
    return produced + DrainActive(shared_->active, out.subspan(produced));
  }

 private:
  std::shared_ptr<Shared> shared_;
  std::shared_ptr<Port> port_;  // the endpoint every endpoint shares, where they share one
  Capabilities caps_;
  size_t next_port_ = 0;
  std::vector<fid*> fids_;  // PrepareToSleep's, kept to reuse its storage
};

// libfabric's rxm layer (tcp;ofi_rxm, verbs;ofi_rxm) gives each endpoint, by default, a shared
// receive context of 4096 bounce buffers of 16 KiB: 64 MiB per endpoint, and this backend opens
// one endpoint per channel, two channels per peer. Measured (bench scale, 8 tasks in network
// namespaces): 1.26 GB of proportional memory per task, and 4.6 s to set up its channels. The
// protocol moves tensors by RMA writes, which take no bounce buffer; the rxm messages that do
// are rare and small. 256 buffers of 8 KiB bring a task to 0.36 GB and its set-up to 1.0 s, and
// raise the small-tensor rate over tcp (docs/perf/history.md). Buffers of 2 KiB halve what each
// endpoint keeps beside them (8 tasks over tcp: 358 to 178 MiB of proportional memory per task)
// at the same speed, measured from 4 B to 64 MiB, which is what lets 4 hosts of 8 tasks run on
// one 24 GiB machine. rxm reads these variables once, when libfabric first loads it (the first
// fi_getinfo), so they are set, where the user has not set them, at this backend's first call.
void SetRxmDefaults() {
  static std::once_flag once;
  std::call_once(once, [] {
    setenv("FI_OFI_RXM_BUFFER_SIZE", "2048", /*overwrite=*/0);
    setenv("FI_OFI_RXM_EAGER_LIMIT", "2048", /*overwrite=*/0);
    setenv("FI_OFI_RXM_MSG_RX_SIZE", "256", /*overwrite=*/0);
  });
}

fi_info* MakeHints(const std::string& provider, size_t cq_data_size = 4) {
  SetRxmDefaults();
  fi_info* hints = fi_allocinfo();
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_MSG;
  hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->domain_attr->cq_data_size = cq_data_size;
  // Control messages land in posting order (see fabric.h).
  hints->tx_attr->msg_order = FI_ORDER_WAW;
  hints->rx_attr->msg_order = FI_ORDER_WAW;
  if (!provider.empty()) hints->fabric_attr->prov_name = strdup(provider.c_str());
  return hints;
}

bool HasSocketAddress(const fi_info* info) {
  return info->addr_format == FI_SOCKADDR || info->addr_format == FI_SOCKADDR_IN ||
         info->addr_format == FI_SOCKADDR_IN6;
}

// The entry of `list` whose interface holds `source` (a name or an address), or null: each
// entry of a socket-addressed provider (tcp, verbs) is one interface, with its address as the
// entry's source. Matching here, rather than asking fi_getinfo with FI_SOURCE, also refuses an
// address that no interface holds (tcp would accept it and fail every endpoint with
// EADDRNOTAVAIL).
fi_info* EntryWithSource(fi_info* list, const std::string& source) {
  fi_info* match = nullptr;
  // An interface's name: the entry's domain (tcp names its domains after the interfaces), its
  // IPv4 address first (an interface lists its IPv6 link-local address too, which the peers'
  // IPv4 lanes would not reach).
  for (bool ipv4_only : {true, false}) {
    for (fi_info* i = list; i != nullptr; i = i->next) {
      if (HasSocketAddress(i) && i->domain_attr != nullptr && i->domain_attr->name != nullptr &&
          source == i->domain_attr->name &&
          (!ipv4_only || (i->src_addr != nullptr &&
                          static_cast<const sockaddr*>(i->src_addr)->sa_family == AF_INET))) {
        return i;
      }
    }
  }
  AnyResolvedAddress(source, [&](const sockaddr* a) {
    for (fi_info* i = list; i != nullptr; i = i->next) {
      if (HasSocketAddress(i) && SameIp(static_cast<const sockaddr*>(i->src_addr), a)) {
        match = i;
        return true;
      }
    }
    return false;
  });
  return match;
}

absl::StatusOr<std::shared_ptr<Shared>> OpenProvider(const DomainOptions& options,
                                                     const std::string& provider) {
  // 8 bytes of CQ data let every endpoint of a domain share one provider endpoint
  // (ofi_internal.h); 4 are what the protocol's immediates need.
  fi_info* info = nullptr;
  int ret = -FI_ENODATA;
  for (size_t cq_data_size : {8, 4}) {
    fi_info* hints = MakeHints(provider, cq_data_size);
    ret = fi_getinfo(kApiVersion, nullptr, nullptr, 0, hints, &info);
    fi_freeinfo(hints);
    if (ret == 0 && info != nullptr) break;
  }
  if (ret || info == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "ofi: provider '", provider, "' offers no RDM endpoint with RMA and remote CQ data here (",
        fi_strerror(-ret), "); `fi_info` lists the providers"));
  }
  fi_info* chosen = info;
  // shm and other providers that name endpoints themselves have no interfaces to choose from.
  if (!options.source_address.empty() && HasSocketAddress(info)) {
    chosen = EntryWithSource(info, options.source_address);
    if (chosen == nullptr && options.require_source) {
      fi_freeinfo(info);
      return absl::NotFoundError(absl::StrCat(
          "ofi: provider '", provider, "' has no interface with address ", options.source_address));
    }
    if (chosen == nullptr) {
      LOG(INFO) << "ofi: provider '" << provider << "' has no interface with address "
                << options.source_address << "; its endpoints bind to its first, "
                << info->domain_attr->name;
      chosen = info;
    }
  }
  auto shared = std::make_shared<Shared>();
  shared->options = options;
  shared->info = fi_dupinfo(chosen);  // the one entry, not the rest of the list
  fi_freeinfo(info);
  ret = fi_fabric(shared->info->fabric_attr, &shared->fabric, nullptr);
  if (ret) return absl::UnavailableError(FiError("ofi: fi_fabric", ret));
  ret = fi_domain(shared->fabric, shared->info, &shared->domain, nullptr);
  if (ret) return absl::UnavailableError(FiError("ofi: fi_domain", ret));
  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  ret = fi_av_open(shared->domain, &av_attr, &shared->av, nullptr);
  if (ret) return absl::UnavailableError(FiError("ofi: fi_av_open", ret));
  shared->routed_data = shared->info->domain_attr->cq_data_size >= 8;
  return shared;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Domain>> OpenOfiDomain(const DomainOptions& options) {
  if (options.provider.empty()) {
    return absl::InvalidArgumentError("ofi: no provider named (fabric::OpenDomain chooses one)");
  }
  ASSIGN_OR_RETURN(std::shared_ptr<Shared> shared, OpenProvider(options, options.provider));
  return std::unique_ptr<Domain>(new OfiDomain(std::move(shared)));
}

std::vector<std::string> ListUsableProviders() { return ListProviders(false); }

std::vector<std::string> ListProviders(bool device_memory) {
  std::vector<std::pair<std::string, std::vector<std::string>>> found;  // provider -> fabrics
  fi_info* hints = MakeHints("");
  // FI_HMEM: the provider registers and moves device (GPU) memory itself.
  if (device_memory) hints->caps |= FI_HMEM;
  fi_info* info = nullptr;
  if (fi_getinfo(kApiVersion, nullptr, nullptr, 0, hints, &info) == 0) {
    for (fi_info* i = info; i != nullptr; i = i->next) {
      std::string prov = i->fabric_attr->prov_name, fabric = i->fabric_attr->name;
      auto it =
          std::find_if(found.begin(), found.end(), [&](const auto& p) { return p.first == prov; });
      if (it == found.end()) it = found.insert(found.end(), {prov, {}});
      if (std::find(it->second.begin(), it->second.end(), fabric) == it->second.end()) {
        it->second.push_back(fabric);
      }
    }
    fi_freeinfo(info);
  }
  fi_freeinfo(hints);
  std::vector<std::string> out;
  for (const auto& [prov, fabrics] : found) {
    out.push_back(absl::StrCat(prov, " (", absl::StrJoin(fabrics, ", "), ")"));
  }
  return out;
}

}  // namespace tensorverbs::fabric::ofi
