// The ofi backend's parts shared by its domain (ofi.cc) and its endpoint (ofi_endpoint.cc): the
// libfabric objects every registration and endpoint holds (Shared), the registrations (OfiRegion,
// with the remote key they pack) and the endpoint, an FI_EP_RDM endpoint with its own completion
// queue, so that an incoming immediate is attributed to its endpoint without FI_SOURCE.
//
// Private to src/fabric/ofi. Threading as every Domain (see fabric.h): everything here runs on
// the thread that owns the domain (the progress thread). A registration or endpoint holds
// Shared, so the provider's fabric, domain and address vector outlive them whatever order they
// are destroyed in; the domain polls the endpoints Shared lists, and an endpoint leaves that list
// as it is destroyed.
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

// The libfabric objects a domain, its regions and its endpoints share; closed when the last
// of them goes.
struct Shared {
  fi_info* info = nullptr;
  fid_fabric* fabric = nullptr;
  fid_domain* domain = nullptr;
  fid_av* av = nullptr;
  DomainOptions options;
  std::atomic<uint64_t> next_key{1};
  std::vector<OfiEndpoint*> endpoints;  // polled by the domain
  WakeFd wake;                          // Domain::Interrupt

  bool virtual_addressing() const {
    // FI_MR_BASIC implies virtual addresses; FI_MR_SCALABLE offsets.
    const int mode = info->domain_attr->mr_mode;
    return (mode & (FI_MR_VIRT_ADDR | FI_MR_BASIC)) != 0;
  }

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

class OfiEndpoint final : public EndpointBase {
 public:
  explicit OfiEndpoint(std::shared_ptr<Shared> shared);
  ~OfiEndpoint() override;

  // Opens the endpoint and its completion queue, binds them to the address vector, and keeps
  // receives posted where the provider consumes one per immediate (FI_RX_CQ_DATA).
  absl::Status Init();

  std::string LocalAddress() const override { return address_; }
  absl::Status Connect(absl::string_view peer_address) override;
  size_t Outstanding() const override { return ops_.live(); }

  fid* cq_fid() { return &cq_->fid; }
  int wait_fd() const { return wait_fd_; }

  // Reads this endpoint's completions into `out`; returns how many.
  size_t Progress(absl::Span<Completion> out);

 private:
  absl::Status PostReceive();
  void* receive_ctx() { return &receive_ctx_; }
  void* data_ctx() { return &data_ctx_; }

  absl::Status Post(CompletionKind kind, bool with_imm, uint32_t imm, const LocalBuffer& local,
                    const RemoteBuffer& remote, uint64_t context) override;

  // Hands `op` to libfabric: true if posted, false if the provider is full, or the error. A
  // peer of this process is posted to only while it is open, under its gate's shared lock.
  absl::StatusOr<bool> Issue(Op* op);
  absl::StatusOr<bool> IssueToProvider(Op* op);
  // Reads one error completion: the failed operation's completion into `out` (returns 1), or
  // nothing (returns 0) for a split write's data part, a receive, or an operation deferred
  // because `out` has no room.
  size_t ReadError(absl::Span<Completion> out);

  std::shared_ptr<Shared> shared_;
  fid_ep* ep_ = nullptr;
  fid_cq* cq_ = nullptr;
  fi_addr_t peer_ = FI_ADDR_UNSPEC;
  bool connected_ = false;
  std::shared_ptr<LocalPeers::Gate> gate_;       // this endpoint's, for peers in this process
  std::shared_ptr<LocalPeers::Gate> peer_gate_;  // the peer's, if it is in this process
  std::string address_;
  fi_context2 receive_ctx_{};
  fi_context2 data_ctx_{};
  const bool split_writes_;
  absl::Status split_error_;  // the first failed data part of a split write
  int wait_fd_ = -1;
  OpTracker ops_;
};

}  // namespace tensorverbs::fabric::ofi

#endif  // TENSORVERBS_FABRIC_OFI_OFI_INTERNAL_H_
