// `tensorverbs info`: what this host offers each fabric backend, and the configuration in effect.
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/common/config.h"
#include "src/common/settings.h"
#include "src/device/cuda_runtime.h"
#include "src/fabric/fabric.h"
#include "src/fabric/ibverbs/device_selection.h"
#include "src/fabric/pci_topology.h"
#include "src/fabric/rails.h"
#include "src/server/server.h"
#include "tensorverbs/version.h"
#include "tools/commands.h"

namespace tensorverbs::tools {
namespace {

std::string CudaVersion(int v) { return absl::StrCat(v / 1000, ".", v % 1000 / 10); }

// GPUs: what the CUDA runtime found at run time, and what it means for device tensors.
void PrintGpus(const fabric::FabricInventory& inventory) {
  const std::string toolkit = device::BuildToolkit();
  std::printf("\nGPUs (CUDA runtime loaded at run time; build toolkit %s):\n",
              toolkit.empty() ? "none" : toolkit.c_str());
  absl::StatusOr<device::CudaRuntime*> cuda = device::CudaRuntime::Get();
  if (!cuda.ok()) {
    std::printf("  none usable: %s\n", std::string(cuda.status().message()).c_str());
    return;
  }
  const device::CudaRuntime& rt = **cuda;
  std::printf("  runtime %s (%s), driver supports CUDA %s\n",
              CudaVersion(rt.runtime_version()).c_str(), rt.library().c_str(),
              CudaVersion(rt.driver_version()).c_str());
  for (int d = 0; d < rt.device_count(); ++d) {
    absl::StatusOr<device::CudaDeviceInfo> info = rt.DeviceInfo(d);
    if (!info.ok()) {
      std::printf("  cuda:%d  %s\n", d, std::string(info.status().message()).c_str());
      continue;
    }
    std::printf("  cuda:%d  %s, compute %d.%d, %.1f GiB, PCI %s\n", d, info->name.c_str(),
                info->compute_major, info->compute_minor,
                static_cast<double>(info->total_memory) / (1 << 30), info->pci_bus_id.c_str());
  }
  std::printf(
      "  device tensors take the proxy path where no direct path is: device-to-host into the "
      "pinned pool on the sender, host-to-device from a pinned proxy on the receiver, on CUDA "
      "streams (TENSORVERBS_PIN_POOL pins the pool)\n");
  std::printf("  direct writes into GPU memory, per fabric:\n");
  if (Config::Get().gpu_direct) {
    std::printf(
        "    shmem    yes: grpc+verbs writes tensors of the tasks' GPU pools from and into GPU "
        "memory by CUDA IPC and device copies, with no copy through host memory "
        "(TENSORVERBS_GPU_DIRECT=off turns it off)\n");
  } else {
    std::printf("    shmem    no: TENSORVERBS_GPU_DIRECT=off\n");
  }
  std::printf(
      "    ofi      no: this version registers host memory only; providers here that "
      "report FI_HMEM: %s\n",
      inventory.ofi_device_memory_providers.empty()
          ? "none"
          : absl::StrJoin(inventory.ofi_device_memory_providers, ", ").c_str());
  std::printf(
      "    ibverbs  no: this version registers host memory only (no dma-buf "
      "registration of GPU memory yet)\n");
}

// Rails: how a count in TENSORVERBS_RAILS would rank this host's interfaces for a task at this
// host's name (the address a cluster spec usually gives), on the NUMA node info runs on.
void PrintRails(const Config& config) {
  std::printf("\nrails (TENSORVERBS_RAILS: further lanes, each on a network or NIC of its own):\n");
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  const std::string primary = fabric::Ipv4Of(name);
  const int node = fabric::ibverbs::CurrentNumaNode();
  absl::StatusOr<fabric::RailsSpec> spec = fabric::ParseRails(config.rails, fabric::kMaxRails);
  const int count = spec.ok() && spec->count > 0 ? spec->count : fabric::kMaxRails;
  // A task whose tensors live on a GPU (grpc+gdr) ranks the NICs nearest its first GPU first.
  std::string gpu_bus;
  if (absl::StatusOr<device::CudaRuntime*> cuda = device::CudaRuntime::Get(); cuda.ok()) {
    absl::StatusOr<device::CudaDeviceInfo> info = (*cuda)->DeviceInfo(0);
    if (info.ok()) gpu_bus = info->pci_bus_id;
  }
  const std::string gpu_path = fabric::PciPathOfBusId(gpu_bus);
  const fabric::RailPlan plan =
      fabric::ChooseRails(fabric::ReadInterfaces(), primary, count, node, gpu_path);
  if (!gpu_path.empty()) {
    std::printf("  for tensors on GPU 0 (PCI %s), the interfaces nearest it first\n",
                gpu_bus.c_str());
  }
  std::printf("  this host's interfaces, ranked for a task at %s (the host's name %s) on %s:\n",
              primary.empty() ? "an unknown address" : primary.c_str(), name,
              node >= 0 ? absl::StrCat("NUMA node ", node).c_str() : "an unknown NUMA node");
  for (const std::string& line : plan.considered) std::printf("    %s\n", line.c_str());
  if (absl::StartsWith(primary, "127.")) {
    std::printf(
        "  (the host's name is a loopback address here; a task ranks the interfaces "
        "against its own address in the cluster spec, whose network it leaves out)\n");
  }
  std::printf(
      "  over ibverbs a count takes the active ports after the one above (RDMA devices), "
      "in the same order\n");
  if (!spec.ok()) {
    std::printf("  %s\n", std::string(spec.status().message()).c_str());
  } else if (!spec->listed.empty()) {
    std::printf("  the task's lanes: its own address, then %s (listed)\n",
                absl::StrJoin(spec->listed, ", ").c_str());
  } else if (spec->count > 0 || !absl::StripAsciiWhitespace(config.rails).empty()) {
    std::printf("  TENSORVERBS_RAILS=%d takes %s\n", spec->count,
                spec->count == 0     ? "none: one lane, on the task's address"
                : plan.rails.empty() ? "none: no interface qualifies"
                                     : absl::StrJoin(plan.rails, ", ").c_str());
  } else {
    std::printf(
        "  TENSORVERBS_RAILS unset: one lane, on the task's address; a count takes the "
        "rails in this order\n");
  }
}

std::string Bytes(rlim_t v) {
  if (v == RLIM_INFINITY) return "unlimited";
  return absl::StrCat(v / 1024, " KiB");
}

}  // namespace

int RunSettingsMarkdown(const std::string& table) {
  if (table != "tensorverbs" && table != "rdma") {
    std::fprintf(stderr, "--settings-markdown: give tensorverbs or rdma, not '%s'\n",
                 table.c_str());
    return 2;
  }
  std::fputs(
      SettingsMarkdown(table == "rdma" ? SettingTable::kRdma : SettingTable::kTensorVerbs).c_str(),
      stdout);
  return 0;
}

int RunInfoCommand() {
  const Config& config = Config::Get();
  fabric::FabricChoice choice;
  choice.fabric = config.fabric;
  choice.ofi_provider = config.ofi_provider;
  choice.rdma = config.rdma;
  const fabric::FabricInventory inventory = fabric::ReadFabricInventory(choice);
  std::printf("tensorverbs %s info\n\nprotocols: %s\n\nfabric backends:\n", Version(),
              absl::StrJoin(AvailableProtocols(), ", ").c_str());
  for (const fabric::FabricInventory::Backend& b : inventory.backends) {
    if (b.status.ok()) {
      const fabric::Capabilities& c = b.capabilities;
      std::printf("  %-9s usable: default provider %s, %s addressing, queue depth %zu, %s\n",
                  b.name.c_str(), c.provider.c_str(), c.virtual_addressing ? "virtual" : "offset",
                  c.queue_depth,
                  c.endpoint_bound_keys ? "endpoint-bound keys per channel"
                  : c.channel_keys      ? "keys per channel (not bound to endpoints)"
                                        : "one key per region for every peer");
    } else {
      std::printf("  %-9s not usable: %s\n", b.name.c_str(),
                  std::string(b.status.message()).c_str());
    }
  }

  if (config.fabric == "auto") {
    std::printf(
        "  grpc+verbs picks (TENSORVERBS_FABRIC=auto) per peer: shmem for the tasks on this "
        "host (same boot and network namespace, checked at channel set-up), and for the others "
        "ibverbs where a port is usable, else libfabric (below)\n");
  } else {
    std::printf("  grpc+verbs uses %s (TENSORVERBS_FABRIC)\n", config.fabric.c_str());
  }

  std::printf("\nRDMA devices (ibverbs, configured by the RDMA_* variables):\n");
  if (!inventory.rdma_status.ok()) {
    std::printf("  none usable: %s\n", std::string(inventory.rdma_status.message()).c_str());
  } else {
    for (const std::string& line : inventory.rdma_devices) std::printf("  %s\n", line.c_str());
    if (inventory.rdma_selection.ok()) {
      std::printf("  would use %s\n", inventory.rdma_selection->c_str());
    } else {
      std::printf("  cannot choose: %s\n",
                  std::string(inventory.rdma_selection.status().message()).c_str());
    }
  }

  std::printf("\nlibfabric providers with RDM endpoints, RMA and remote CQ data:\n");
  if (inventory.ofi_providers.empty()) std::printf("  none\n");
  for (const std::string& p : inventory.ofi_providers) std::printf("  %s\n", p.c_str());
  std::printf("  would use: %s for peers on this host, %s for remote peers%s\n",
              inventory.ofi_local_choice.c_str(), inventory.ofi_remote_choice.c_str(),
              config.ofi_provider.empty() ? " (hardware first, then shm locally, then tcp;ofi_rxm)"
                                          : " (TENSORVERBS_OFI_PROVIDER)");

  PrintRails(config);
  PrintGpus(inventory);

  rlimit memlock{};
  getrlimit(RLIMIT_MEMLOCK, &memlock);
  std::printf("\nmemlock limit: soft %s, hard %s%s\n", Bytes(memlock.rlim_cur).c_str(),
              Bytes(memlock.rlim_max).c_str(),
              memlock.rlim_cur != RLIM_INFINITY && memlock.rlim_cur < (rlim_t{1} << 30)
                  ? " (RDMA NICs pin registered memory; raise it with ulimit -l for large pools)"
                  : "");

  // Every setting from the table, so a new one shows up here without an edit.
  std::printf("\nconfiguration (the defaults, and what the environment sets):\n");
  const std::map<std::string, std::string> set = EnvironmentVariables({"TENSORVERBS_", "RDMA_"});
  for (const Setting& s : Settings()) {
    const bool from_env =
        set.count(s.variable) != 0 || (s.alias != nullptr && set.count(s.alias) != 0);
    std::string value;
    if (s.get != nullptr) value = s.get(config);
    if (value.empty() || (!from_env && s.default_note != nullptr)) {
      value = s.default_note != nullptr ? absl::StrCat("(", s.default_note, ")") : "(unset)";
    }
    std::printf("  %s %s%s\n", s.variable, value.c_str(), from_env ? "  (set)" : "");
  }
  for (const std::string& w : config.warnings) std::printf("  warning: %s\n", w.c_str());
  return 0;
}

}  // namespace tensorverbs::tools
