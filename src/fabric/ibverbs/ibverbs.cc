#include "src/fabric/ibverbs/ibverbs.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <random>

#include "absl/strings/str_cat.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"
#include "src/fabric/endpoint_base.h"
#include "src/fabric/ibverbs/device_selection.h"
#include "src/fabric/ibverbs/inventory.h"
#include "src/fabric/op_tracker.h"
#include "src/fabric/wake_fd.h"

namespace tensorverbs::fabric::ibverbs {
namespace {

constexpr uint64_t kReceiveWrId = 0;  // wr_id of posted receives; ops use their address
constexpr uint64_t kBindWrId = 1;     // wr_id of memory window binds
// Send queue entries beyond the operations' depth, for memory window binds (one per pool region
// per channel, so rarely more than a few at once).
constexpr uint32_t kBindSlack = 16;

std::string Errno(absl::string_view what, int err) {
  return absl::StrCat("ibverbs: ", what, ": ", std::strerror(err));
}

ibv_mtu MtuEnum(int bytes) {
  switch (bytes) {
    case 256:
      return IBV_MTU_256;
    case 512:
      return IBV_MTU_512;
    case 1024:
      return IBV_MTU_1024;
    case 2048:
      return IBV_MTU_2048;
    default:
      return IBV_MTU_4096;
  }
}

// Endpoint address: version, LID, QPN, PSN, MTU, GID, little-endian, fixed size.
struct Address {
  static constexpr uint8_t kVersion = 1;
  static constexpr size_t kSize = 1 + 2 + 4 + 4 + 2 + 16;
  uint16_t lid = 0;
  uint32_t qpn = 0;
  uint32_t psn = 0;
  uint16_t mtu = 0;
  std::array<uint8_t, 16> gid{};

  std::string Pack() const {
    std::string out(kSize, '\0');
    auto* p = reinterpret_cast<uint8_t*>(out.data());
    p[0] = kVersion;
    for (int i = 0; i < 2; ++i) p[1 + i] = static_cast<uint8_t>(lid >> (8 * i));
    for (int i = 0; i < 4; ++i) p[3 + i] = static_cast<uint8_t>(qpn >> (8 * i));
    for (int i = 0; i < 4; ++i) p[7 + i] = static_cast<uint8_t>(psn >> (8 * i));
    for (int i = 0; i < 2; ++i) p[11 + i] = static_cast<uint8_t>(mtu >> (8 * i));
    std::memcpy(p + 13, gid.data(), 16);
    return out;
  }
  static absl::StatusOr<Address> Unpack(absl::string_view bytes) {
    if (bytes.size() != kSize || static_cast<uint8_t>(bytes[0]) != kVersion) {
      return absl::InvalidArgumentError(absl::StrCat("ibverbs: malformed peer address (",
                                                     bytes.size(), " bytes; expected ", kSize,
                                                     " of version ", kVersion, ")"));
    }
    const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
    Address a;
    for (int i = 0; i < 2; ++i) a.lid |= static_cast<uint16_t>(p[1 + i] << (8 * i));
    for (int i = 0; i < 4; ++i) a.qpn |= static_cast<uint32_t>(p[3 + i]) << (8 * i);
    for (int i = 0; i < 4; ++i) a.psn |= static_cast<uint32_t>(p[7 + i]) << (8 * i);
    for (int i = 0; i < 2; ++i) a.mtu |= static_cast<uint16_t>(p[11 + i] << (8 * i));
    std::memcpy(a.gid.data(), p + 13, 16);
    return a;
  }
};

// Remote key: rkey, region base, region length.
struct PackedKey {
  static constexpr size_t kSize = 20;
  uint32_t rkey = 0;
  uint64_t base = 0;
  uint64_t length = 0;
  RemoteKey Pack() const {
    char out[kSize];
    std::memcpy(&out[0], &rkey, 4);
    std::memcpy(&out[4], &base, 8);
    std::memcpy(&out[12], &length, 8);
    return RemoteKey(absl::string_view(out, kSize));
  }
  static absl::StatusOr<PackedKey> Unpack(absl::string_view b) {
    if (b.size() != kSize) return absl::InvalidArgumentError("ibverbs: malformed remote key");
    PackedKey k;
    std::memcpy(&k.rkey, b.data(), 4);
    std::memcpy(&k.base, b.data() + 4, 8);
    std::memcpy(&k.length, b.data() + 12, 8);
    return k;
  }
};

class IbvEndpoint;
class IbvRegion;

struct Shared {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_comp_channel* channel = nullptr;  // every endpoint's CQ reports here; Wait blocks on it
  ibv_device_attr attr{};
  Selection selection;
  RdmaConfig config;
  DomainOptions options;
  std::vector<IbvEndpoint*> endpoints;
  // Type-2 memory windows work here: keys per channel are windows bound to the channel's queue
  // pair, which the NIC refuses on any other. Regions are then registered bindable, and these
  // are they (base -> region), for RegisterMemoryFor to bind windows to.
  bool windows = false;
  std::map<uintptr_t, const IbvRegion*> bindable;
  absl::Status device_error;  // sticky, from a fatal async event
  WakeFd wake;                // Domain::Interrupt

  ~Shared() {
    if (channel) ibv_destroy_comp_channel(channel);
    if (pd) ibv_dealloc_pd(pd);
    if (ctx) ibv_close_device(ctx);
  }
};

// What local operations need of any registration: its lkey.
class IbvMemory : public MemoryRegion {
 public:
  uint32_t lkey() const { return lkey_; }

 protected:
  IbvMemory(void* base, size_t length, uint32_t lkey) : MemoryRegion(base, length), lkey_(lkey) {}

 private:
  const uint32_t lkey_;
};

class IbvRegion final : public IbvMemory {
 public:
  IbvRegion(std::shared_ptr<Shared> shared, ibv_mr* mr, void* base, size_t length, bool bindable)
      : IbvMemory(base, length, mr->lkey),
        shared_(std::move(shared)),
        mr_(mr),
        bindable_(bindable) {
    if (bindable_) shared_->bindable[reinterpret_cast<uintptr_t>(base)] = this;
  }
  ~IbvRegion() override {
    if (bindable_) {
      auto it = shared_->bindable.find(reinterpret_cast<uintptr_t>(base()));
      if (it != shared_->bindable.end() && it->second == this) shared_->bindable.erase(it);
    }
    ibv_dereg_mr(mr_);
  }
  RemoteKey PackRemoteKey() const override {
    return PackedKey{mr_->rkey, reinterpret_cast<uint64_t>(base()), length()}.Pack();
  }
  ibv_mr* mr() const { return mr_; }

 private:
  std::shared_ptr<Shared> shared_;
  ibv_mr* mr_;
  const bool bindable_;
};

// A registration for one channel: a type-2 memory window bound to the channel's queue pair over
// a bindable registration (the region's own, or `owned_mr` made for it). Deallocating the window
// invalidates its key.
class IbvWindow final : public IbvMemory {
 public:
  IbvWindow(std::shared_ptr<Shared> shared, ibv_mw* mw, uint32_t rkey, ibv_mr* mr, bool owned_mr,
            void* base, size_t length)
      : IbvMemory(base, length, mr->lkey),
        shared_(std::move(shared)),
        mw_(mw),
        rkey_(rkey),
        mr_(mr),
        owned_mr_(owned_mr) {}
  ~IbvWindow() override {
    ibv_dealloc_mw(mw_);
    if (owned_mr_) ibv_dereg_mr(mr_);
  }
  RemoteKey PackRemoteKey() const override {
    return PackedKey{rkey_, reinterpret_cast<uint64_t>(base()), length()}.Pack();
  }

 private:
  std::shared_ptr<Shared> shared_;
  ibv_mw* const mw_;
  const uint32_t rkey_;
  ibv_mr* const mr_;
  const bool owned_mr_;
};

class IbvEndpoint final : public EndpointBase {
 public:
  explicit IbvEndpoint(std::shared_ptr<Shared> shared)
      : shared_(std::move(shared)),
        depth_(std::min<size_t>(shared_->options.queue_depth,
                                static_cast<size_t>(shared_->attr.max_qp_wr))),
        ops_(this, depth_, shared_->options.op_timeout,
             absl::StrCat("ibverbs (", shared_->selection.device, ")")) {}

  absl::Status Init() {
    const int cqe = std::min<int>(static_cast<int>(2 * depth_ + 16), shared_->attr.max_cqe);
    cq_ = ibv_create_cq(shared_->ctx, cqe, nullptr, shared_->channel, 0);
    if (cq_ == nullptr) return absl::ResourceExhaustedError(Errno("ibv_create_cq", errno));
    ibv_qp_init_attr init{};
    init.send_cq = cq_;
    init.recv_cq = cq_;
    init.qp_type = IBV_QPT_RC;
    // Room for memory window binds beside the operations, where the device allows it.
    init.cap.max_send_wr =
        static_cast<uint32_t>(std::min<size_t>(depth_ + (shared_->windows ? kBindSlack : 0),
                                               static_cast<size_t>(shared_->attr.max_qp_wr)));
    init.cap.max_recv_wr = static_cast<uint32_t>(depth_);
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    qp_ = ibv_create_qp(shared_->pd, &init);
    if (qp_ == nullptr) return absl::ResourceExhaustedError(Errno("ibv_create_qp", errno));
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = static_cast<uint16_t>(shared_->config.pkey_index);
    a.port_num = static_cast<uint8_t>(shared_->selection.port);
    a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    if (int e = ibv_modify_qp(
            qp_, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
      return absl::InvalidArgumentError(
          absl::StrCat(Errno("moving the QP to INIT", e),
                       " (check RDMA_QP_PKEY_INDEX=", shared_->config.pkey_index, ")"));
    }
    // Writes with immediate consume a receive each: keep the receive queue full.
    for (size_t i = 0; i < depth_; ++i) RETURN_IF_ERROR(PostReceive());
    std::random_device rd;
    psn_ = rd() & 0xFFFFFF;
    shared_->endpoints.push_back(this);
    return absl::OkStatus();
  }

  ~IbvEndpoint() override {
    auto& eps = shared_->endpoints;
    eps.erase(std::remove(eps.begin(), eps.end(), this), eps.end());
    if (qp_) ibv_destroy_qp(qp_);
    if (cq_) {
      // Every CQ event taken from the channel must be acknowledged before destruction.
      if (unacked_events_ > 0) ibv_ack_cq_events(cq_, unacked_events_);
      ibv_destroy_cq(cq_);
    }
  }

  ibv_cq* cq() const { return cq_; }
  bool connected() const { return connected_; }

  // Binds a new type-2 window over [addr, addr+length) of `mr` to this queue pair, granting
  // `access` (IBV_ACCESS_REMOTE_*), and returns it with its key. The bind is a send work request:
  // everything this side posts later (the message carrying the key) executes after it, so the
  // peer cannot use the key before it is valid. A failed bind breaks the queue pair, like any
  // failed work request.
  absl::StatusOr<std::pair<ibv_mw*, uint32_t>> BindWindow(ibv_mr* mr, void* addr, size_t length,
                                                          int access) {
    if (!connected_) return absl::FailedPreconditionError("ibverbs: endpoint is not connected");
    if (!qp_error_.ok()) return qp_error_;
    ibv_mw* mw = ibv_alloc_mw(shared_->pd, IBV_MW_TYPE_2);
    if (mw == nullptr) return absl::ResourceExhaustedError(Errno("ibv_alloc_mw", errno));
    const uint32_t rkey = ibv_inc_rkey(mw->rkey);
    ibv_send_wr wr{};
    wr.wr_id = kBindWrId;
    wr.opcode = IBV_WR_BIND_MW;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.bind_mw.mw = mw;
    wr.bind_mw.rkey = rkey;
    wr.bind_mw.bind_info.mr = mr;
    wr.bind_mw.bind_info.addr = reinterpret_cast<uint64_t>(addr);
    wr.bind_mw.bind_info.length = length;
    wr.bind_mw.bind_info.mw_access_flags = static_cast<unsigned int>(access);
    ibv_send_wr* bad = nullptr;
    if (int e = ibv_post_send(qp_, &wr, &bad)) {
      ibv_dealloc_mw(mw);
      return e == ENOMEM ? absl::ResourceExhaustedError(absl::StrCat(
                               Errno("binding a memory window", e),
                               ": the send queue is full; raise RDMA_QUEUE_DEPTH or try again"))
                         : absl::UnavailableError(Errno("binding a memory window", e));
    }
    return std::make_pair(mw, rkey);
  }

  std::string LocalAddress() const override {
    Address a;
    a.lid = shared_->selection.lid;
    a.qpn = qp_->qp_num;
    a.psn = psn_;
    a.mtu = static_cast<uint16_t>(shared_->selection.mtu);
    a.gid = shared_->selection.gid;
    return a.Pack();
  }

  absl::Status Connect(absl::string_view peer_address) override {
    if (connected_) return absl::FailedPreconditionError("ibverbs: endpoint is already connected");
    ASSIGN_OR_RETURN(Address peer, Address::Unpack(peer_address));
    const Selection& sel = shared_->selection;
    const RdmaConfig& cfg = shared_->config;
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = MtuEnum(std::min<int>(sel.mtu, peer.mtu ? peer.mtu : sel.mtu));
    a.dest_qp_num = peer.qpn;
    a.rq_psn = peer.psn;
    a.max_dest_rd_atomic = static_cast<uint8_t>(std::clamp(shared_->attr.max_qp_rd_atom, 1, 16));
    a.min_rnr_timer = 12;
    a.ah_attr.port_num = static_cast<uint8_t>(sel.port);
    a.ah_attr.sl = static_cast<uint8_t>(cfg.sl);
    a.ah_attr.dlid = peer.lid;
    // RoCE always routes by GID; InfiniBand needs the GRH only across subnets.
    const bool global = sel.link_layer == LinkLayer::kEthernet || peer.lid == 0;
    if (global) {
      a.ah_attr.is_global = 1;
      std::memcpy(a.ah_attr.grh.dgid.raw, peer.gid.data(), 16);
      a.ah_attr.grh.sgid_index = static_cast<uint8_t>(sel.gid_index);
      a.ah_attr.grh.hop_limit = 64;
      a.ah_attr.grh.traffic_class = static_cast<uint8_t>(cfg.traffic_class);
    }
    if (int e =
            ibv_modify_qp(qp_, &a,
                          IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                              IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)) {
      return absl::UnavailableError(absl::StrCat(
          Errno("moving the QP to RTR", e), " (peer QPN ", peer.qpn, ", LID ", peer.lid, ", GID ",
          GidToString(peer.gid), "; check RDMA_GID_INDEX, RDMA_QP_MTU and RDMA_QP_SL)"));
    }
    ibv_qp_attr r{};
    r.qp_state = IBV_QPS_RTS;
    r.timeout = static_cast<uint8_t>(cfg.timeout);
    r.retry_cnt = static_cast<uint8_t>(cfg.retry_count);
    r.rnr_retry = 7;
    r.sq_psn = psn_;
    r.max_rd_atomic = static_cast<uint8_t>(std::clamp(shared_->attr.max_qp_init_rd_atom, 1, 16));
    if (int e = ibv_modify_qp(qp_, &r,
                              IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                  IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC)) {
      return absl::UnavailableError(absl::StrCat(
          Errno("moving the QP to RTS", e), " (check RDMA_QP_TIMEOUT and RDMA_QP_RETRY_COUNT)"));
    }
    connected_ = true;
    return absl::OkStatus();
  }

  size_t Outstanding() const override { return ops_.live(); }

  // Arms the CQ for the channel, then collects what arrived before arming (a completion that
  // raced the arming would raise no event). Returns whether anything is ready.
  bool ArmAndCheck() {
    if (ibv_req_notify_cq(cq_, 0) != 0) return true;  // cannot arm: let the caller poll
    ibv_wc wc[32];
    int n;
    while ((n = ibv_poll_cq(cq_, 32, wc)) > 0) stash_.insert(stash_.end(), wc, wc + n);
    return !stash_.empty();
  }

  void AckEvent() { ++unacked_events_; }

  size_t Progress(absl::Span<Completion> out) {
    size_t produced = 0;
    ibv_wc wc[32];
    while (produced < out.size()) {
      int n;
      if (!stash_.empty()) {
        n = static_cast<int>(std::min<size_t>({stash_.size(), 32, out.size() - produced}));
        std::copy_n(stash_.begin(), n, wc);
        stash_.erase(stash_.begin(), stash_.begin() + n);
      } else {
        n = ibv_poll_cq(cq_, static_cast<int>(std::min<size_t>(32, out.size() - produced)), wc);
      }
      if (n < 0) {
        LOG(WARNING) << "ibverbs: ibv_poll_cq failed on " << shared_->selection.device;
        break;
      }
      if (n == 0) break;
      for (int i = 0; i < n; ++i) {
        const ibv_wc& w = wc[i];
        if (w.wr_id == kBindWrId) {
          // A bind produces no completion of the fabric's; a failed one breaks the queue pair.
          if (w.status != IBV_WC_SUCCESS && qp_error_.ok()) qp_error_ = WcError(w);
          continue;
        }
        if (w.wr_id == kReceiveWrId) {
          if (w.status != IBV_WC_SUCCESS) {
            // The QP went to error; its receives flush. The peer's writes cannot land.
            if (qp_error_.ok()) qp_error_ = WcError(w);
            continue;
          }
          Completion& c = out[produced++];
          c = Completion();
          c.kind = CompletionKind::kRemoteWriteImm;
          c.endpoint = this;
          c.imm = ntohl(w.imm_data);
          c.byte_len = w.byte_len;
          (void)PostReceive();
          continue;
        }
        Op* op = reinterpret_cast<Op*>(w.wr_id);
        absl::Status status = w.status == IBV_WC_SUCCESS ? absl::OkStatus() : WcError(w);
        if (ops_.Complete(op, std::move(status), &out[produced])) ++produced;
      }
    }
    produced += ops_.Drain([this](Op* op) { return Issue(op); }, out.subspan(produced));
    return produced;
  }

  void SetError(absl::Status status) {
    if (qp_error_.ok()) qp_error_ = std::move(status);
  }
  uint32_t qp_num() const { return qp_->qp_num; }

 private:
  absl::Status WcError(const ibv_wc& w) {
    return absl::UnavailableError(
        absl::StrCat("ibverbs (", shared_->selection.device, "): work completion failed: ",
                     ibv_wc_status_str(w.status), " (vendor error ", w.vendor_err, ")"));
  }

  absl::Status PostReceive() {
    ibv_recv_wr wr{};
    wr.wr_id = kReceiveWrId;
    wr.num_sge = 0;
    ibv_recv_wr* bad = nullptr;
    if (int e = ibv_post_recv(qp_, &wr, &bad)) {
      return absl::UnavailableError(Errno("ibv_post_recv", e));
    }
    return absl::OkStatus();
  }

  absl::Status Post(CompletionKind kind, bool with_imm, uint32_t imm, const LocalBuffer& local,
                    const RemoteBuffer& remote, uint64_t context) override {
    if (!connected_) return absl::FailedPreconditionError("ibverbs: endpoint is not connected");
    if (!shared_->device_error.ok()) return shared_->device_error;
    if (!qp_error_.ok()) return qp_error_;
    ASSIGN_OR_RETURN(PackedKey key, PackedKey::Unpack(remote.key));
    RETURN_IF_ERROR(CheckRanges("ibverbs", local, remote, key.base, key.length));
    if (local.length > shared_->attr.max_mr_size || local.length > UINT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("ibverbs: ", local.length, " bytes exceed one work request"));
    }
    Op* op = ops_.NewOp(kind, with_imm, imm, local, remote, context);
    op->lkey = local.length > 0 ? static_cast<const IbvMemory*>(local.region)->lkey() : 0;
    op->remote_key = key.rkey;
    return ops_.Submit(op, [this](Op* o) { return Issue(o); });
  }

  absl::StatusOr<bool> Issue(Op* op) {
    ibv_sge sge{};
    sge.addr = reinterpret_cast<uint64_t>(op->buf);
    sge.length = static_cast<uint32_t>(op->len);
    sge.lkey = op->lkey;
    ibv_send_wr wr{};
    wr.wr_id = reinterpret_cast<uint64_t>(op);
    wr.sg_list = op->len > 0 ? &sge : nullptr;
    wr.num_sge = op->len > 0 ? 1 : 0;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.opcode = op->kind == CompletionKind::kRead ? IBV_WR_RDMA_READ
                : op->with_imm                    ? IBV_WR_RDMA_WRITE_WITH_IMM
                                                  : IBV_WR_RDMA_WRITE;
    if (op->with_imm) wr.imm_data = htonl(op->imm);
    wr.wr.rdma.remote_addr = op->remote_addr;
    wr.wr.rdma.rkey = static_cast<uint32_t>(op->remote_key);
    ibv_send_wr* bad = nullptr;
    int e = ibv_post_send(qp_, &wr, &bad);
    if (e == 0) return true;
    if (e == ENOMEM) return false;  // send queue full: retry when completions free slots
    return absl::UnavailableError(Errno("ibv_post_send", e));
  }

  std::shared_ptr<Shared> shared_;
  const size_t depth_;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  uint32_t psn_ = 0;
  bool connected_ = false;
  absl::Status qp_error_;
  std::vector<ibv_wc> stash_;  // collected by ArmAndCheck, reported by Progress
  unsigned int unacked_events_ = 0;
  OpTracker ops_;
};

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
    bool ready = false;
    for (IbvEndpoint* ep : shared_->endpoints) ready |= ep->ArmAndCheck();
    if (ready) return absl::OkStatus();
    pollfd fds[3] = {{shared_->channel->fd, POLLIN, 0},
                     {shared_->ctx->async_fd, POLLIN, 0},
                     {shared_->wake.fd(), POLLIN, 0}};
    const int ms =
        static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(timeout), INT32_MAX));
    if (poll(fds, 3, std::max(ms, 0)) < 0 && errno != EINTR) {
      return absl::UnavailableError(Errno("poll", errno));
    }
    shared_->wake.Drain();
    // Drain the channel (its fd is non-blocking); the events are acknowledged in batches.
    ibv_cq* cq = nullptr;
    void* cq_context = nullptr;
    while (ibv_get_cq_event(shared_->channel, &cq, &cq_context) == 0) {
      for (IbvEndpoint* ep : shared_->endpoints) {
        if (ep->cq() == cq) ep->AckEvent();
      }
    }
    return absl::OkStatus();
  }

  void Interrupt() override { shared_->wake.Signal(); }

  absl::StatusOr<size_t> Poll(absl::Span<Completion> out) override {
    ReadAsyncEvents();
    size_t produced = 0;
    const size_t n = shared_->endpoints.size();
    for (size_t i = 0; i < n && produced < out.size(); ++i) {
      produced += shared_->endpoints[(next_ + i) % n]->Progress(out.subspan(produced));
    }
    if (n > 0) next_ = (next_ + 1) % n;
    return produced;
  }

 private:
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
          for (IbvEndpoint* ep : shared_->endpoints) {
            if (ep->qp_num() == event.element.qp->qp_num) {
              ep->SetError(
                  absl::UnavailableError(absl::StrCat("ibverbs: queue pair error: ", what)));
            }
          }
          break;
        case IBV_EVENT_DEVICE_FATAL:
        case IBV_EVENT_PORT_ERR:
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

}  // namespace

absl::StatusOr<std::unique_ptr<Domain>> OpenIbverbsDomain(const DomainOptions& options,
                                                          const RdmaConfig& config) {
  ASSIGN_OR_RETURN(Inventory inventory, ReadInventory());
  ASSIGN_OR_RETURN(Selection selection, SelectDevice(inventory, config));
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
  // Both are read without blocking on the progress thread; Wait blocks on them with poll().
  for (int fd : {shared->ctx->async_fd, shared->channel->fd}) {
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  }
  LOG(INFO) << "ibverbs: using " << selection.reason;
  return std::unique_ptr<Domain>(new IbvDomain(std::move(shared)));
}

}  // namespace tensorverbs::fabric::ibverbs
