#include "src/fabric/ofi/ofi.h"

#include <poll.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "src/common/logging.h"
#include "src/common/net_address.h"
#include "src/common/status_macros.h"
#include "src/fabric/endpoint_base.h"
#include "src/fabric/ofi/local_peers.h"
#include "src/fabric/op_tracker.h"
#include "src/fabric/wake_fd.h"

namespace tensorverbs::fabric::ofi {
namespace {

// The longest address a string-format provider is believed to have (shm's are ~20 bytes).
constexpr size_t kMaxStringAddress = 256;

constexpr uint32_t kApiVersion = FI_VERSION(1, 9);
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

std::string FiError(absl::string_view what, int ret) {
  return absl::StrCat(what, ": ", fi_strerror(-ret), " (", ret, ")");
}

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

static_assert(sizeof(fi_context2) <= sizeof(Op::provider), "fi_context2 must fit in Op");

class OfiEndpoint final : public EndpointBase {
 public:
  explicit OfiEndpoint(std::shared_ptr<Shared> shared)
      : shared_(std::move(shared)),
        split_writes_(SplitsWrites(shared_->info)),
        ops_(this, shared_->options.queue_depth, shared_->options.op_timeout,
             absl::StrCat("ofi (", shared_->info->fabric_attr->prov_name, ")")) {}

  absl::Status Init() {
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

  ~OfiEndpoint() override {
    auto& eps = shared_->endpoints;
    eps.erase(std::remove(eps.begin(), eps.end(), this), eps.end());
    // Before the provider closes it: a peer of this process posting to it waits, then is
    // refused.
    LocalPeers::Get().Close(address_, gate_);
    if (ep_) fi_close(&ep_->fid);
    if (cq_) fi_close(&cq_->fid);
  }

  std::string LocalAddress() const override { return address_; }

  absl::Status Connect(absl::string_view peer_address) override {
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

  size_t Outstanding() const override { return ops_.live(); }

  fid* cq_fid() { return &cq_->fid; }
  int wait_fd() const { return wait_fd_; }

  // Reads this endpoint's completions into `out`; returns how many.
  size_t Progress(absl::Span<Completion> out) {
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

 private:
  absl::Status PostReceive() {
    int ret = fi_recv(ep_, nullptr, 0, nullptr, FI_ADDR_UNSPEC, receive_ctx());
    if (ret) return absl::UnavailableError(FiError("ofi: fi_recv", ret));
    return absl::OkStatus();
  }
  void* receive_ctx() { return &receive_ctx_; }
  void* data_ctx() { return &data_ctx_; }

  absl::Status Post(CompletionKind kind, bool with_imm, uint32_t imm, const LocalBuffer& local,
                    const RemoteBuffer& remote, uint64_t context) override {
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

  // Hands `op` to libfabric: true if posted, false if the provider is full, or the error. A
  // peer of this process is posted to only while it is open, under its gate's shared lock.
  absl::StatusOr<bool> Issue(Op* op) {
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

  absl::StatusOr<bool> IssueToProvider(Op* op) {
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
          return absl::UnavailableError(
              FiError("ofi: posting the operation", static_cast<int>(ret)));
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

  size_t ReadError(absl::Span<Completion> out) {
    fi_cq_err_entry err{};
    ssize_t r = fi_cq_readerr(cq_, &err, 0);
    if (r < 0) return 0;
    const char* detail = fi_cq_strerror(cq_, err.prov_errno, err.err_data, nullptr, 0);
    absl::Status status = absl::UnavailableError(absl::StrCat(
        "ofi (", shared_->info->fabric_attr->prov_name, "): operation failed: ",
        fi_strerror(err.err), "; provider error ", err.prov_errno, ": ", detail ? detail : "?"));
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
    auto ep = std::make_unique<OfiEndpoint>(shared_);
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
    for (OfiEndpoint* ep : shared_->endpoints) {
      if (ep->wait_fd() < 0) {
        // No wait object on this provider (shm): nap briefly on the interrupt fd alone, so a
        // local post (a new recv) ends the nap at once and peer traffic waits at most one nap.
        *timeout = std::min(*timeout, absl::Microseconds(50));
        return true;
      }
      fids_.push_back(ep->cq_fid());
      fds->push_back(pollfd{ep->wait_fd(), POLLIN, 0});
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
    const size_t n = shared_->endpoints.size();
    for (size_t i = 0; i < n && produced < out.size(); ++i) {
      OfiEndpoint* ep = shared_->endpoints[(next_ + i) % n];
      produced += ep->Progress(out.subspan(produced));
    }
    if (n > 0) next_ = (next_ + 1) % n;
    return produced;
  }

 private:
  std::shared_ptr<Shared> shared_;
  Capabilities caps_;
  size_t next_ = 0;
  std::vector<fid*> fids_;  // PrepareToSleep's, kept to reuse its storage
};

// libfabric's rxm layer (tcp;ofi_rxm, verbs;ofi_rxm) gives each endpoint, by default, a shared
// receive context of 4096 bounce buffers of 16 KiB: 64 MiB per endpoint, and this backend opens
// one endpoint per channel, two channels per peer. Measured (bench scale, 8 tasks in network
// namespaces): 1.26 GB of proportional memory per task, and 4.6 s to set up its channels. The
// protocol moves tensors by RMA writes, which take no bounce buffer; the rxm messages that do
// are rare and small. 256 buffers of 8 KiB bring a task to 0.36 GB and its set-up to 1.0 s, and
// raise the small-tensor rate over tcp (docs/PERFORMANCE.md). Buffers of 2 KiB halve what each
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

fi_info* MakeHints(const std::string& provider) {
  SetRxmDefaults();
  fi_info* hints = fi_allocinfo();
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE | FI_MSG;
  hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->domain_attr->cq_data_size = 4;
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
  fi_info* hints = MakeHints(provider);
  fi_info* info = nullptr;
  int ret = fi_getinfo(kApiVersion, nullptr, nullptr, 0, hints, &info);
  fi_freeinfo(hints);
  if (ret || info == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "ofi: provider '", provider, "' offers no RDM endpoint with RMA and remote CQ data here (",
        fi_strerror(-ret), "); `fi_info` lists the providers"));
  }
  fi_info* chosen = info;
  // shm and other providers that name endpoints themselves have no interfaces to choose from.
  if (!options.source_address.empty() && HasSocketAddress(info)) {
    chosen = EntryWithSource(info, options.source_address);
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
