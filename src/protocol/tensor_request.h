// RdmaTensorRequest: the receiving side of one recv over a grpc+verbs channel (the owner's
// state machine of seed 000), one explicit machine per request. Its rows (state, event, guard,
// next state, action) are one table, kRequestTable in request_table.h: Move checks each move
// against it, the unit tests walk every row, and docs/architecture/state-machines.md draws it.
// In short: REQUEST goes out (kRequested); content lands (kDone), or META_DATA_RESPONSE comes
// and RE_REQUEST names a destination (kReRequested) before it does, after a grant for a large
// one (kAwaitingGrant); a pushed request parks what comes until a recv takes it over
// (kMetaParked, kLandedAhead). ERROR_STATUS, an aborted step and a close end it in any state.
//
// How the content gets to the recv (a destination of its own, or copy mode's buffer per name)
// is the channel's transfer mode, a strategy the request holds from the start
// (transfer_modes.h): the machine has no branch on it.
//
// Who the request serves is a field beside the state, not a state: a recv's (kRecv), or made
// ahead of any recv (kPushed) and then taken over by one (kAdopted) or given up (kDeclined).
// `Fail` (abort, deadline, ERROR_STATUS, channel closed) ends the recv at once whatever the
// state, but not the record: it keeps its index and destination until the sender answers, so
// late content never lands in memory anyone else uses.
//
// With a cached meta-data (keyed by rendezvous key, without step id) REQUEST already names the
// destination and the sender writes at once; otherwise (and always for strings and in
// validation mode) the meta-data round trip names it.
//
// Large destinations (ChannelEnv::large_in_flight): a recv of a large tensor names its
// destination in REQUEST only while the channel has no other such REQUEST out; otherwise it
// asks without one, and at META_DATA_RESPONSE takes one of the channel's grants (or waits in
// the channel's queue for one, kAwaitingGrant) before RE_REQUEST names the destination. The
// record holds its grant until it is finished.
//
// A pushed request (TENSORVERBS_PUSH) is one the channel made ahead of any recv: after a recv of
// a key at step s completes, it asks for the key at step s+1 with a destination from the cached
// meta-data, and no `done`. The recv of (key, s+1) then takes it over (Adopt) instead of sending
// REQUEST: if the content already landed (kLandedAhead), the recv completes at once. A pushed
// request that no recv can take (its step was aborted) is declined: it still ends as any ended
// recv does, when the sender answers. A META_DATA_RESPONSE (the tensor changed shape, died, is
// a string) does not decline it: the sender holds that step's tensor for this request, so the
// request keeps the answer (kMetaParked) until a recv takes it over (and then asks with a
// fitting destination) or its step ends (then it releases the tensor with an empty
// RE_REQUEST).
//
// Owned by its channel's ReceivingSide; every method runs on the transport's progress thread.
// `done` runs exactly once, through ChannelEnv::deliver (the worker's callback executor).
#ifndef TENSORVERBS_PROTOCOL_TENSOR_REQUEST_H_
#define TENSORVERBS_PROTOCOL_TENSOR_REQUEST_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "src/common/state_table.h"
#include "src/common/trace.h"
#include "src/fabric/fabric.h"
#include "src/protocol/message.h"
#include "src/rendezvous/key_table.h"
#include "src/rendezvous/remote_rendezvous.h"
#include "src/tensor/allocator.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::protocol {

class Channel;
class ReceivingSide;
class RequestMode;

class RdmaTensorRequest {
 public:
  enum class State {
    kQueued,         // made; REQUEST not sent yet (the channel is connecting, or full)
    kRequested,      // REQUEST sent: content or META_DATA_RESPONSE comes next
    kAwaitingGrant,  // META_DATA_RESPONSE in; waits for a large destination
    kMetaParked,     // pushed, no recv yet: the sender's META_DATA_RESPONSE waits for one
    kReRequested,    // RE_REQUEST sent: content (or the bare immediate) comes next
    kLandedAhead,    // pushed, no recv yet: the content landed and waits for one
    kDone,           // content in (delivered or dropped), or ended before sending
  };
  static constexpr int kStates = 7;
  // What moves a request: the table's events.
  enum class Event {
    kStart,        // the channel is ready: REQUEST goes out
    kMetaData,     // META_DATA_RESPONSE
    kGrant,        // the channel grants a large destination
    kAdopt,        // a recv takes the pushed request over
    kRelease,      // the pushed request's step ended while it held META_DATA_RESPONSE
    kContent,      // the content's (last) immediate
    kErrorStatus,  // ERROR_STATUS
    kAbort,        // the step was aborted (or the recv ended) before anything can land
    kClose,        // the channel closed
    kLaneLost,     // a lane the content was landing over was taken out of the channel
  };
  static constexpr int kEvents = 10;
  // Whom the request serves.
  enum class Owner : uint8_t { kRecv, kPushed, kAdopted, kDeclined };
  // Which of the channel's large-destination allowances this request holds.
  enum class LargeSlot : uint8_t { kNone, kInRequest, kGranted };

  // A null `done` makes a pushed request (deadline ignored until a recv adopts it).
  RdmaTensorRequest(ReceivingSide* side, uint32_t index, int64_t step_id, KeyRef key,
                    Allocator* allocator, absl::Time deadline, RecvDoneCallback done);

  // Sends REQUEST; on a failure before sending, ends the recv and finishes the record.
  void Start();
  void RecvTensorMetaData(const Message& m);
  void RecvTensorContent();
  // Ends the recv with `status` if it has not ended (declines a pushed request no recv took);
  // the record stays until the sender is done.
  void Fail(const absl::Status& status);
  // Pushed requests: a recv takes this one over. True when its content had already landed:
  // `done` has then been called and the record is finished. A non-null `allocator` (the
  // recv's) replaces the one the request was pushed with: a destination named from now on comes
  // from it, and so does the key's next push, which a GPU allocator stops (pushes land in host
  // memory only), so a key received into the GPU does not stay on host destinations.
  bool Adopt(RecvDoneCallback done, absl::Time deadline, Allocator* allocator);
  // Caller's memory to land in (RecvArgs::into): used by PrepareDestination when the tensor
  // matches it and the fabric can register it, and then held, as any destination, until the
  // record ends; let go of there otherwise.
  void set_into(Tensor into) { into_ = std::move(into); }
  // RecvArgs::quick_callback: `done` may run on whichever thread drives progress.
  void set_quick_callback(bool quick) { quick_callback_ = quick; }
  // RecvArgs::progress_bytes and on_landed: a destination this recv names in its own memory
  // asks for the content in segments of about `bytes`, and `on_landed` hears of each but the
  // last (RecvSegment), while the recv has not ended.
  void set_progress(uint64_t bytes, LandedCallback on_landed) {
    progress_bytes_ = bytes;
    on_landed_ = std::move(on_landed);
  }
  // Content segments still to come besides the last (whose immediate is RecvTensorContent's).
  bool awaits_more_segments() const { return segments_left_ > 1; }
  // A content immediate came over lane `lane` (RecvSegment or the last) at `now`: counted per
  // lane for a tensor spread over lanes, with when the first landed and each lane's last.
  void CountLane(size_t lane, absl::Time now);
  // A tensor spread over lanes that began to land: the first further lane that still owes it
  // segments (by the shares it asked for: StripePattern), or 0 when none does or the tensor is
  // not spread or has not begun to land. `first_at` receives when its first segment landed.
  size_t LaneOwingSegments(absl::Time* first_at) const;
  // A tensor spread over lanes, all in: the rate each lane brought its segments at (bytes after
  // its first segment over the time from the tensor's first segment to the lane's last; 0
  // where a lane brought fewer than two, or not the segments the shares gave it). For the
  // channel's shares of the next.
  // Only from a tensor whose segments landed over at least kLaneRateMinSpan.
  std::array<double, kMaxLanes> LaneRates() const;
  static constexpr absl::Duration kLaneRateMinSpan = absl::Milliseconds(4);
  // Whether the content was asked for over lane `lane` (>= 1) too, began to land, and is not
  // all in: what a lane taken out of the channel ends (ReceivingSide::EndStripedOver).
  bool LandingOver(size_t lane) const {
    return stripe_lanes_ > lane && stripes_began_ != absl::InfinitePast() && segments_left_ > 0;
  }
  // Whether the content was asked for over several lanes, and over lane `lane` among them.
  bool striped() const { return stripe_lanes_ > 1; }
  bool StripedOver(size_t lane) const { return stripe_lanes_ > lane; }
  // One content segment but the last landed.
  void RecvSegment();
  // Deregisters what was registered for this recv alone: before the record's memory goes.
  void DropRegistration() { transient_.reset(); }
  // Pushed requests: no recv will take this one.
  void Decline() {
    if (owner_ == Owner::kPushed) owner_ = Owner::kDeclined;
  }
  // Declined while it held the sender's META_DATA_RESPONSE: the sender still holds the tensor
  // and waits for RE_REQUEST. Release sends it, without a destination (the channel calls it
  // where a send that fails and closes the channel cannot pull the record from under a loop).
  bool needs_release() const { return state_ == State::kMetaParked && owner_ == Owner::kDeclined; }
  void Release();
  // The channel forgets the record on `event` (ERROR_STATUS, an abort before anything can
  // land, a close): the record moves to kDone unless it is there.
  void End(Event event);
  // Large destinations: whether this request waits in the channel's queue for a grant, and
  // the answer to it: RE_REQUEST, with a destination if the recv is still wanted (the channel
  // set large_slot() to kGranted then) or to release the sender's tensor if not.
  bool awaiting_grant() const { return state_ == State::kAwaitingGrant; }
  void Grant();
  LargeSlot large_slot() const { return large_slot_; }
  void set_large_slot(LargeSlot slot) { large_slot_ = slot; }
  Owner owner() const { return owner_; }
  // Made ahead of any recv and not taken over by one (it may have been declined).
  bool pushed_unadopted() const { return owner_ == Owner::kPushed || owner_ == Owner::kDeclined; }
  // Pushed, not adopted, and a recv could still take it.
  bool adoptable() const { return owner_ == Owner::kPushed; }
  // Pushed, not adopted, and its content is here.
  bool landed() const { return state_ == State::kLandedAhead; }
  // A pushed request no recv took yet whose content landed: hands the result over (the sender
  // is done writing it) and forgets it, so that a closing channel keeps it for its recv.
  Tensor TakeLanded();
  // The recv ended with a tensor written in place from the cached meta-data (what pushing the
  // key's next step needs).
  bool delivered_in_place() const { return delivered_in_place_; }
  const KeyRef& key_ref() const { return key_; }
  Allocator* allocator() const { return allocator_; }
  uint64_t tensor_bytes() const { return meta_.tensor_bytes; }

  uint32_t index() const { return index_; }
  int64_t step_id() const { return step_id_; }
  State state() const { return state_; }
  bool finished() const { return !done_; }  // `done` has run
  absl::Time deadline() const { return deadline_; }
  // Whether the slow-recv warning was logged for this recv (once per recv).
  bool slow_warned() const { return slow_warned_; }
  void set_slow_warned() { slow_warned_ = true; }
  const std::string& key() const { return key_->key.full_key; }
  // The memory the sender may still write into, for the channel's quarantine; memory the caller
  // gave (RecvArgs::into) stays with the record, which the channel frees after its endpoint.
  std::vector<Tensor> TakeMemory();

 private:
  // The modes act on the request's destination and result (transfer_modes.h).
  friend class ZeroCopyRequests;
  friend class CopyRequests;

  // The one place the state changes; checks in debug and sanitizer builds that the move is a
  // row of kRequestTable.
  void TransitionTo(State next, Event event);
  // Starts trace_ with `phase` open (TENSORVERBS_TRACE).
  void BeginTrace(const char* phase);
  // RE_REQUEST for meta_, on `event`: a destination if the recv is still wanted, else none.
  void SendReRequest(Event event);
  // Allocates the destination for `meta` and returns where the sender writes.
  absl::Status PrepareDestination(const TensorMetaData& meta, uint64_t* addr,
                                  fabric::RemoteKey* key);
  // After the destination for meta_ is named in `m`: asks for the content in segments where
  // the recv wants to hear of its progress, else in one piece.
  void AskForSegments(Message& m);
  // AskForSegments' two reasons: the recv wants to see its tensor land in parts (RecvArgs::
  // progress_bytes; true when it asked), or the channel has lanes and the tensor is large
  // enough to spread over them (ChannelOptions::stripe_bytes): a key per further lane.
  bool AskForProgressSegments(Message& m);
  void AskForStripes(Message& m);
  // The peer's announced size against this task's limit (TENSORVERBS_MAX_TENSOR_MB), before
  // anything is allocated for it.
  absl::Status CheckAnnouncedSize(const TensorMetaData& meta) const;
  // The landed string tensor's TensorProto, parsed.
  absl::StatusOr<Tensor> ParseStringContent() const;
  // Whether a tensor of `meta` may land in into_ (RecvArgs::into).
  bool LandsInto(const TensorMetaData& meta) const;
  // Whether the destination named is the caller's memory (into_).
  bool LandsInCallersMemory() const { return result_.SharesBufferWith(into_); }
  // Drops into_ unless it is the destination.
  void ReleaseUnusedInto();
  // Prefixes `status` with the recv's key and peer.
  absl::Status RecvError(const absl::Status& status) const;
  void Deliver(const absl::Status& status, const Tensor& tensor, bool is_dead);

  // Not const: a finished record is recycled by assignment (spare_records.h).
  ReceivingSide* side_;
  Channel* channel_;  // side_'s
  uint32_t index_;
  int64_t step_id_;
  KeyRef key_;  // shared with every other recv of the key
  Allocator* allocator_;
  absl::Time deadline_;
  RecvDoneCallback done_;
  const RequestMode* mode_;  // the channel's mode (transfer_modes.h)
  RecvTrace trace_;          // TENSORVERBS_TRACE: this recv's phases (empty when off or pushed)
  State state_ = State::kQueued;
  Owner owner_;
  LargeSlot large_slot_ = LargeSlot::kNone;
  bool slow_warned_ = false;
  bool delivered_in_place_ = false;
  TensorMetaData meta_;  // what the content will match
  uint64_t checksum_ = 0;
  uint64_t progress_bytes_ = 0;  // RecvArgs::progress_bytes
  bool quick_callback_ = false;  // RecvArgs::quick_callback
  LandedCallback on_landed_;     // RecvArgs::on_landed, until the recv ends
  uint32_t segment_bytes_ = 0;   // the segments asked for (0: one piece)
  uint64_t segments_left_ = 1;   // content immediates still to come for the destination named
  // AskForStripes: the lanes the segments go round (0: not spread), and per lane the segments
  // that came, since the first landed at stripes_began_.
  uint8_t stripe_lanes_ = 0;
  LaneShares stripe_shares_{};  // each lane's share of the segments (all zero: even)
  uint32_t lane_segments_[kMaxLanes] = {};
  absl::Time stripes_began_ = absl::InfinitePast();
  std::array<absl::Time, kMaxLanes> lane_last_{};  // CountLane, for LaneRates
  Tensor into_;                  // RecvArgs::into, until it is known not to be the destination
  Tensor result_;                // the destination, when the content lands in place
  Tensor staging_;  // registered proxy (strings, unregistrable destinations, copy mode)
  std::unique_ptr<fabric::MemoryRegion> transient_;  // per-transfer registration
};

// The table, for the diagrams and the tests.
StateTableView RequestStateTable();

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_TENSOR_REQUEST_H_
