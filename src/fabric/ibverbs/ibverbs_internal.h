// The ibverbs backend's parts shared by its domain (ibverbs.cc) and its endpoint
// (ibverbs_endpoint.cc): the domain-wide state every registration and endpoint holds (Shared),
// the registrations (a region, or a type-2 window bound to one queue pair) and the endpoint, a
// reliable-connected queue pair. Where the device has shared receive queues, every queue pair
// of the domain reports to one completion queue and takes its receives from one shared receive
// queue (Shared::cq, Shared::srq); elsewhere each endpoint has a completion and receive queue
// of its own.
//
// Private to src/fabric/ibverbs. Everything here runs on the thread that owns the domain (the
// progress thread); a registration or endpoint holds Shared, so the device context outlives
// them whatever order they are destroyed in.
#ifndef TENSORVERBS_FABRIC_IBVERBS_IBVERBS_INTERNAL_H_
#define TENSORVERBS_FABRIC_IBVERBS_IBVERBS_INTERNAL_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/fabric/endpoint_base.h"
#include "src/fabric/fabric.h"
#include "src/fabric/ibverbs/device_selection.h"
#include "src/fabric/ibverbs/inventory.h"
#include "src/fabric/op_tracker.h"
#include "src/fabric/wake_fd.h"

namespace tensorverbs::fabric::ibverbs {

inline constexpr uint64_t kReceiveWrId = 0;  // wr_id of posted receives; ops use their address
inline constexpr uint64_t kBindWrId = 1;     // wr_id of memory window binds
// Send queue entries beyond the operations' depth, for memory window binds (one per pool region
// per channel, so rarely more than a few at once).
inline constexpr uint32_t kBindSlack = 16;
// The shared completion queue's sizing: receives kept posted on the shared receive queue, and
// the send completions (operations, window binds) it has room for across all queue pairs.
inline constexpr uint32_t kSrqDepth = 4096;
inline constexpr size_t kSharedSendRoom = 16384;
inline constexpr size_t kSharedBindRoom = 4096;
// Below this much room for send completions a shared CQ is not worth it: endpoints get their own.
inline constexpr size_t kMinSharedSendRoom = 64;
// A queue pair holding this many send completions' room (fewer on a small CQ) takes none of the
// last quarter of it: a channel to a peer that stopped answering keeps its writes retried until
// the op timeout, and a few such channels' full send queues would otherwise hold every entry
// while the healthy channels' operations wait. With 16,384 entries, about 12 stalled channels
// hold the first three quarters, and it takes 256 more to use up the last.
inline constexpr size_t kFairSends = 16;
// How long a window bind waits for room in the shared CQ (polling it) before it fails: binds
// complete within microseconds on a NIC, so only a CQ left unpolled that long has none.
inline constexpr absl::Duration kBindRoomWait = absl::Milliseconds(100);

// "ibverbs: <what>: <strerror(err)>".
std::string Errno(absl::string_view what, int err);

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
struct Shared;

// One receive (zero bytes: writes with immediate land in registered memory) on the shared
// receive queue.
absl::Status PostSharedReceive(Shared& shared);
// What a completion taken from the shared CQ frees, whoever its queue pair was: the CQ room its
// work request held, or the shared receive it consumed (replaced at once). Called as it leaves
// the CQ, whether it is handed out then or stashed.
void GiveBack(Shared& shared, const ibv_wc& w);
// Room of `n` window binds given back: to the binds' own up to what they were given, the rest
// to the sends' (which lent it to a bind that found none).
void ReturnBindRoom(Shared& shared, size_t n);
// Takes every completion now in the shared CQ into the stash, giving back what each frees; the
// number taken.
size_t TakeCompletions(Shared& shared);

struct Shared {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_comp_channel* channel = nullptr;  // every endpoint's CQ reports here; Wait blocks on it
  ibv_device_attr attr{};
  Selection selection;
  RdmaConfig config;
  DomainOptions options;
  // The domain's completion queue and shared receive queue, where the device has shared receive
  // queues: a turn then polls one queue however many channels there are, and receives are
  // posted per device (kSrqDepth), not per channel (queue_depth each). Null elsewhere.
  ibv_cq* cq = nullptr;
  ibv_srq* srq = nullptr;
  // Room left in `cq` for send completions, of operations and of window binds. An operation
  // that finds none waits in its endpoint's queue, as for a full send queue, so that the CQ,
  // which every queue pair fills, never overruns; a bind that finds none borrows the sends'
  // beyond their reserve, else polls the CQ for up to kBindRoomWait.
  size_t send_room = 0;
  size_t bind_room = 0;
  size_t bind_total = 0;    // bind_room when nothing is under way
  size_t send_reserve = 0;  // of send_room, kept for queue pairs holding fewer than fair_sends
  size_t fair_sends = 0;
  unsigned int cq_unacked_events = 0;
  // Completions taken from `cq` and not yet handed out (ArmAndCheck, an endpoint's destruction,
  // a bind waiting for room); what they freed is already given back.
  std::vector<ibv_wc> stash;
  std::map<uint32_t, IbvEndpoint*> by_qp;  // every endpoint, by its queue pair number
  std::vector<IbvEndpoint*> active;        // shared-CQ endpoints with operations under way
  std::vector<IbvEndpoint*> endpoints;     // endpoints with a completion queue of their own
  // Type-2 memory windows work here: keys per channel are windows bound to the channel's queue
  // pair, which the NIC refuses on any other. Regions are then registered bindable, and these
  // are they (base -> region), for RegisterMemoryFor to bind windows to.
  bool windows = false;
  std::map<uintptr_t, const IbvRegion*> bindable;
  absl::Status device_error;  // sticky, from a fatal async event
  WakeFd wake;                // Domain::Interrupt

  ~Shared() {
    if (srq) ibv_destroy_srq(srq);
    if (cq) {
      if (cq_unacked_events > 0) ibv_ack_cq_events(cq, cq_unacked_events);
      ibv_destroy_cq(cq);
    }
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
  explicit IbvEndpoint(std::shared_ptr<Shared> shared);
  ~IbvEndpoint() override;

  // Creates the queue pair, on the domain's completion and shared receive queues where it has
  // them, else with its own completion queue and a full receive queue of its own.
  absl::Status Init();

  ibv_cq* cq() const { return cq_; }
  bool own_cq() const { return cq_ != shared_->cq; }
  bool connected() const { return connected_; }

  // Binds a new type-2 window over [addr, addr+length) of `mr` to this queue pair, granting
  // `access` (IBV_ACCESS_REMOTE_*), and returns it with its key. The bind is a send work request:
  // everything this side posts later (the message carrying the key) executes after it, so the
  // peer cannot use the key before it is valid. A failed bind breaks the queue pair, like any
  // failed work request.
  absl::StatusOr<std::pair<ibv_mw*, uint32_t>> BindWindow(ibv_mr* mr, void* addr, size_t length,
                                                          int access);

  std::string LocalAddress() const override;
  absl::Status Connect(absl::string_view peer_address) override;
  size_t Outstanding() const override { return ops_.live(); }

  // Arms the CQ for the channel, then collects what arrived before arming (a completion that
  // raced the arming would raise no event). Returns whether anything is ready.
  bool ArmAndCheck();
  void AckEvent() { ++unacked_events_; }
  // An endpoint with its own CQ: completions of this queue pair into `out`, then queued
  // operations issued where the send queue has room.
  size_t Progress(absl::Span<Completion> out);
  // A work completion of this queue pair taken from the domain's CQ (which has already given
  // back its CQ room and replaced a consumed shared receive): fills `c` and returns true where
  // it is one the fabric reports.
  bool Handle(const ibv_wc& w, Completion* c);
  // A shared-CQ endpoint with operations under way (in Shared::active): queued operations
  // issued, deferred failures and time-outs reported.
  size_t Drain(absl::Span<Completion> out);
  bool idle() const { return ops_.live() == 0; }
  bool active = false;
  void SetError(absl::Status status);
  uint32_t qp_num() const { return qp_->qp_num; }

 private:
  absl::Status WcError(const ibv_wc& w);
  absl::Status PostReceive();
  // Own-CQ and shared-CQ handling of one completion: receives are replaced here or by the domain.
  bool HandleCompletion(const ibv_wc& w, Completion* c);
  // Shared CQ: the completions of this queue pair now in the CQ are dropped (what they hold
  // given back); once it is `destroyed`, so is the room its unfinished work requests held.
  void ForgetCompletions(bool destroyed);
  // Shared CQ: a send work request of this queue pair came back (its room no longer held here).
  void Returned(const ibv_wc& w);
  absl::Status Post(CompletionKind kind, bool with_imm, uint32_t imm, const LocalBuffer& local,
                    const RemoteBuffer& remote, uint64_t context) override;
  // Shared CQ: takes room for one window bind, waiting up to kBindRoomWait; false if none came.
  bool BindRoom();
  // Posts `op`: true if posted, false if the send queue is full (retried later).
  absl::StatusOr<bool> Issue(Op* op);

  std::shared_ptr<Shared> shared_;
  const size_t depth_;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  uint32_t qp_num_ = 0;
  // Shared CQ: this queue pair's send work requests (operations; window binds) not yet
  // completed, which hold room in the CQ.
  size_t sends_out_ = 0;
  size_t binds_out_ = 0;
  uint32_t psn_ = 0;
  bool connected_ = false;
  absl::Status qp_error_;
  std::vector<ibv_wc> stash_;  // collected by ArmAndCheck, reported by Progress
  unsigned int unacked_events_ = 0;
  OpTracker ops_;
};

}  // namespace tensorverbs::fabric::ibverbs

#endif  // TENSORVERBS_FABRIC_IBVERBS_IBVERBS_INTERNAL_H_
