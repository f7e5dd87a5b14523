#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"
#include "src/fabric/ofi/local_peers.h"
#include "src/fabric/ofi/ofi_internal.h"

namespace tensorverbs::fabric::ofi {
namespace {

// The longest address a string-format provider is believed to have (shm's are ~20 bytes).
constexpr size_t kMaxStringAddress = 256;

// Writes with an immediate above this size go as two posts where the provider needs it (see
// SplitsWrites): the data, then an empty write carrying the immediate.
constexpr size_t kSplitWritesAbove = 4096;

// libfabric 1.17's rxm over tcp crashes when an endpoint closes, or its connection drops,
// while a write with an immediate is half received: tcp reports the half-placed write to rxm as
// a cancelled operation with no context, and rxm dereferences the context. A write without an
// immediate is internal to tcp and dropped silently, and tcp places writes in the order they
// were posted, so sending the data plainly and the immediate in an empty write after it keeps
// the receiver's state between the two harmless and costs one small post per large write.
bool SplitsWrites(const fi_info* info) {
  const absl::string_view name = info->fabric_attr->prov_name;
  return absl::StartsWith(name, "tcp") && absl::StrContains(name, "ofi_rxm") &&
         (info->tx_attr->msg_order & FI_ORDER_WAW) != 0;
}

std::atomic<int64_t> g_peer_addresses{0};

}  // namespace

int64_t PeerAddresses() { return g_peer_addresses.load(std::memory_order_relaxed); }

static_assert(sizeof(fi_context2) <= sizeof(Op::provider), "fi_context2 must fit in Op");

OfiEndpoint::OfiEndpoint(std::shared_ptr<Shared> shared, std::shared_ptr<Port> port)
    : shared_(std::move(shared)),
      port_(std::move(port)),
      split_writes_(SplitsWrites(shared_->info)),
      ops_(this, shared_->options.queue_depth, shared_->options.op_timeout,
           absl::StrCat("ofi (", shared_->provider(), ")")) {}

absl::Status OfiEndpoint::Init() {
  ASSIGN_OR_RETURN(id_, port_->Attach(this));
  char id[4];
  std::memcpy(id, &id_, sizeof(id));
  address_ = absl::StrCat(port_->name(), absl::string_view(id, sizeof(id)));
  return absl::OkStatus();
}

OfiEndpoint::~OfiEndpoint() {
  if (active) {
    auto& eps = shared_->active;
    eps.erase(std::remove(eps.begin(), eps.end(), this), eps.end());
  }
  // What the provider still holds of ours is the port's to free; completions for this endpoint,
  // or immediates for its id, reach no one from here on.
  if (id_ != 0) port_->Detach(id_, ops_);
  if (connected_) ReleasePeer();
}

void OfiEndpoint::ReleasePeer() {
  auto entry = shared_->peers.find(peer_name_);
  if (entry == shared_->peers.end() || --entry->second.endpoints > 0) return;
  // Over rxm, removing the entry closes its connection, and what is queued on it goes too.
  // Kept, a connection a partition stalled (its TCP retransmissions backed off to tens of
  // seconds, or still carrying the rest of a closed channel's 64 MiB write) would carry the
  // next channel's first messages behind it; a new one starts clean. Both ends let go when
  // their last channel to the other closes, so the next channel's connection request finds no
  // stale connection on the other side to be refused for.
  fi_addr_t addr = entry->second.addr;
  const int ret = fi_av_remove(shared_->av, &addr, 1, 0);
  if (ret != 0) {
    LOG(WARNING) << FiError("ofi: fi_av_remove of a peer no endpoint uses any more", ret);
  }
  shared_->peers.erase(entry);
  g_peer_addresses.fetch_sub(1, std::memory_order_relaxed);
}

absl::Status OfiEndpoint::Connect(absl::string_view peer_address) {
  if (connected_) return absl::FailedPreconditionError("ofi: endpoint is already connected");
  // The peer's address is its port's provider address followed by its 4-byte id there.
  // fi_av_insert reads as many bytes as the provider's address format has, whatever it is
  // given: an address it cannot be is refused here rather than read past its end or inserted
  // as garbage. Binary formats have one length per provider; string formats (shm's
  // "fi_shm://PID:N", with its terminating NUL) vary in length but are short, end at their
  // first NUL and start with the provider's scheme, as ours does.
  const std::string& own = port_->name();
  const bool string_format = shared_->info->addr_format == FI_ADDR_STR;
  uint32_t peer_id = 0;
  absl::string_view name;
  if (peer_address.size() > sizeof(peer_id)) {
    name = peer_address.substr(0, peer_address.size() - sizeof(peer_id));
    std::memcpy(&peer_id, peer_address.data() + name.size(), sizeof(peer_id));
  }
  const size_t nul = name.find('\0');
  const size_t scheme_end = own.find("://");
  const bool plausible =
      peer_id != 0 &&
      (string_format ? name.size() <= kMaxStringAddress &&
                           (nul == absl::string_view::npos || nul == name.size() - 1) &&
                           scheme_end != std::string::npos &&
                           absl::StartsWith(name, absl::string_view(own).substr(0, scheme_end + 3))
                     : name.size() == own.size());
  if (!plausible) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ofi: a peer address of ", peer_address.size(), " bytes cannot be a ", shared_->provider(),
        " endpoint's (",
        string_format ? absl::StrCat("a string of at most ", kMaxStringAddress, " bytes")
                      : absl::StrCat(own.size(), " bytes"),
        " and a nonzero 4-byte id): a peer on another provider, or not a tensorverbs peer"));
  }
  std::string key(name);
  auto known = shared_->peers.find(key);
  if (known != shared_->peers.end()) {
    peer_ = known->second.addr;
    ++known->second.endpoints;
  } else {
    // One entry per peer provider endpoint, however many channels reach it: over rxm an entry
    // is a connection.
    std::string addr = key;
    int n = fi_av_insert(shared_->av, addr.data(), 1, &peer_, 0, nullptr);
    if (n != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ofi: the peer address (", addr.size(), " bytes) was rejected by ", shared_->provider()));
    }
    shared_->peers.emplace(key, Shared::PeerEntry{peer_, 1});
    g_peer_addresses.fetch_add(1, std::memory_order_relaxed);
  }
  peer_name_ = std::move(key);
  peer_id_ = peer_id;
  peer_gate_ = LocalPeers::Get().Find(name);  // null unless the peer is in this process
  connected_ = true;
  return absl::OkStatus();
}

size_t OfiEndpoint::Drain(absl::Span<Completion> out) {
  return ops_.Drain([this](Op* op) { return Issue(op); }, out);
}

absl::Status OfiEndpoint::Post(CompletionKind kind, bool with_imm, uint32_t imm,
                               const LocalBuffer& local, const RemoteBuffer& remote,
                               uint64_t context) {
  if (!connected_) return absl::FailedPreconditionError("ofi: endpoint is not connected");
  ASSIGN_OR_RETURN(PackedKey key, PackedKey::Unpack(remote.key));
  RETURN_IF_ERROR(CheckRanges("ofi", local, remote, key.base, key.length));
  if (local.length > shared_->info->ep_attr->max_msg_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("ofi: ", local.length, " bytes exceed the provider's message size"));
  }
  Op* op = ops_.NewOp(kind, with_imm, imm, local, remote, context);
  // Descriptors are required under FI_MR_LOCAL and harmless otherwise.
  op->desc = local.length > 0 ? static_cast<const OfiRegion*>(local.region)->desc() : nullptr;
  if (!key.virtual_addressing) op->remote_addr = remote.addr - key.base;
  op->remote_key = key.key;
  RETURN_IF_ERROR(ops_.Submit(op, [this](Op* o) { return Issue(o); }));
  if (!active && ops_.live() > 0) {
    shared_->active.push_back(this);
    active = true;
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> OfiEndpoint::Issue(Op* op) {
  if (peer_gate_ == nullptr) return IssueToProvider(op);
  std::shared_lock<std::shared_mutex> open(peer_gate_->mu);
  if (!peer_gate_->open) {
    return absl::UnavailableError(absl::StrCat(
        "ofi (", shared_->provider(),
        "): the peer endpoint, in this process, has closed; the write is refused before it "
        "reaches the provider (a peer that closed its end, or a task stopping)"));
  }
  return IssueToProvider(op);
}

absl::StatusOr<bool> OfiEndpoint::IssueToProvider(Op* op) {
  fid_ep* ep = port_->ep();
  void* ctx = op->provider;
  // The peer's port hands the immediate to the endpoint its id names (ofi_internal.h).
  const uint64_t data =
      shared_->routed_data ? (uint64_t{peer_id_} << 32) | op->imm : uint64_t{op->imm};
  ssize_t ret;
  if (op->kind == CompletionKind::kRead) {
    ret = fi_read(ep, op->buf, op->len, op->desc, peer_, op->remote_addr, op->remote_key, ctx);
  } else if (op->with_imm && split_writes_ && op->len > kSplitWritesAbove) {
    if (!op->data_posted) {
      AuxContext* part = port_->NewDataPart();
      ret = fi_write(ep, op->buf, op->len, op->desc, peer_, op->remote_addr, op->remote_key, part);
      if (ret != 0) port_->FreeDataPart(part);
      if (ret == -FI_EAGAIN) return false;
      if (ret != 0) {
        return absl::UnavailableError(FiError("ofi: posting the operation", static_cast<int>(ret)));
      }
      op->aux = part;
      op->data_posted = true;  // a retry after EAGAIN posts the immediate alone
    }
    ret = fi_writedata(ep, nullptr, 0, nullptr, data, peer_, op->remote_addr, op->remote_key, ctx);
    if (ret != 0 && ret != -FI_EAGAIN) {
      // The data part is the provider's and comes back; this part never will.
      auto* part = static_cast<AuxContext*>(std::exchange(op->aux, nullptr));
      part->op_returned = true;
      if (part->data_returned) port_->FreeDataPart(part);
    }
  } else if (op->with_imm) {
    ret = fi_writedata(ep, op->buf, op->len, op->desc, data, peer_, op->remote_addr, op->remote_key,
                       ctx);
  } else {
    ret = fi_write(ep, op->buf, op->len, op->desc, peer_, op->remote_addr, op->remote_key, ctx);
  }
  if (ret == 0) return true;
  if (ret == -FI_EAGAIN) return false;
  return absl::UnavailableError(FiError("ofi: posting the operation", static_cast<int>(ret)));
}

}  // namespace tensorverbs::fabric::ofi
