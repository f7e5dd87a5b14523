#include "tests/unit/fabric/fake_nic.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

namespace tensorverbs::testing {
namespace {

struct FakeCq {
  ibv_cq cq{};
  size_t capacity = 0;
  std::deque<ibv_wc> queue;
  bool armed = false;
  int channel_write_fd = -1;

  // A completion on an armed CQ raises one event on its completion channel.
  void Push(const ibv_wc& wc) {
    if (queue.size() >= capacity) {
      ++FakeNic::Get().cq_overruns;
      return;
    }
    queue.push_back(wc);
    if (armed && channel_write_fd >= 0) {
      armed = false;
      ibv_cq* self = &cq;
      if (write(channel_write_fd, &self, sizeof(self)) == sizeof(self)) {
        ++FakeNic::Get().cq_events_raised;
      }
    }
  }
};

struct FakeQp;

// A write with immediate that found no posted receive: like an RC QP with rnr_retry 7, the
// sender keeps retrying, so it completes on both sides once the target posts a receive.
struct WaitingWrite {
  ibv_wc arrived;
  ibv_wc done;
  FakeQp* sender;
};

// A shared receive queue: its receives, and the writes with immediate that found none.
struct FakeSrq {
  ibv_srq srq{};
  std::deque<uint64_t> receives;
  std::deque<WaitingWrite> waiting;
};

struct FakeQp {
  ibv_qp qp{};
  FakeCq* cq = nullptr;
  FakeSrq* srq = nullptr;  // where its receives come from, if made with one
  uint32_t max_send_wr = 0;
  uint32_t sends_in_cq = 0;  // sends posted and not yet polled: the send queue's occupancy
  std::deque<uint64_t> receives;
  std::deque<WaitingWrite> waiting;
  uint32_t dest_qp = 0;
  ibv_qp_state state = IBV_QPS_RESET;
};

struct FakeMr {
  ibv_mr mr{};
  int access = 0;
};

struct FakeMw {
  ibv_mw mw{};
  bool bound = false;
  uint32_t rkey = 0;  // the key of the current binding
  uint64_t addr = 0;
  uint64_t length = 0;
  int access = 0;
  uint32_t qp_num = 0;  // the queue pair it was bound on, the only one it takes access through
};

struct State {
  // Device 0, and device 1 where FakeNic::second_device: each with its own context and PD.
  ibv_device devices[2]{};
  ibv_device* list[3] = {&devices[0], nullptr, nullptr};
  ibv_context ctxs[2]{};
  ibv_pd pds[2]{};
  int async_pipe[2] = {-1, -1};
  std::map<uint32_t, std::unique_ptr<FakeQp>> qps;
  std::map<uint32_t, std::unique_ptr<FakeMr>> mrs;  // rkey == lkey
  std::map<ibv_mw*, std::unique_ptr<FakeMw>> mws;
  uint32_t next_qpn = 100;
  uint32_t next_key = 0x1000;
  uint32_t next_window = 0x10000;  // keys: index << 8 | tag, apart from the registrations' keys
};

State& S() {
  static State* s = new State;
  return *s;
}

FakeQp* Qp(ibv_qp* qp) { return S().qps.at(qp->qp_num).get(); }

bool InRange(uint64_t base, uint64_t length, uint64_t addr, uint64_t len) {
  return addr >= base && len <= length && addr - base <= length - len;
}

// Whether `key` grants `need` on [addr, addr+len) to a request arriving on queue pair `target`.
bool InRegion(uint32_t key, uint64_t addr, uint64_t len, int need, uint32_t target) {
  for (const auto& [handle, w] : S().mws) {
    if (w->bound && w->rkey == key) {
      return w->qp_num == target && (w->access & need) == need &&
             InRange(w->addr, w->length, addr, len);
    }
  }
  auto it = S().mrs.find(key);
  if (it == S().mrs.end()) return false;
  const ibv_mr& mr = it->second->mr;
  auto base = reinterpret_cast<uint64_t>(mr.addr);
  return (it->second->access & need) == need && addr >= base && len <= mr.length &&
         addr - base <= mr.length - len;
}

int PostSend(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
  FakeQp* q = Qp(qp);
  if (q->sends_in_cq >= q->max_send_wr) {
    *bad = wr;
    return ENOMEM;
  }
  ++FakeNic::Get().sends_posted;
  ibv_wc done{};
  done.wr_id = wr->wr_id;
  done.qp_num = qp->qp_num;
  done.status = IBV_WC_SUCCESS;
  const uint64_t len = wr->num_sge ? wr->sg_list[0].length : 0;
  void* local = wr->num_sge ? reinterpret_cast<void*>(wr->sg_list[0].addr) : nullptr;
  if (wr->opcode == IBV_WR_BIND_MW) {
    // Type 2: bound to this queue pair, over a registration that allows binding.
    done.opcode = IBV_WC_BIND_MW;
    auto w = S().mws.find(wr->bind_mw.mw);
    const ibv_mw_bind_info& info = wr->bind_mw.bind_info;
    auto mr = info.mr != nullptr ? S().mrs.find(info.mr->rkey) : S().mrs.end();
    if (q->state != IBV_QPS_RTS || w == S().mws.end() || mr == S().mrs.end() ||
        (mr->second->access & IBV_ACCESS_MW_BIND) == 0 ||
        (wr->bind_mw.rkey & ~0xFFu) != (w->second->mw.rkey & ~0xFFu) ||
        !InRange(reinterpret_cast<uint64_t>(info.mr->addr), info.mr->length, info.addr,
                 info.length)) {
      done.status = IBV_WC_MW_BIND_ERR;
    } else {
      FakeMw& fw = *w->second;
      fw.bound = true;
      fw.rkey = wr->bind_mw.rkey;
      fw.addr = info.addr;
      fw.length = info.length;
      fw.access = static_cast<int>(info.mw_access_flags);
      fw.qp_num = qp->qp_num;
      ++FakeNic::Get().windows_bound;
    }
    q->cq->Push(done);
    ++q->sends_in_cq;
    return 0;
  }
  const bool read = wr->opcode == IBV_WR_RDMA_READ;
  const int need = read ? IBV_ACCESS_REMOTE_READ : IBV_ACCESS_REMOTE_WRITE;
  auto dest = S().qps.find(q->dest_qp);
  if (q->state == IBV_QPS_RTS && dest != S().qps.end() &&
      FakeNic::Get().unanswering.count(q->dest_qp) != 0) {
    ++q->sends_in_cq;  // held, as retries to a silent host are
    return 0;
  }
  if (q->state != IBV_QPS_RTS || dest == S().qps.end()) {
    done.status = IBV_WC_RETRY_EXC_ERR;
  } else if (len > 0 &&
             !InRegion(wr->wr.rdma.rkey, wr->wr.rdma.remote_addr, len, need, q->dest_qp)) {
    done.status = IBV_WC_REM_ACCESS_ERR;
  } else {
    auto* remote = reinterpret_cast<void*>(wr->wr.rdma.remote_addr);
    if (len > 0) read ? std::memcpy(local, remote, len) : std::memcpy(remote, local, len);
    if (wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM) {
      FakeQp* d = dest->second.get();
      ibv_wc arrived{};
      arrived.status = IBV_WC_SUCCESS;
      arrived.opcode = IBV_WC_RECV_RDMA_WITH_IMM;
      arrived.wc_flags = IBV_WC_WITH_IMM;
      arrived.imm_data = wr->imm_data;  // network order on the wire
      arrived.byte_len = static_cast<uint32_t>(len);
      arrived.qp_num = d->qp.qp_num;
      done.opcode = IBV_WC_RDMA_WRITE;
      ++q->sends_in_cq;
      std::deque<uint64_t>& receives = d->srq ? d->srq->receives : d->receives;
      if (receives.empty()) {
        (d->srq ? d->srq->waiting : d->waiting).push_back({arrived, done, q});
        return 0;
      }
      arrived.wr_id = receives.front();
      receives.pop_front();
      if (d->srq) --FakeNic::Get().srq_posted;
      d->cq->Push(arrived);
      q->cq->Push(done);
      return 0;
    }
  }
  done.opcode = read ? IBV_WC_RDMA_READ : IBV_WC_RDMA_WRITE;
  q->cq->Push(done);
  ++q->sends_in_cq;
  return 0;
}

int PostRecv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  FakeQp* q = Qp(qp);
  if (q->srq != nullptr) {
    *bad = wr;
    return EINVAL;  // a queue pair with a shared receive queue has none of its own
  }
  if (!q->waiting.empty()) {
    WaitingWrite w = q->waiting.front();
    q->waiting.pop_front();
    w.arrived.wr_id = wr->wr_id;
    q->cq->Push(w.arrived);
    w.sender->cq->Push(w.done);
    return 0;
  }
  q->receives.push_back(wr->wr_id);
  return 0;
}

int PostSrqRecv(ibv_srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  auto* q = reinterpret_cast<FakeSrq*>(srq);
  (void)bad;
  // A waiting write whose queue pair is gone lands nowhere; its receive stays posted.
  while (!q->waiting.empty()) {
    WaitingWrite w = q->waiting.front();
    q->waiting.pop_front();
    auto dest = S().qps.find(w.arrived.qp_num);
    if (dest == S().qps.end()) continue;
    w.arrived.wr_id = wr->wr_id;
    dest->second->cq->Push(w.arrived);
    w.sender->cq->Push(w.done);
    return 0;
  }
  q->receives.push_back(wr->wr_id);
  ++FakeNic::Get().srq_posted;
  return 0;
}

ibv_mw* AllocMw(ibv_pd* pd, ibv_mw_type type) {
  if (type != IBV_MW_TYPE_2) {
    errno = EINVAL;
    return nullptr;
  }
  auto w = std::make_unique<FakeMw>();
  w->mw.context = pd->context;
  w->mw.pd = pd;
  w->mw.type = type;
  w->mw.rkey = S().next_window++ << 8;
  ibv_mw* out = &w->mw;
  S().mws[out] = std::move(w);
  ++FakeNic::Get().windows_live;
  return out;
}

int DeallocMw(ibv_mw* mw) {
  if (S().mws.erase(mw) == 0) return EINVAL;
  --FakeNic::Get().windows_live;
  return 0;
}

int ReqNotifyCq(ibv_cq* cq, int) {
  reinterpret_cast<FakeCq*>(cq)->armed = true;
  return 0;
}

int PollCq(ibv_cq* cq, int n, ibv_wc* wc) {
  auto* c = reinterpret_cast<FakeCq*>(cq);
  int got = 0;
  while (got < n && !c->queue.empty()) {
    wc[got] = c->queue.front();
    c->queue.pop_front();
    auto it = S().qps.find(wc[got].qp_num);
    if (it != S().qps.end() && wc[got].opcode != IBV_WC_RECV_RDMA_WITH_IMM)
      --it->second->sends_in_cq;
    ++got;
  }
  return got;
}

}  // namespace

FakeNic& FakeNic::Get() {
  static FakeNic* nic = new FakeNic;
  return *nic;
}

void FakeNic::Reset() {
  *this = FakeNic();
  State& s = S();
  s.qps.clear();
  s.mrs.clear();
  s.mws.clear();
}

}  // namespace tensorverbs::testing

using tensorverbs::testing::FakeNic;
using tensorverbs::testing::S;
using tensorverbs::testing::State;

extern "C" {

ibv_device** __wrap_ibv_get_device_list(int* num) {
  State& s = S();
  const FakeNic& nic = FakeNic::Get();
  std::strncpy(s.devices[0].name, nic.name.c_str(), sizeof(s.devices[0].name) - 1);
  std::strncpy(s.devices[1].name, nic.second_name.c_str(), sizeof(s.devices[1].name) - 1);
  *num = nic.second_device ? 2 : 1;
  s.list[1] = nic.second_device ? &s.devices[1] : nullptr;
  return s.list;
}
void __wrap_ibv_free_device_list(ibv_device**) {}
ibv_context* __wrap_ibv_open_device(ibv_device* device) {
  State& s = S();
  ibv_context& ctx = s.ctxs[device == &s.devices[1] ? 1 : 0];
  ctx = ibv_context{};
  ctx.device = device;
  ctx.ops.post_send = tensorverbs::testing::PostSend;
  ctx.ops.post_recv = tensorverbs::testing::PostRecv;
  ctx.ops.poll_cq = tensorverbs::testing::PollCq;
  ctx.ops.post_srq_recv = tensorverbs::testing::PostSrqRecv;
  ctx.ops.req_notify_cq = tensorverbs::testing::ReqNotifyCq;
  if (FakeNic::Get().memory_windows) {
    ctx.ops.alloc_mw = tensorverbs::testing::AllocMw;
    ctx.ops.dealloc_mw = tensorverbs::testing::DeallocMw;
  }
  if (s.async_pipe[0] < 0) pipe(s.async_pipe);
  ctx.async_fd = s.async_pipe[0];
  return &ctx;
}
int __wrap_ibv_close_device(ibv_context*) { return 0; }
int __wrap_ibv_query_device(ibv_context*, ibv_device_attr* attr) {
  *attr = ibv_device_attr{};
  attr->phys_port_cnt = 1;
  attr->max_qp_wr = FakeNic::Get().max_qp_wr;
  attr->max_cqe = FakeNic::Get().max_cqe;
  if (FakeNic::Get().srq) {
    attr->max_srq = 1024;
    attr->max_srq_wr = 16384;
    attr->max_srq_sge = 1;
  }
  attr->max_mr_size = uint64_t{1} << 40;
  attr->max_qp_rd_atom = 16;
  attr->max_qp_init_rd_atom = 16;
  if (FakeNic::Get().memory_windows) attr->device_cap_flags |= IBV_DEVICE_MEM_WINDOW_TYPE_2B;
  return 0;
}
int __wrap_ibv_query_port(ibv_context*, uint8_t port, _compat_ibv_port_attr* compat) {
  auto* attr = reinterpret_cast<ibv_port_attr*>(compat);
  attr->state = FakeNic::Get().port_state;
  attr->active_mtu = FakeNic::Get().active_mtu;
  attr->link_layer = IBV_LINK_LAYER_ETHERNET;
  attr->gid_tbl_len = 2;
  attr->lid = 0;
  return port == 1 ? 0 : EINVAL;
}
ssize_t __wrap__ibv_query_gid_table(ibv_context*, ibv_gid_entry* entries, size_t max, uint32_t,
                                    size_t) {
  if (max < 2) return -EINVAL;
  entries[0] = ibv_gid_entry{};
  entries[0].port_num = 1;
  entries[0].gid_index = 0;
  entries[0].gid_type = IBV_GID_TYPE_ROCE_V1;
  inet_pton(AF_INET6, "fe80::7", entries[0].gid.raw);
  entries[1] = entries[0];
  entries[1].gid_index = 1;
  entries[1].gid_type = IBV_GID_TYPE_ROCE_V2;
  inet_pton(AF_INET6, FakeNic::Get().gid.c_str(), entries[1].gid.raw);
  return 2;
}
ibv_pd* __wrap_ibv_alloc_pd(ibv_context* ctx) {
  if (FakeNic::Get().fail_alloc_pd) {
    errno = ENOMEM;
    return nullptr;
  }
  ibv_pd& pd = S().pds[ctx == &S().ctxs[1] ? 1 : 0];
  pd.context = ctx;
  return &pd;
}
int __wrap_ibv_dealloc_pd(ibv_pd*) { return 0; }
ibv_mr* __wrap_ibv_reg_mr_iova2(ibv_pd* pd, void* addr, size_t length, uint64_t,
                                unsigned int access) {
  FakeNic& nic = FakeNic::Get();
  if (length > nic.memlock_bytes || nic.pinned_bytes > nic.memlock_bytes - length) {
    errno = ENOMEM;
    return nullptr;
  }
  nic.pinned_bytes += length;
  auto mr = std::make_unique<tensorverbs::testing::FakeMr>();
  mr->mr.context = pd->context;
  mr->mr.pd = pd;
  mr->mr.addr = addr;
  mr->mr.length = length;
  mr->mr.lkey = mr->mr.rkey = S().next_key++;
  mr->access = static_cast<int>(access);
  ibv_mr* out = &mr->mr;
  S().mrs[out->rkey] = std::move(mr);
  return out;
}
ibv_mr* __wrap_ibv_reg_mr(ibv_pd* pd, void* addr, size_t length, int access) {
  return __wrap_ibv_reg_mr_iova2(pd, addr, length, 0, static_cast<unsigned int>(access));
}
int __wrap_ibv_dereg_mr(ibv_mr* mr) {
  FakeNic::Get().pinned_bytes -= mr->length;
  S().mrs.erase(mr->rkey);
  return 0;
}
ibv_comp_channel* __wrap_ibv_create_comp_channel(ibv_context* ctx) {
  int fds[2];
  if (pipe(fds) != 0) return nullptr;
  auto* channel = new ibv_comp_channel{};
  channel->context = ctx;
  channel->fd = fds[0];
  channel->refcnt = fds[1];  // the fake keeps the pipe's write end here
  return channel;
}
int __wrap_ibv_destroy_comp_channel(ibv_comp_channel* channel) {
  close(channel->fd);
  close(channel->refcnt);
  delete channel;
  return 0;
}
int __wrap_ibv_get_cq_event(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) {
  if (read(channel->fd, cq, sizeof(*cq)) != sizeof(*cq)) return -1;
  *cq_context = (*cq)->cq_context;
  return 0;
}
void __wrap_ibv_ack_cq_events(ibv_cq*, unsigned int n) {
  FakeNic::Get().cq_events_acked += static_cast<int>(n);
}
ibv_cq* __wrap_ibv_create_cq(ibv_context* ctx, int cqe, void*, ibv_comp_channel* channel, int) {
  FakeNic& nic = FakeNic::Get();
  if (nic.fail_create_cq || cqe > nic.create_cq_limit || cqe > nic.max_cqe || cqe < 1) {
    errno = nic.fail_create_cq || cqe > nic.create_cq_limit ? ENOMEM : EINVAL;
    return nullptr;
  }
  ++nic.cqs_created;
  auto* cq = new tensorverbs::testing::FakeCq;
  cq->capacity = static_cast<size_t>(cqe);
  cq->cq.context = ctx;
  cq->cq.channel = channel;
  if (channel) cq->channel_write_fd = channel->refcnt;
  return &cq->cq;
}
int __wrap_ibv_destroy_cq(ibv_cq* cq) {
  delete reinterpret_cast<tensorverbs::testing::FakeCq*>(cq);
  return 0;
}
ibv_qp* __wrap_ibv_create_qp(ibv_pd* pd, ibv_qp_init_attr* init) {
  if (FakeNic::Get().fail_create_qp) {
    errno = ENOMEM;
    return nullptr;
  }
  auto q = std::make_unique<tensorverbs::testing::FakeQp>();
  q->qp.context = pd->context;
  q->qp.pd = pd;
  if (FakeNic::Get().reuse_qp_numbers) {
    uint32_t qpn = 100;
    while (S().qps.count(qpn) != 0) ++qpn;
    q->qp.qp_num = qpn;
  } else {
    q->qp.qp_num = S().next_qpn++;
  }
  q->cq = reinterpret_cast<tensorverbs::testing::FakeCq*>(init->send_cq);
  q->srq = reinterpret_cast<tensorverbs::testing::FakeSrq*>(init->srq);
  q->qp.srq = init->srq;
  ++FakeNic::Get().qps_live;
  q->max_send_wr = init->cap.max_send_wr;
  ibv_qp* out = &q->qp;
  S().qps[out->qp_num] = std::move(q);
  return out;
}
int __wrap_ibv_destroy_qp(ibv_qp* qp) {
  const uint32_t qpn = qp->qp_num;  // `qp` goes with its record
  auto it = S().qps.find(qpn);
  if (it != S().qps.end() && FakeNic::Get().destroy_cleans_cq) {
    std::deque<ibv_wc>& queue = it->second->cq->queue;
    queue.erase(std::remove_if(queue.begin(), queue.end(),
                               [qpn](const ibv_wc& w) { return w.qp_num == qpn; }),
                queue.end());
  }
  if (S().qps.erase(qpn) != 0) --FakeNic::Get().qps_live;
  FakeNic::Get().unanswering.erase(qpn);  // the number may be the next queue pair's
  return 0;
}
ibv_srq* __wrap_ibv_create_srq(ibv_pd* pd, ibv_srq_init_attr* init) {
  FakeNic& nic = FakeNic::Get();
  if (!nic.srq || init->attr.max_wr > 16384) {
    errno = nic.srq ? EINVAL : EOPNOTSUPP;
    return nullptr;
  }
  ++nic.srqs_created;
  ++nic.srqs_live;
  auto* q = new tensorverbs::testing::FakeSrq;
  q->srq.context = pd->context;
  q->srq.pd = pd;
  return &q->srq;
}
int __wrap_ibv_destroy_srq(ibv_srq* srq) {
  auto* q = reinterpret_cast<tensorverbs::testing::FakeSrq*>(srq);
  FakeNic::Get().srq_posted -= static_cast<int>(q->receives.size());
  --FakeNic::Get().srqs_live;
  delete q;
  return 0;
}
int __wrap_ibv_modify_qp(ibv_qp* qp, ibv_qp_attr* attr, int mask) {
  FakeNic& nic = FakeNic::Get();
  nic.modifies.push_back({qp->qp_num, *attr, mask});
  if ((mask & IBV_QP_STATE) && attr->qp_state == nic.fail_modify_to) return EINVAL;
  auto* q = tensorverbs::testing::Qp(qp);
  if (mask & IBV_QP_STATE) q->state = attr->qp_state;
  if (mask & IBV_QP_DEST_QPN) q->dest_qp = attr->dest_qp_num;
  return 0;
}
int __wrap_ibv_get_async_event(ibv_context*, ibv_async_event* event) {
  FakeNic& nic = FakeNic::Get();
  if (nic.async_events.empty()) {
    errno = EAGAIN;
    return -1;
  }
  *event = nic.async_events.front();
  nic.async_events.pop_front();
  return 0;
}
void __wrap_ibv_ack_async_event(ibv_async_event*) {}

}  // extern "C"
