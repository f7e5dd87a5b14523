#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sys/types.h>

#include <algorithm>
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

// Zero-length receives kept posted per endpoint when the provider consumes one per immediate.
constexpr int kPostedReceives = 64;

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

}  // namespace

static_assert(sizeof(fi_context2) <= sizeof(Op::provider), "fi_context2 must fit in Op");

OfiEndpoint::OfiEndpoint(std::shared_ptr<Shared> shared)
    : shared_(std::move(shared)),
      split_writes_(SplitsWrites(shared_->info)),
      ops_(this, shared_->options.queue_depth, shared_->options.op_timeout,
           absl::StrCat("ofi (", shared_->info->fabric_attr->prov_name, ")")) {}

absl::Status OfiEndpoint::Init() {
  int ret = fi_endpoint(shared_->domain, shared_->info, &ep_, nullptr);
  if (ret) return absl::UnavailableError(FiError("ofi: fi_endpoint", ret));
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.size = std::max<size_t>(shared_->options.queue_depth * 2 + kPostedReceives, 256);
  // A file descriptor to block on lets Domain::Wait sleep instead of spin; providers without
  // one get a CQ without a wait object and Wait polls in short sleeps for them.
  cq_attr.wait_obj = FI_WAIT_FD;
  ret = fi_cq_open(shared_->domain, &cq_attr, &cq_, nullptr);
  if (ret == 0) {
    if (fi_control(&cq_->fid, FI_GETWAIT, &wait_fd_) != 0) wait_fd_ = -1;
  } else {
    cq_attr.wait_obj = FI_WAIT_NONE;
    ret = fi_cq_open(shared_->domain, &cq_attr, &cq_, nullptr);
  }
  if (ret) return absl::UnavailableError(FiError("ofi: fi_cq_open", ret));
  ret = fi_ep_bind(ep_, &shared_->av->fid, 0);
  if (ret) return absl::UnavailableError(FiError("ofi: fi_ep_bind(av)", ret));
  ret = fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV);
  if (ret) return absl::UnavailableError(FiError("ofi: fi_ep_bind(cq)", ret));
  ret = fi_enable(ep_);
  if (ret) return absl::UnavailableError(FiError("ofi: fi_enable", ret));
  char name[256];
  size_t len = sizeof(name);
  ret = fi_getname(&ep_->fid, name, &len);
  if (ret) return absl::UnavailableError(FiError("ofi: fi_getname", ret));
  address_.assign(name, len);
  if (shared_->info->mode & FI_RX_CQ_DATA) {
    for (int i = 0; i < kPostedReceives; ++i) RETURN_IF_ERROR(PostReceive());
  }
  shared_->endpoints.push_back(this);
  gate_ = LocalPeers::Get().Open(address_);
  return absl::OkStatus();
}

OfiEndpoint::~OfiEndpoint() {
  auto& eps = shared_->endpoints;
  eps.erase(std::remove(eps.begin(), eps.end(), this), eps.end());
  // Before the provider closes it: a peer of this process posting to it waits, then is
  // refused.
  LocalPeers::Get().Close(address_, gate_);
  if (ep_) fi_close(&ep_->fid);
  if (cq_) fi_close(&cq_->fid);
}

absl::Status OfiEndpoint::Connect(absl::string_view peer_address) {
  if (connected_) return absl::FailedPreconditionError("ofi: endpoint is already connected");
  // fi_av_insert reads as many bytes as the provider's address format has, whatever it is
  // given: an address it cannot be is refused here rather than read past its end or inserted
  // as garbage. Binary formats have one length per provider; string formats (shm's
  // "fi_shm://PID:N", with its terminating NUL) vary in length but are short, end at their
  // first NUL and start with the provider's scheme, as ours does.
  const bool string_format = shared_->info->addr_format == FI_ADDR_STR;
  const size_t nul = peer_address.find('\0');
  const size_t scheme_end = address_.find("://");
  const bool plausible =
      string_format ? peer_address.size() <= kMaxStringAddress &&
                          (nul == absl::string_view::npos || nul == peer_address.size() - 1) &&
                          scheme_end != std::string::npos &&
                          absl::StartsWith(peer_address,
                                           absl::string_view(address_).substr(0, scheme_end + 3))
                    : peer_address.size() == address_.size();
  if (!plausible) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ofi: a peer address of ", peer_address.size(), " bytes cannot be a ",
        shared_->info->fabric_attr->prov_name, " address (",
        string_format ? absl::StrCat("a string of at most ", kMaxStringAddress, " bytes")
                      : absl::StrCat(address_.size(), " bytes"),
        "): a peer on another provider, or not a tensorverbs peer"));
  }
  std::string addr(peer_address);
  int n = fi_av_insert(shared_->av, addr.data(), 1, &peer_, 0, nullptr);
  if (n != 1) {
    return absl::InvalidArgumentError(absl::StrCat("ofi: the peer address (", addr.size(),
                                                   " bytes) was rejected by ",
                                                   shared_->info->fabric_attr->prov_name));
  }
  peer_gate_ = LocalPeers::Get().Find(addr);  // null unless the peer is in this process
  connected_ = true;
  return absl::OkStatus();
}

size_t OfiEndpoint::Progress(absl::Span<Completion> out) {
  size_t produced = 0;
  fi_cq_data_entry entries[32];
  while (produced < out.size()) {
    const size_t want = std::min<size_t>(32, out.size() - produced);
    ssize_t n = fi_cq_read(cq_, entries, want);
    if (n == -FI_EAGAIN) break;
    if (n == -FI_EAVAIL) {
      produced += ReadError(out.subspan(produced));
      continue;
    }
    if (n < 0) {
      LOG(WARNING) << FiError("ofi: fi_cq_read", static_cast<int>(n));
      break;
    }
    for (ssize_t i = 0; i < n; ++i) {
      const fi_cq_data_entry& e = entries[i];
      if (e.flags & FI_REMOTE_CQ_DATA) {
        Completion& c = out[produced++];
        c = Completion();
        c.kind = CompletionKind::kRemoteWriteImm;
        c.endpoint = this;
        c.imm = static_cast<uint32_t>(e.data);
        c.byte_len = e.len;
        if ((e.flags & FI_RECV) && (shared_->info->mode & FI_RX_CQ_DATA)) (void)PostReceive();
        continue;
      }
      if (e.op_context == receive_ctx()) continue;  // a consumed receive without data
      if (e.op_context == data_ctx()) continue;     // the data part of a split write
      Op* op = static_cast<Op*>(e.op_context);
      // tcp completes in posting order, so a failed data part has been seen by now.
      const absl::Status status = op->data_posted ? split_error_ : absl::OkStatus();
      if (ops_.Complete(op, status, &out[produced])) ++produced;
    }
  }
  produced += ops_.Drain([this](Op* op) { return Issue(op); }, out.subspan(produced));
  return produced;
}

absl::Status OfiEndpoint::PostReceive() {
  int ret = fi_recv(ep_, nullptr, 0, nullptr, FI_ADDR_UNSPEC, receive_ctx());
  if (ret) return absl::UnavailableError(FiError("ofi: fi_recv", ret));
  return absl::OkStatus();
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
  return ops_.Submit(op, [this](Op* o) { return Issue(o); });
}

absl::StatusOr<bool> OfiEndpoint::Issue(Op* op) {
  if (peer_gate_ == nullptr) return IssueToProvider(op);
  std::shared_lock<std::shared_mutex> open(peer_gate_->mu);
  if (!peer_gate_->open) {
    return absl::UnavailableError(absl::StrCat(
        "ofi (", shared_->info->fabric_attr->prov_name,
        "): the peer endpoint, in this process, has closed; the write is refused before it "
        "reaches the provider (a peer that closed its end, or a task stopping)"));
  }
  return IssueToProvider(op);
}

absl::StatusOr<bool> OfiEndpoint::IssueToProvider(Op* op) {
  void* ctx = op->provider;
  ssize_t ret;
  if (op->kind == CompletionKind::kRead) {
    ret = fi_read(ep_, op->buf, op->len, op->desc, peer_, op->remote_addr, op->remote_key, ctx);
  } else if (op->with_imm && split_writes_ && op->len > kSplitWritesAbove) {
    if (!op->data_posted) {
      ret = fi_write(ep_, op->buf, op->len, op->desc, peer_, op->remote_addr, op->remote_key,
                     data_ctx());
      if (ret == -FI_EAGAIN) return false;
      if (ret != 0) {
        return absl::UnavailableError(FiError("ofi: posting the operation", static_cast<int>(ret)));
      }
      op->data_posted = true;  // a retry after EAGAIN posts the immediate alone
    }
    ret = fi_writedata(ep_, nullptr, 0, nullptr, op->imm, peer_, op->remote_addr, op->remote_key,
                       ctx);
  } else if (op->with_imm) {
    ret = fi_writedata(ep_, op->buf, op->len, op->desc, op->imm, peer_, op->remote_addr,
                       op->remote_key, ctx);
  } else {
    ret = fi_write(ep_, op->buf, op->len, op->desc, peer_, op->remote_addr, op->remote_key, ctx);
  }
  if (ret == 0) return true;
  if (ret == -FI_EAGAIN) return false;
  return absl::UnavailableError(FiError("ofi: posting the operation", static_cast<int>(ret)));
}

size_t OfiEndpoint::ReadError(absl::Span<Completion> out) {
  fi_cq_err_entry err{};
  ssize_t r = fi_cq_readerr(cq_, &err, 0);
  if (r < 0) return 0;
  const char* detail = fi_cq_strerror(cq_, err.prov_errno, err.err_data, nullptr, 0);
  absl::Status status = absl::UnavailableError(absl::StrCat(
      "ofi (", shared_->info->fabric_attr->prov_name, "): operation failed: ", fi_strerror(err.err),
      "; provider error ", err.prov_errno, ": ", detail ? detail : "?"));
  if (err.op_context == data_ctx()) {
    // Which write it was is not known here; the connection is broken, so every split write
    // from now on reports it, and the one whose data failed has not completed yet.
    if (split_error_.ok()) split_error_ = status;
    return 0;
  }
  if (err.op_context == nullptr || err.op_context == receive_ctx()) {
    LOG(WARNING) << status.message();
    return 0;
  }
  Op* op = static_cast<Op*>(err.op_context);
  if (out.empty()) {
    ops_.Defer(op, status);  // no room: reported by the next Drain
    return 0;
  }
  return ops_.Complete(op, status, &out[0]) ? 1 : 0;
}

}  // namespace tensorverbs::fabric::ofi
