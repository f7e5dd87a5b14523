#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"
#include "src/fabric/ofi/local_peers.h"
#include "src/fabric/ofi/ofi.h"
#include "src/fabric/ofi/ofi_internal.h"

namespace tensorverbs::fabric::ofi {
namespace {

// Zero-length receives kept posted where the provider consumes one per immediate: per port
// serving one endpoint, and per port that all of a domain's endpoints share.
constexpr int kPostedReceives = 64;
constexpr int kSharedPostedReceives = 512;

// Op's context_tag is 0; the port's own contexts say what they are.
constexpr uint32_t kReceiveTag = 0x52454356;   // "RECV"
constexpr uint32_t kDataPartTag = 0x44415441;  // "DATA"

constexpr uint32_t kGenerations = (1u << (32 - Port::kSlotBits)) - 1;  // 1..4095

std::atomic<int64_t> g_open_ports{0};
std::atomic<int64_t> g_late_immediates{0};

}  // namespace

static_assert(offsetof(Op, context_tag) == offsetof(AuxContext, context_tag),
              "a context handed back must say what it is at the same place in both");
static_assert(sizeof(fi_context2) <= sizeof(AuxContext::provider), "fi_context2 must fit");

int64_t OpenPorts() { return g_open_ports.load(std::memory_order_relaxed); }
int64_t LateImmediatesDropped() { return g_late_immediates.load(std::memory_order_relaxed); }

Port::Port(std::shared_ptr<Shared> shared, bool serves_many)
    : shared_(std::move(shared)), serves_many_(serves_many) {}

absl::Status Port::Init() {
  int ret = fi_endpoint(shared_->domain, shared_->info, &ep_, nullptr);
  if (ret) return absl::UnavailableError(FiError("ofi: fi_endpoint", ret));
  const int receives = serves_many_ ? kSharedPostedReceives : kPostedReceives;
  const size_t depth = shared_->options.queue_depth;
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_DATA;
  // A shared port's queue holds the completions of every endpoint's operations and every
  // peer's immediates; the providers here keep what overflows it, so this sizes the common case.
  cq_attr.size = serves_many_ ? std::max<size_t>(depth * 4 + receives, 4096)
                              : std::max<size_t>(depth * 2 + receives, 256);
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
  name_.assign(name, len);
  if (shared_->info->mode & FI_RX_CQ_DATA) {
    receives_.reserve(receives);
    for (int i = 0; i < receives; ++i) {
      receives_.push_back(std::make_unique<AuxContext>());
      receives_.back()->context_tag = kReceiveTag;
      RETURN_IF_ERROR(PostReceive(receives_.back().get()));
    }
  }
  shared_->ports.push_back(this);
  gate_ = LocalPeers::Get().Open(name_);
  g_open_ports.fetch_add(1, std::memory_order_relaxed);
  counted_ = true;
  return absl::OkStatus();
}

Port::~Port() {
  auto& ports = shared_->ports;
  ports.erase(std::remove(ports.begin(), ports.end(), this), ports.end());
  // Before the provider closes it: a peer of this process posting to it waits, then is
  // refused.
  if (gate_ != nullptr) LocalPeers::Get().Close(name_, gate_);
  if (ep_) fi_close(&ep_->fid);
  if (cq_) fi_close(&cq_->fid);
  // The provider holds nothing of ours any more.
  for (Op* op : orphans_) delete op;
  for (AuxContext* part : data_parts_live_) delete part;
  if (counted_) g_open_ports.fetch_sub(1, std::memory_order_relaxed);
}

absl::StatusOr<uint32_t> Port::Attach(OfiEndpoint* ep) {
  uint32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else if (slots_.size() < kMaxSlots) {
    slot = static_cast<uint32_t>(slots_.size());
    slots_.emplace_back();
  } else {
    return absl::ResourceExhaustedError(absl::StrCat(
        "ofi (", shared_->provider(), "): ", kMaxSlots,
        " endpoints share this domain's provider endpoint already; close channels first"));
  }
  Slot& s = slots_[slot];
  s.generation = s.generation % kGenerations + 1;
  s.ep = ep;
  return (s.generation << kSlotBits) | slot;
}

void Port::Detach(uint32_t id, OpTracker& ops) {
  const uint32_t slot = id & (kMaxSlots - 1);
  if (slot < slots_.size() && slots_[slot].ep != nullptr &&
      slots_[slot].generation == id >> kSlotBits) {
    slots_[slot].ep = nullptr;
    free_slots_.push_back(slot);
  }
  ops.Orphan([this](Op* op) { orphans_.insert(op); });
}

OfiEndpoint* Port::Route(uint64_t data) const {
  if (!serves_many_) return slots_.empty() ? nullptr : slots_[0].ep;
  const uint32_t id = static_cast<uint32_t>(data >> 32);
  const uint32_t slot = id & (kMaxSlots - 1);
  if (slot >= slots_.size()) return nullptr;
  const Slot& s = slots_[slot];
  return s.generation == id >> kSlotBits ? s.ep : nullptr;
}

size_t Port::Progress(absl::Span<Completion> out) {
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
        if ((e.flags & FI_RECV) && e.op_context != nullptr &&
            static_cast<AuxContext*>(e.op_context)->context_tag == kReceiveTag) {
          (void)PostReceive(static_cast<AuxContext*>(e.op_context));
        }
        OfiEndpoint* ep = Route(e.data);
        if (ep == nullptr) {
          // A write of an endpoint's predecessor on its slot, or of a closed one: its channel
          // is gone, and the immediate must reach neither it nor its successor.
          g_late_immediates.fetch_add(1, std::memory_order_relaxed);
          continue;
        }
        Completion& c = out[produced++];
        c = Completion();
        c.kind = CompletionKind::kRemoteWriteImm;
        c.endpoint = ep;
        c.imm = static_cast<uint32_t>(e.data);
        c.byte_len = e.len;
        continue;
      }
      if (Returned(e.op_context, absl::OkStatus(), &out[produced])) ++produced;
    }
  }
  return produced;
}

bool Port::Returned(void* context, absl::Status status, Completion* c) {
  if (context == nullptr) {
    if (!status.ok()) LOG(WARNING) << status.message();
    return false;
  }
  auto* aux = static_cast<AuxContext*>(context);
  if (aux->context_tag == kReceiveTag) {  // a receive consumed without data, or failed
    if (!status.ok()) LOG(WARNING) << status.message();
    return false;
  }
  if (aux->context_tag == kDataPartTag) {
    aux->data_returned = true;
    if (!status.ok() && aux->error.ok()) aux->error = std::move(status);
    if (aux->op_returned) FreeDataPart(aux);
    return false;
  }
  Op* op = static_cast<Op*>(context);
  if (op->aux != nullptr) {
    // tcp completes in posting order, so a failed data part has been seen by now.
    auto* part = static_cast<AuxContext*>(std::exchange(op->aux, nullptr));
    if (status.ok() && part->data_returned) status = part->error;
    part->op_returned = true;
    if (part->data_returned) FreeDataPart(part);
  }
  OpTracker* tracker = op->tracker;
  if (tracker == nullptr) {  // its endpoint is gone
    orphans_.erase(op);
    delete op;
    return false;
  }
  if (c == nullptr) {
    tracker->Defer(op, std::move(status));  // no room: reported by its endpoint's next Drain
    return false;
  }
  return tracker->Complete(op, std::move(status), c);
}

size_t Port::ReadError(absl::Span<Completion> out) {
  fi_cq_err_entry err{};
  ssize_t r = fi_cq_readerr(cq_, &err, 0);
  if (r < 0) return 0;
  const char* detail = fi_cq_strerror(cq_, err.prov_errno, err.err_data, nullptr, 0);
  absl::Status status = absl::UnavailableError(
      absl::StrCat("ofi (", shared_->provider(), "): operation failed: ", fi_strerror(err.err),
                   "; provider error ", err.prov_errno, ": ", detail ? detail : "?"));
  return Returned(err.op_context, std::move(status), out.empty() ? nullptr : &out[0]) ? 1 : 0;
}

absl::Status Port::PostReceive(AuxContext* context) {
  int ret = fi_recv(ep_, nullptr, 0, nullptr, FI_ADDR_UNSPEC, context);
  if (ret) return absl::UnavailableError(FiError("ofi: fi_recv", ret));
  return absl::OkStatus();
}

AuxContext* Port::NewDataPart() {
  std::unique_ptr<AuxContext> part;
  if (data_parts_free_.empty()) {
    part = std::make_unique<AuxContext>();
  } else {
    part = std::move(data_parts_free_.back());
    data_parts_free_.pop_back();
    *part = AuxContext();
  }
  part->context_tag = kDataPartTag;
  AuxContext* raw = part.release();
  data_parts_live_.insert(raw);
  return raw;
}

void Port::FreeDataPart(AuxContext* part) {
  data_parts_live_.erase(part);
  data_parts_free_.emplace_back(part);
}

}  // namespace tensorverbs::fabric::ofi
