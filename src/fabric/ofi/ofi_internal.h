// The ofi backend's parts shared by its domain (ofi.cc), its provider endpoints (ofi_port.cc)
// and its endpoints (ofi_endpoint.cc): the libfabric objects every registration and endpoint
// holds (Shared), the registrations (OfiRegion, with the remote key they pack), the Port (one
// FI_EP_RDM endpoint, its completion queue and the routing of its completions) and the
// Endpoint a channel holds (a peer address plus its own operations, on a port).
//
// One port serves every endpoint of a domain where the provider carries 8 bytes of CQ data
// (shm and tcp;ofi_rxm do): a write with an immediate carries the target endpoint's id (slot
// and generation) in the upper half of its data, and the target port hands the completion to
// the endpoint that id names, or drops it when that endpoint is gone, even if its slot serves
// a newer one. Where the provider carries 4 bytes (or DomainOptions::ofi_shared_endpoint is
// off) each endpoint gets a port of its own, which hands it every completion.
//
// Private to src/fabric/ofi. Threading as every Domain (see fabric.h): everything here runs on
// the thread that owns the domain (the progress thread). A registration, port or endpoint holds
// Shared, so the provider's fabric, domain and address vector outlive them whatever order they
// are destroyed in; an endpoint holds its port, which outlives the endpoint's operations still
// in the provider (it adopts their records and frees them as they return or as it closes).
#ifndef TENSORVERBS_FABRIC_OFI_OFI_INTERNAL_H_
#define TENSORVERBS_FABRIC_OFI_OFI_INTERNAL_H_

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "src/fabric/endpoint_base.h"
#include "src/fabric/fabric.h"
#include "src/fabric/ofi/local_peers.h"
#include "src/fabric/op_tracker.h"
#include "src/fabric/wake_fd.h"

namespace tensorverbs::fabric::ofi {

// "<what>: <fi_strerror(-ret)> (<ret>)".
std::string FiError(absl::string_view what, int ret);

// Packed remote key: key, region base, region length, 1 if the provider uses virtual addresses.
struct PackedKey {
  uint64_t key = 0;
  uint64_t base = 0;
  uint64_t length = 0;
  uint8_t virtual_addressing = 1;
  static constexpr size_t kSize = 25;

  RemoteKey Pack() const {
    char out[kSize];
    std::memcpy(&out[0], &key, 8);
    std::memcpy(&out[8], &base, 8);
    std::memcpy(&out[16], &length, 8);
    out[24] = static_cast<char>(virtual_addressing);
    return RemoteKey(absl::string_view(out, kSize));
  }
  static absl::StatusOr<PackedKey> Unpack(absl::string_view bytes) {
    if (bytes.size() != kSize) {
      return absl::InvalidArgumentError(absl::StrCat("ofi: malformed remote key (", bytes.size(),
                                                     " bytes, expected ", kSize, ")"));
    }
    PackedKey k;
    std::memcpy(&k.key, bytes.data(), 8);
    std::memcpy(&k.base, bytes.data() + 8, 8);
    std::memcpy(&k.length, bytes.data() + 16, 8);
    k.virtual_addressing = static_cast<uint8_t>(bytes[24]);
    return k;
  }
};

class OfiEndpoint;
class Port;

// The libfabric objects a domain, its regions and its endpoints share; closed when the last
// of them goes.
struct Shared {
  fi_info* info = nullptr;
  fid_fabric* fabric = nullptr;
  fid_domain* domain = nullptr;
  fid_av* av = nullptr;
  DomainOptions options;
  std::atomic<uint64_t> next_key{1};
  // The provider carries 8 bytes of CQ data: writes carry their target endpoint's id, so a
  // port can serve many endpoints (and peers that share ports can reach ours).
  bool routed_data = false;
  std::vector<Port*> ports;          // polled by the domain
  std::vector<OfiEndpoint*> active;  // endpoints with operations to drain or time out
  // Address vector entries, by peer provider endpoint name, with the endpoints connected to
  // each. Over rxm an entry is a connection: it goes with the last endpoint that uses it (see
  // OfiEndpoint::ReleasePeer).
  struct PeerEntry {
    fi_addr_t addr = FI_ADDR_UNSPEC;
    int endpoints = 0;
  };
  absl::flat_hash_map<std::string, PeerEntry> peers;
  WakeFd wake;  // Domain::Interrupt

  bool virtual_addressing() const {
    // FI_MR_BASIC implies virtual addresses; FI_MR_SCALABLE offsets.
    const int mode = info->domain_attr->mr_mode;
    return (mode & (FI_MR_VIRT_ADDR | FI_MR_BASIC)) != 0;
  }
  const char* provider() const { return info->fabric_attr->prov_name; }

  ~Shared() {
    if (av) fi_close(&av->fid);
    if (domain) fi_close(&domain->fid);
    if (fabric) fi_close(&fabric->fid);
    if (info) fi_freeinfo(info);
  }
};

class OfiRegion final : public MemoryRegion {
 public:
  OfiRegion(std::shared_ptr<Shared> shared, fid_mr* mr, void* base, size_t length)
      : MemoryRegion(base, length), shared_(std::move(shared)), mr_(mr) {}
  ~OfiRegion() override { fi_close(&mr_->fid); }
  RemoteKey PackRemoteKey() const override {
    PackedKey k;
    k.key = fi_mr_key(mr_);
    k.base = reinterpret_cast<uint64_t>(base());
    k.length = length();
    k.virtual_addressing = shared_->virtual_addressing() ? 1 : 0;
    return k.Pack();
  }
  void* desc() const { return fi_mr_desc(mr_); }

 private:
  std::shared_ptr<Shared> shared_;
  fid_mr* mr_;
};

// The context of a completion that is not an operation's: a receive kept posted, or the data
// part of a write sent in two parts. Laid out as Op is up to `tag`, so a context the provider
// hands back says which it is.
struct AuxContext {
  alignas(16) unsigned char provider[64];
  uint32_t context_tag = 0;
  // A data part: whether it and its operation have come back, and its failure.
  bool data_returned = false;
  bool op_returned = false;
  absl::Status error;
};

// One provider endpoint with its completion queue. Ids name the endpoints it serves: a slot
// (low 20 bits) and that slot's generation (high 12 bits, never 0), so a stale id names no one.
class Port {
 public:
  static constexpr uint32_t kSlotBits = 20;
  static constexpr uint32_t kMaxSlots = 1u << kSlotBits;

  Port(std::shared_ptr<Shared> shared, bool serves_many);
  ~Port();
  Port(const Port&) = delete;
  Port& operator=(const Port&) = delete;

  // Opens the endpoint and its completion queue, binds them to the address vector, and keeps
  // receives posted where the provider consumes one per immediate (FI_RX_CQ_DATA).
  absl::Status Init();

  // The provider's name for this endpoint (fi_getname).
  const std::string& name() const { return name_; }
  fid_ep* ep() const { return ep_; }
  fid* cq_fid() { return &cq_->fid; }
  int wait_fd() const { return wait_fd_; }

  // Gives `ep` an id on this port; ResourceExhausted past kMaxSlots endpoints.
  absl::StatusOr<uint32_t> Attach(OfiEndpoint* ep);
  // `id` names no one from now on. The operations of `ops` (its endpoint's) that the provider
  // still holds are freed as they come back, or as the port closes, and reported to no one.
  void Detach(uint32_t id, OpTracker& ops);

  // Reads completions into `out`, each given to the endpoint it belongs to; returns how many.
  size_t Progress(absl::Span<Completion> out);

  // The second context of a write sent in two parts (data, then the immediate alone), and its
  // return when the provider did not take it, or when it took the data but not the operation.
  AuxContext* NewDataPart();
  void FreeDataPart(AuxContext* part);

 private:
  struct Slot {
    OfiEndpoint* ep = nullptr;
    uint32_t generation = 0;
  };

  absl::Status PostReceive(AuxContext* context);
  // The endpoint a completion's CQ data names, or null (gone, or never here).
  OfiEndpoint* Route(uint64_t data) const;
  // Hands back one context: an operation's completion into `c` (true), or nothing.
  bool Returned(void* context, absl::Status status, Completion* c);
  // Reads one error completion into `out` (returns 1), or nothing (returns 0).
  size_t ReadError(absl::Span<Completion> out);

  std::shared_ptr<Shared> shared_;
  const bool serves_many_;
  fid_ep* ep_ = nullptr;
  fid_cq* cq_ = nullptr;
  int wait_fd_ = -1;
  std::string name_;
  std::shared_ptr<LocalPeers::Gate> gate_;             // this port's, for peers in this process
  std::vector<std::unique_ptr<AuxContext>> receives_;  // one context per receive kept posted
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_slots_;
  absl::flat_hash_set<Op*> orphans_;  // gone endpoints' operations the provider still holds
  std::vector<std::unique_ptr<AuxContext>> data_parts_free_;
  absl::flat_hash_set<AuxContext*> data_parts_live_;
  bool counted_ = false;  // in OpenPorts()
};

class OfiEndpoint final : public EndpointBase {
 public:
  // `port` serves this endpoint alone unless it was made to serve many.
  OfiEndpoint(std::shared_ptr<Shared> shared, std::shared_ptr<Port> port);
  ~OfiEndpoint() override;

  // Takes an id on the port and registers the endpoint with the local-peers gate.
  absl::Status Init();

  // The port's name and this endpoint's id on it: what the peer passes to Connect.
  std::string LocalAddress() const override { return address_; }
  absl::Status Connect(absl::string_view peer_address) override;
  size_t Outstanding() const override { return ops_.live(); }

  // Issues queued operations and reports failures and timeouts; returns how many went to `out`.
  size_t Drain(absl::Span<Completion> out);
  // Drain has nothing left to do.
  bool idle() const { return ops_.live() == 0; }
  bool active = false;  // listed in Shared::active

 private:
  absl::Status Post(CompletionKind kind, bool with_imm, uint32_t imm, const LocalBuffer& local,
                    const RemoteBuffer& remote, uint64_t context) override;

  // Hands `op` to libfabric: true if posted, false if the provider is full, or the error. A
  // peer of this process is posted to only while it is open, under its gate's shared lock.
  absl::StatusOr<bool> Issue(Op* op);
  absl::StatusOr<bool> IssueToProvider(Op* op);
  // Lets go of the peer's address vector entry; the last endpoint to do so removes it.
  void ReleasePeer();

  std::shared_ptr<Shared> shared_;
  std::shared_ptr<Port> port_;
  uint32_t id_ = 0;
  uint32_t peer_id_ = 0;  // the peer endpoint's id on its port, carried in CQ data
  fi_addr_t peer_ = FI_ADDR_UNSPEC;
  std::string peer_name_;  // its key in Shared::peers, once connected
  bool connected_ = false;
  std::shared_ptr<LocalPeers::Gate> peer_gate_;  // the peer's port's, if it is in this process
  std::string address_;
  const bool split_writes_;
  OpTracker ops_;
};

}  // namespace tensorverbs::fabric::ofi

#endif  // TENSORVERBS_FABRIC_OFI_OFI_INTERNAL_H_
