#include "src/fabric/fabric.h"

#include <poll.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"
#include "src/fabric/ibverbs/device_selection.h"
#include "src/fabric/ibverbs/ibverbs.h"
#include "src/fabric/ibverbs/inventory.h"
#include "src/fabric/loopback/loopback.h"
#include "src/fabric/ofi/ofi.h"
#include "src/fabric/pci_topology.h"
#include "src/fabric/shmem/shmem.h"

namespace tensorverbs::fabric {

std::vector<std::string> BackendNames() {
#if defined(TENSORVERBS_HAVE_IBVERBS)
  return {"loopback", "shmem", "ofi", "ibverbs"};
#else
  return {"loopback", "shmem", "ofi"};
#endif
}

absl::StatusOr<std::unique_ptr<Domain>> OpenDomain(absl::string_view backend,
                                                   const DomainOptions& options) {
  if (options.queue_depth == 0)
    return absl::InvalidArgumentError("fabric: queue depth must be > 0");
  if (backend == "loopback") return loopback::OpenLoopbackDomain(options);
  if (backend == "shmem") return shmem::OpenShmemDomain(options);
  if (backend == "ofi") {
    if (options.provider.empty()) {
      DomainOptions chosen = options;
      chosen.provider = ChooseOfiProvider("", false, ListOfiProviders());
      return ofi::OpenOfiDomain(chosen);
    }
    return ofi::OpenOfiDomain(options);
  }
#if defined(TENSORVERBS_HAVE_IBVERBS)
  if (backend == "ibverbs") return ibverbs::OpenIbverbsDomain(options, options.rdma);
#endif
  return absl::InvalidArgumentError(absl::StrCat(
      "fabric: unknown backend '", backend, "'; available: ", absl::StrJoin(BackendNames(), ", ")));
}

absl::Status SleepOn(absl::Span<Domain* const> domains, absl::Duration timeout) {
  // The progress thread sleeps often in the blocking and adaptive modes: no allocation per sleep.
  thread_local std::vector<pollfd> fds;
  thread_local std::vector<size_t> ends;
  fds.clear();
  ends.clear();
  bool may_sleep = timeout > absl::ZeroDuration();
  absl::Status status;
  for (Domain* d : domains) {
    absl::StatusOr<bool> ok = d->PrepareToSleep(&fds, &timeout);
    ends.push_back(fds.size());
    if (!ok.ok()) {
      status = ok.status();
      may_sleep = false;
      break;
    }
    may_sleep &= *ok;
  }
  if (may_sleep && timeout > absl::ZeroDuration()) {
    const timespec ts = absl::ToTimespec(timeout);
    if (ppoll(fds.data(), fds.size(), &ts, nullptr) < 0 && errno != EINTR) {
      status = absl::UnavailableError(absl::StrCat("fabric: ppoll: ", std::strerror(errno)));
    }
  } else {
    for (pollfd& f : fds) f.revents = 0;
  }
  // Every domain that prepared finishes, whatever happened after it.
  size_t begin = 0;
  for (size_t i = 0; i < ends.size(); ++i) {
    domains[i]->FinishSleep(absl::MakeConstSpan(fds.data() + begin, ends[i] - begin));
    begin = ends[i];
  }
  return status;
}

bool UsesSharedMemory(const FabricChoice& choice) {
  return choice.fabric == "shmem" || (choice.fabric == "auto" && choice.all_peers_local);
}

std::string ChooseOfiProvider(const std::string& configured, bool all_peers_local,
                              const std::vector<std::string>& available) {
  if (!configured.empty()) return configured;
  auto has = [&](absl::string_view name) {
    return std::any_of(available.begin(), available.end(), [&](const std::string& a) {
      return a == name || absl::StartsWith(a, absl::StrCat(name, " ("));
    });
  };
  for (const char* hw : {"verbs;ofi_rxm", "efa", "cxi", "psm3"}) {
    if (has(hw)) return hw;
  }
  if (all_peers_local && has("shm")) return "shm";
  return "tcp;ofi_rxm";
}

std::vector<std::string> ListOfiProviders() { return ofi::ListUsableProviders(); }

FabricProcessStats ReadFabricProcessStats() {
  FabricProcessStats stats;
  stats.provider_endpoints = ofi::OpenPorts();
  stats.late_immediates_dropped = ofi::LateImmediatesDropped();
  stats.peer_addresses = ofi::PeerAddresses();
  return stats;
}

namespace {

DomainOptions OptionsOf(const FabricChoice& choice) {
  DomainOptions options;
  options.rdma = choice.rdma;
  options.device_memory = choice.device_memory;
  options.copy_threads = choice.copy_threads;
  options.peer_copy = choice.peer_copy;
  options.source_address = choice.source_address;
  options.ofi_shared_endpoint = choice.ofi_shared_endpoint;
  return options;
}

}  // namespace

bool OpensSameHostFabric(const FabricChoice& choice) {
  return choice.fabric == "auto" && !choice.all_peers_local && choice.some_peers_local;
}

absl::StatusOr<std::unique_ptr<Domain>> OpenSameHostFabric(const FabricChoice& choice) {
  return OpenDomain("shmem", OptionsOf(choice));
}

absl::StatusOr<std::unique_ptr<Domain>> OpenLaneDomain(const FabricChoice& choice,
                                                       const Domain& primary,
                                                       const std::string& source) {
  const Capabilities& caps = primary.capabilities();
  if (caps.backend == "ibverbs") {
    DomainOptions options = OptionsOf(choice);
    const std::vector<std::string> parts = absl::StrSplit(source, ':');
    options.rdma.device = parts[0];
    options.rdma.port = 0;
    if (parts[0].empty() || parts.size() > 2 ||
        (parts.size() == 2 &&
         (!absl::SimpleAtoi(parts[1], &options.rdma.port) || options.rdma.port < 1))) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", source, "' is no RDMA device: give a name, or NAME:PORT"));
    }
    ASSIGN_OR_RETURN(std::unique_ptr<Domain> lane, OpenDomain("ibverbs", options));
    if (lane->capabilities().provider == caps.provider) {
      return absl::InvalidArgumentError(
          absl::StrCat("it is ", caps.provider, ", the port the task's first lane uses"));
    }
    return lane;
  }
  if (caps.backend != "ofi" || SameHostOnly(caps.family)) {
    return absl::UnimplementedError(absl::StrCat(
        "lanes run over ibverbs and libfabric's network providers (tcp), not over ", caps.family));
  }
  DomainOptions options = OptionsOf(choice);
  options.provider = caps.provider;
  options.source_address = source;
  options.require_source = true;
  return OpenDomain("ofi", options);
}

RailPlan PlanRails(const FabricChoice& choice, const Domain& primary, int count) {
  const Capabilities& caps = primary.capabilities();
  // The task's tensors live on its first GPU where the fabric reaches GPU memory (each rank
  // sees its own GPU first, as CUDA_VISIBLE_DEVICES gives it): the NICs nearest it rank first.
  const std::string gpu =
      choice.device_memory != nullptr ? PciPathOfBusId(choice.device_memory->PciBusId(0)) : "";
  if (caps.backend == "ofi" && !SameHostOnly(caps.family)) {
    return ChooseRails(ReadInterfaces(), Ipv4Of(choice.source_address), count,
                       ibverbs::CurrentNumaNode(), gpu);
  }
  RailPlan plan;
  if (caps.backend != "ibverbs") return plan;
  // Every active port of every device, unless RDMA_DEVICE lists several (its order then).
  RdmaConfig rank = choice.rdma;
  rank.port = 0;
  if (!absl::StrContains(rank.device, ',')) rank.device.clear();
  absl::StatusOr<ibverbs::Inventory> inventory = ibverbs::ReadInventory();
  absl::StatusOr<std::vector<ibverbs::Selection>> ranked =
      inventory.ok() ? ibverbs::RankPorts(*inventory, rank, ibverbs::CurrentNumaNode(), gpu)
                     : absl::StatusOr<std::vector<ibverbs::Selection>>(inventory.status());
  if (!ranked.ok()) {
    plan.considered.push_back(std::string(ranked.status().message()));
    return plan;
  }
  // Which to take, by rank; numbered by name, as ChooseRails does, so that tasks on either
  // NUMA node pair their lanes alike.
  for (const ibverbs::Selection& s : *ranked) {
    const std::string port = absl::StrCat(s.device, ":", s.port);
    if (port != caps.provider && static_cast<int>(plan.rails.size()) < count) {
      plan.rails.push_back(port);
    }
  }
  std::sort(plan.rails.begin(), plan.rails.end());
  for (const ibverbs::Selection& s : *ranked) {
    const std::string port = absl::StrCat(s.device, ":", s.port);
    std::string verdict;
    if (port == caps.provider) {
      verdict = "the task's first lane";
    } else if (auto it = std::find(plan.rails.begin(), plan.rails.end(), port);
               it != plan.rails.end()) {
      verdict = absl::StrCat("rail ", it - plan.rails.begin() + 1);
    } else {
      verdict =
          absl::StrCat("passed over, ", count, count == 1 ? " rail" : " rails", " taken before it");
    }
    plan.considered.push_back(absl::StrCat(port, ": ", verdict, " (", s.reason, ")"));
  }
  return plan;
}

bool SameHostOnly(absl::string_view family) { return family == "shmem" || family == "ofi/shm"; }

absl::StatusOr<std::unique_ptr<Domain>> OpenFabric(const FabricChoice& choice) {
  DomainOptions options = OptionsOf(choice);
  const std::string& fabric = choice.fabric;
  if (fabric == "loopback" || fabric == "ibverbs" || fabric == "shmem") {
    absl::StatusOr<std::unique_ptr<Domain>> d = OpenDomain(fabric, options);
    if (!d.ok()) {
      return absl::Status(
          d.status().code(),
          absl::StrCat("TENSORVERBS_FABRIC=", fabric, " cannot be opened: ", d.status().message()));
    }
    return d;
  }
  if (fabric != "auto" && fabric != "ofi") {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown fabric '", fabric, "'; expected auto, shmem, ofi, ibverbs or loopback"));
  }
  std::string shmem_reason;
  if (UsesSharedMemory(choice)) {
    absl::StatusOr<std::unique_ptr<Domain>> d = OpenDomain("shmem", options);
    if (d.ok()) return d;
    shmem_reason = std::string(d.status().message());
    LOG(WARNING) << "every peer is on this host but the shmem fabric cannot open (" << shmem_reason
                 << "); trying the others";
  }
  std::string ibverbs_reason;
#if defined(TENSORVERBS_HAVE_IBVERBS)
  if (fabric == "auto") {
    absl::StatusOr<std::unique_ptr<Domain>> d = OpenDomain("ibverbs", options);
    if (d.ok()) return d;
    ibverbs_reason = std::string(d.status().message());
  }
#endif
  options.provider =
      ChooseOfiProvider(choice.ofi_provider, choice.all_peers_local, ListOfiProviders());
  absl::StatusOr<std::unique_ptr<Domain>> d = OpenDomain("ofi", options);
  if (!d.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "no usable fabric: ofi provider '", options.provider, "': ", d.status().message(),
        ibverbs_reason.empty() ? "" : absl::StrCat("; ibverbs: ", ibverbs_reason),
        shmem_reason.empty() ? "" : absl::StrCat("; shmem: ", shmem_reason),
        ". Set TENSORVERBS_FABRIC / TENSORVERBS_OFI_PROVIDER"));
  }
  return d;
}

FabricInventory ReadFabricInventory(const FabricChoice& choice) {
  FabricInventory inventory;
  for (const std::string& backend : BackendNames()) {
    DomainOptions options;
    options.rdma = choice.rdma;
    if (backend == "ofi") options.provider = choice.ofi_provider;
    FabricInventory::Backend entry;
    entry.name = backend;
    absl::StatusOr<std::unique_ptr<Domain>> d = OpenDomain(backend, options);
    if (d.ok()) {
      entry.capabilities = (*d)->capabilities();
    } else {
      entry.status = d.status();
    }
    inventory.backends.push_back(std::move(entry));
  }
  absl::StatusOr<ibverbs::Inventory> rdma = ibverbs::ReadInventory();
  if (!rdma.ok()) {
    inventory.rdma_status = rdma.status();
  } else {
    for (absl::string_view line :
         absl::StrSplit(ibverbs::DescribeInventory(*rdma), "; ", absl::SkipEmpty())) {
      inventory.rdma_devices.emplace_back(line);
    }
    absl::StatusOr<ibverbs::Selection> chosen =
        ibverbs::SelectDevice(*rdma, choice.rdma, ibverbs::CurrentNumaNode());
    if (chosen.ok()) {
      inventory.rdma_selection = absl::StrCat(
          chosen->device, " port ", chosen->port, ", GID ", chosen->gid_index, " (",
          ibverbs::GidToString(chosen->gid), "), MTU ", chosen->mtu, ": ", chosen->reason);
    } else {
      inventory.rdma_selection = chosen.status();
    }
  }
  inventory.ofi_providers = ListOfiProviders();
  inventory.ofi_device_memory_providers = ofi::ListProviders(/*device_memory=*/true);
  inventory.ofi_local_choice =
      ChooseOfiProvider(choice.ofi_provider, true, inventory.ofi_providers);
  inventory.ofi_remote_choice =
      ChooseOfiProvider(choice.ofi_provider, false, inventory.ofi_providers);
  return inventory;
}

}  // namespace tensorverbs::fabric
