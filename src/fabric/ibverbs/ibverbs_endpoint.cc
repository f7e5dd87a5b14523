#include <arpa/inet.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"
#include "src/fabric/ibverbs/ibverbs_internal.h"

namespace tensorverbs::fabric::ibverbs {
namespace {

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

}  // namespace

std::string Errno(absl::string_view what, int err) {
  return absl::StrCat("ibverbs: ", what, ": ", std::strerror(err));
}

IbvEndpoint::IbvEndpoint(std::shared_ptr<Shared> shared)
    : shared_(std::move(shared)),
      depth_(std::min<size_t>(shared_->options.queue_depth,
                              static_cast<size_t>(shared_->attr.max_qp_wr))),
      ops_(this, depth_, shared_->options.op_timeout,
           absl::StrCat("ibverbs (", shared_->selection.device, ")")) {}

absl::Status PostSharedReceive(Shared& shared) {
  ibv_recv_wr wr{};
  wr.wr_id = kReceiveWrId;
  wr.num_sge = 0;
  ibv_recv_wr* bad = nullptr;
  if (int e = ibv_post_srq_recv(shared.srq, &wr, &bad)) {
    return absl::UnavailableError(Errno("ibv_post_srq_recv", e));
  }
  return absl::OkStatus();
}

void GiveBack(Shared& shared, const ibv_wc& w) {
  if (w.wr_id == kReceiveWrId) {
    // Consumed whether it succeeded or was flushed; the queue stays full.
    if (absl::Status s = PostSharedReceive(shared); !s.ok()) {
      LOG(WARNING) << "ibverbs (" << shared.selection.device << "): " << s;
    }
  } else if (w.wr_id == kBindWrId) {
    ReturnBindRoom(shared, 1);
  } else {
    ++shared.send_room;
  }
}

void ReturnBindRoom(Shared& shared, size_t n) {
  const size_t to_binds = std::min(n, shared.bind_total - shared.bind_room);
  shared.bind_room += to_binds;
  shared.send_room += n - to_binds;
}

size_t TakeCompletions(Shared& shared) {
  ibv_wc wc[32];
  size_t taken = 0;
  int n;
  while ((n = ibv_poll_cq(shared.cq, 32, wc)) > 0) {
    for (int i = 0; i < n; ++i) GiveBack(shared, wc[i]);
    shared.stash.insert(shared.stash.end(), wc, wc + n);
    taken += static_cast<size_t>(n);
  }
  return taken;
}

absl::Status IbvEndpoint::Init() {
  const bool shared_cq = shared_->cq != nullptr;
  if (shared_cq) {
    cq_ = shared_->cq;
  } else {
    const int cqe = std::min<int>(static_cast<int>(2 * depth_ + 16), shared_->attr.max_cqe);
    cq_ = ibv_create_cq(shared_->ctx, cqe, nullptr, shared_->channel, 0);
    if (cq_ == nullptr) return absl::ResourceExhaustedError(Errno("ibv_create_cq", errno));
  }
  ibv_qp_init_attr init{};
  init.send_cq = cq_;
  init.recv_cq = cq_;
  init.srq = shared_->srq;
  init.qp_type = IBV_QPT_RC;
  // Room for memory window binds beside the operations, where the device allows it.
  init.cap.max_send_wr = static_cast<uint32_t>(std::min<size_t>(
      depth_ + (shared_->windows ? kBindSlack : 0), static_cast<size_t>(shared_->attr.max_qp_wr)));
  init.cap.max_recv_wr = shared_cq ? 0 : static_cast<uint32_t>(depth_);
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = shared_cq ? 0 : 1;
  qp_ = ibv_create_qp(shared_->pd, &init);
  if (qp_ == nullptr) return absl::ResourceExhaustedError(Errno("ibv_create_qp", errno));
  qp_num_ = qp_->qp_num;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = static_cast<uint16_t>(shared_->config.pkey_index);
  a.port_num = static_cast<uint8_t>(shared_->selection.port);
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  if (int e = ibv_modify_qp(qp_, &a,
                            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
    return absl::InvalidArgumentError(
        absl::StrCat(Errno("moving the QP to INIT", e),
                     " (check RDMA_QP_PKEY_INDEX=", shared_->config.pkey_index, ")"));
  }
  // Writes with immediate consume a receive each: keep the receive queue full (the shared one
  // is kept full by the domain).
  if (!shared_cq) {
    for (size_t i = 0; i < depth_; ++i) RETURN_IF_ERROR(PostReceive());
  }
  std::random_device rd;
  psn_ = rd() & 0xFFFFFF;
  if (!shared_cq) shared_->endpoints.push_back(this);
  shared_->by_qp[qp_num_] = this;
  return absl::OkStatus();
}

IbvEndpoint::~IbvEndpoint() {
  if (qp_ != nullptr) shared_->by_qp.erase(qp_num_);
  auto& eps = shared_->endpoints;
  eps.erase(std::remove(eps.begin(), eps.end(), this), eps.end());
  auto& active = shared_->active;
  active.erase(std::remove(active.begin(), active.end(), this), active.end());
  if (qp_ != nullptr && !own_cq()) {
    // Stopped first, and its completions taken out while it exists: a device that cleans a
    // destroyed queue pair's completions from the CQ itself (mlx5) frees the shared receives
    // they consumed without posting them again, and the SRQ would shrink with every channel.
    ibv_qp_attr stop{};
    stop.qp_state = IBV_QPS_ERR;
    (void)ibv_modify_qp(qp_, &stop, IBV_QP_STATE);
    ForgetCompletions(/*destroyed=*/false);
  }
  if (qp_) ibv_destroy_qp(qp_);
  if (cq_ != nullptr && own_cq()) {
    // Every CQ event taken from the channel must be acknowledged before destruction.
    if (unacked_events_ > 0) ibv_ack_cq_events(cq_, unacked_events_);
    ibv_destroy_cq(cq_);
  } else if (qp_ != nullptr) {
    ForgetCompletions(/*destroyed=*/true);
  }
}

void IbvEndpoint::ForgetCompletions(bool destroyed) {
  // The device may reuse this queue pair's number at once: a completion of it left in the CQ
  // would then reach the next endpoint given that number (a write with immediate of a closed
  // channel as its successor's, or an operation record freed with this endpoint). Once the queue
  // pair is destroyed nothing more of it enters the CQ, so take what is there now.
  TakeCompletions(*shared_);
  auto& stash = shared_->stash;
  auto mine = [this](const ibv_wc& w) { return w.qp_num == qp_num_; };
  for (const ibv_wc& w : stash) {
    if (mine(w)) Returned(w);
  }
  stash.erase(std::remove_if(stash.begin(), stash.end(), mine), stash.end());
  if (!destroyed) return;
  // Work requests the queue pair took with it will never complete: their room is free.
  shared_->send_room += sends_out_;
  ReturnBindRoom(*shared_, binds_out_);
  sends_out_ = binds_out_ = 0;
}

absl::StatusOr<std::pair<ibv_mw*, uint32_t>> IbvEndpoint::BindWindow(ibv_mr* mr, void* addr,
                                                                     size_t length, int access) {
  if (!connected_) return absl::FailedPreconditionError("ibverbs: endpoint is not connected");
  if (!qp_error_.ok()) return qp_error_;
  if (!own_cq() && !BindRoom()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "ibverbs: the completion queue of ", shared_->selection.device,
        " had no room for a memory window bind within ", absl::FormatDuration(kBindRoomWait),
        ": every entry is held by work under way; try again"));
  }
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
    if (!own_cq()) ReturnBindRoom(*shared_, 1);
    return e == ENOMEM ? absl::ResourceExhaustedError(absl::StrCat(
                             Errno("binding a memory window", e),
                             ": the send queue is full; raise RDMA_QUEUE_DEPTH or try again"))
                       : absl::UnavailableError(Errno("binding a memory window", e));
  }
  if (!own_cq()) ++binds_out_;
  return std::make_pair(mw, rkey);
}

bool IbvEndpoint::BindRoom() {
  const absl::Time deadline = absl::Now() + kBindRoomWait;
  while (true) {
    if (shared_->bind_room > 0) {
      --shared_->bind_room;
      return true;
    }
    // Lent by the sends where they have more than their reserve: a bind is one entry, and
    // the set-up of a channel waits on it.
    if (shared_->send_room > shared_->send_reserve) {
      --shared_->send_room;
      return true;
    }
    // The entries come back only as completions leave the CQ; binds complete at once. Peers'
    // writes keep arriving meanwhile, so the deadline holds whatever each round takes.
    if (absl::Now() >= deadline) return false;
    if (TakeCompletions(*shared_) == 0) std::this_thread::yield();
  }
}

std::string IbvEndpoint::LocalAddress() const {
  Address a;
  a.lid = shared_->selection.lid;
  a.qpn = qp_->qp_num;
  a.psn = psn_;
  a.mtu = static_cast<uint16_t>(shared_->selection.mtu);
  a.gid = shared_->selection.gid;
  return a.Pack();
}

absl::Status IbvEndpoint::Connect(absl::string_view peer_address) {
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
  if (int e = ibv_modify_qp(qp_, &a,
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
    return absl::UnavailableError(absl::StrCat(Errno("moving the QP to RTS", e),
                                               " (check RDMA_QP_TIMEOUT and RDMA_QP_RETRY_COUNT)"));
  }
  connected_ = true;
  return absl::OkStatus();
}

bool IbvEndpoint::ArmAndCheck() {
  if (ibv_req_notify_cq(cq_, 0) != 0) return true;  // cannot arm: let the caller poll
  ibv_wc wc[32];
  int n;
  while ((n = ibv_poll_cq(cq_, 32, wc)) > 0) stash_.insert(stash_.end(), wc, wc + n);
  return !stash_.empty();
}

size_t IbvEndpoint::Progress(absl::Span<Completion> out) {
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
      if (HandleCompletion(wc[i], &out[produced])) ++produced;
    }
  }
  produced += ops_.Drain([this](Op* op) { return Issue(op); }, out.subspan(produced));
  return produced;
}

void IbvEndpoint::Returned(const ibv_wc& w) {
  if (w.wr_id == kBindWrId) {
    if (binds_out_ > 0) --binds_out_;
  } else if (w.wr_id != kReceiveWrId && sends_out_ > 0) {
    --sends_out_;
  }
}

bool IbvEndpoint::Handle(const ibv_wc& w, Completion* c) {
  Returned(w);
  return HandleCompletion(w, c);
}

size_t IbvEndpoint::Drain(absl::Span<Completion> out) {
  return ops_.Drain([this](Op* op) { return Issue(op); }, out);
}

bool IbvEndpoint::HandleCompletion(const ibv_wc& w, Completion* c) {
  if (w.wr_id == kBindWrId) {
    // A bind produces no completion of the fabric's; a failed one breaks the queue pair.
    if (w.status != IBV_WC_SUCCESS && qp_error_.ok()) qp_error_ = WcError(w);
    return false;
  }
  if (w.wr_id == kReceiveWrId) {
    if (w.status != IBV_WC_SUCCESS) {
      // The QP went to error; its receives flush. The peer's writes cannot land.
      if (qp_error_.ok()) qp_error_ = WcError(w);
      return false;
    }
    *c = Completion();
    c->kind = CompletionKind::kRemoteWriteImm;
    c->endpoint = this;
    c->imm = ntohl(w.imm_data);
    c->byte_len = w.byte_len;
    if (own_cq()) (void)PostReceive();
    return true;
  }
  Op* op = reinterpret_cast<Op*>(w.wr_id);
  absl::Status status = w.status == IBV_WC_SUCCESS ? absl::OkStatus() : WcError(w);
  return ops_.Complete(op, std::move(status), c);
}

void IbvEndpoint::SetError(absl::Status status) {
  if (qp_error_.ok()) qp_error_ = std::move(status);
}

absl::Status IbvEndpoint::WcError(const ibv_wc& w) {
  return absl::UnavailableError(
      absl::StrCat("ibverbs (", shared_->selection.device, "): work completion failed: ",
                   ibv_wc_status_str(w.status), " (vendor error ", w.vendor_err, ")"));
}

absl::Status IbvEndpoint::PostReceive() {
  ibv_recv_wr wr{};
  wr.wr_id = kReceiveWrId;
  wr.num_sge = 0;
  ibv_recv_wr* bad = nullptr;
  if (int e = ibv_post_recv(qp_, &wr, &bad)) {
    return absl::UnavailableError(Errno("ibv_post_recv", e));
  }
  return absl::OkStatus();
}

absl::Status IbvEndpoint::Post(CompletionKind kind, bool with_imm, uint32_t imm,
                               const LocalBuffer& local, const RemoteBuffer& remote,
                               uint64_t context) {
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
  if (!own_cq() && !active) {
    // Polled for its queue and time-outs while it has operations under way (IbvDomain::Poll).
    active = true;
    shared_->active.push_back(this);
  }
  return ops_.Submit(op, [this](Op* o) { return Issue(o); });
}

absl::StatusOr<bool> IbvEndpoint::Issue(Op* op) {
  // No room in the shared CQ: wait as for a full send queue, until completions give some back.
  // The last of it only for a queue pair with little under way (kFairSends).
  if (!own_cq() && (shared_->send_room == 0 || (sends_out_ >= shared_->fair_sends &&
                                                shared_->send_room <= shared_->send_reserve))) {
    return false;
  }
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
  if (e == 0) {
    if (!own_cq()) {
      --shared_->send_room;
      ++sends_out_;
    }
    return true;
  }
  if (e == ENOMEM) return false;  // send queue full: retry when completions free slots
  return absl::UnavailableError(Errno("ibv_post_send", e));
}

}  // namespace tensorverbs::fabric::ibverbs
