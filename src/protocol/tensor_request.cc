#include "src/protocol/tensor_request.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/tensor.pb.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"
#include "src/protocol/channel.h"
#include "src/protocol/request_table.h"
#include "src/protocol/stripes.h"
#include "src/protocol/transfer_modes.h"
#include "src/tensor/tensor_codec.h"

namespace tensorverbs::protocol {

using request_machine::kRequestTable;

StateTableView RequestStateTable() { return kRequestTable.View(); }

RdmaTensorRequest::RdmaTensorRequest(ReceivingSide* side, uint32_t index, int64_t step_id,
                                     KeyRef key, Allocator* allocator, absl::Time deadline,
                                     RecvDoneCallback done)
    : side_(side),
      channel_(side->channel()),
      index_(index),
      step_id_(step_id),
      key_(std::move(key)),
      allocator_(allocator),
      deadline_(done == nullptr ? absl::InfiniteFuture() : deadline),
      done_(std::move(done)),
      mode_(&RequestMode::Of(channel_->env()->options.mode)),
      owner_(done_ == nullptr ? Owner::kPushed : Owner::kRecv) {
  if (owner_ == Owner::kRecv && TraceEnabled()) BeginTrace("queued");
}

void RdmaTensorRequest::BeginTrace(const char* phase) {
  trace_ =
      RecvTrace::Begin(channel_->trace_track(), key_->key.full_key, step_id_, channel_->peer_task(),
                       VerbsModeProtocol(channel_->env()->options.mode), phase);
}

void RdmaTensorRequest::TransitionTo(State next, Event event) {
  kRequestTable.Move(&state_, event, next, [&] {
    return absl::StrCat("request ", index_, " for '", key_->key.full_key, "' from task ",
                        channel_->peer_task());
  });
}

void RdmaTensorRequest::End(Event event) {
  if (state_ != State::kDone) TransitionTo(State::kDone, event);
}

void RdmaTensorRequest::Start() {
  ChannelEnv* env = channel_->env();
  Message m;
  m.type = MessageType::kTensorRequest;
  m.step_id = step_id_;
  m.request_index = index_;
  absl::StatusOr<const char*> next_phase = mode_->Ask(*this, m);
  if (!next_phase.ok()) {
    // The destination REQUEST would name cannot be made: the recv fails before anything is sent.
    Fail(next_phase.status());
    TransitionTo(State::kDone, Event::kStart);
    side_->FinishRequest(index_, Event::kStart);  // freed at the end of the turn
    return;
  }
  // Named last, once nothing can stop the REQUEST from going out: a key's first REQUEST on the
  // channel defines its index, and the peer must see every index it is later asked by.
  side_->NameKey(key_, &m);
  TransitionTo(State::kRequested, Event::kStart);
  env->stats->requests.fetch_add(1, std::memory_order_relaxed);
  channel_->counters().requests.fetch_add(1, std::memory_order_relaxed);
  trace_.Phase(*next_phase);
  channel_->SendMessage(std::move(m));
}

absl::Status RdmaTensorRequest::CheckAnnouncedSize(const TensorMetaData& meta) const {
  const uint64_t max_bytes = channel_->env()->max_tensor_bytes();
  absl::Status s = CheckReceivedTensorBytes(meta.tensor_bytes, max_bytes);
  if (s.ok() && meta.dtype == DataType::kString) {
    // The string objects are allocated beside the encoded bytes, and the encoding is parsed
    // as one protobuf message, which cannot reach 2 GiB.
    absl::StatusOr<uint64_t> objects = Tensor::AllocationBytes(meta.dtype, meta.shape);
    s = objects.ok() ? CheckReceivedTensorBytes(*objects, max_bytes) : objects.status();
    if (s.ok() && meta.tensor_bytes > static_cast<uint64_t>(INT_MAX)) {
      s = absl::DataLossError(absl::StrCat("a string tensor encoded in ", meta.tensor_bytes,
                                           " bytes: its encoding must stay under 2 GiB"));
    }
  }
  return s.ok() ? s : RecvError(s);
}

absl::Status RdmaTensorRequest::PrepareDestination(const TensorMetaData& meta, uint64_t* addr,
                                                   fabric::RemoteKey* key) {
  ChannelEnv* env = channel_->env();
  RETURN_IF_ERROR(CheckAnnouncedSize(meta));
  // The registration goes before the memory it covers (the caller's memory goes back with it).
  transient_.reset();
  result_.Clear();
  staging_.Clear();
  const fabric::MemoryRegion* region = nullptr;
  void* target = nullptr;
  const MemoryPlacement where = allocator_->Placement();
  if (!where.host_accessible()) {
    // Only a recv the transport said lands on the device comes here with a GPU allocator.
    if (meta.dtype == DataType::kString) {
      return RecvError(absl::InvalidArgumentError(absl::StrCat(
          "a string tensor cannot land in ", where.ToString(),
          " memory: strings live in host memory only; receive it with a host allocator")));
    }
    if (env->options.registration == Registration::kCopy) {
      return RecvError(absl::FailedPreconditionError(
          absl::StrCat("copy registration cannot land tensors in ", where.ToString(), " memory")));
    }
  }
  if (LandsInto(meta)) {
    // The caller's memory: a pool region's registration if it is one, else one for this write.
    absl::StatusOr<const fabric::MemoryRegion*> pooled =
        env->memory->FindRegistered(into_.data(), meta.tensor_bytes);
    if (pooled.ok() && *pooled != nullptr) {
      region = *pooled;
    } else if (absl::StatusOr<std::unique_ptr<fabric::MemoryRegion>> mr =
                   env->memory->RegisterTransient(into_.data(), meta.tensor_bytes);
               mr.ok()) {
      transient_ = *std::move(mr);
      env->stats->transient_registrations.fetch_add(1, std::memory_order_relaxed);
      region = transient_.get();
    }
    // A fabric that refuses it: the recv lands as it would without `into`.
    if (region != nullptr) {
      result_ = into_;
      target = result_.data();
    }
  }
  ReleaseUnusedInto();
  if (target == nullptr && meta.dtype != DataType::kString &&
      env->options.registration != Registration::kCopy) {
    // Out of memory names the recv: the allocator knows only sizes.
    absl::StatusOr<Tensor> result = Tensor::Allocate(allocator_, meta.dtype, meta.shape);
    if (!result.ok()) return RecvError(result.status());
    result_ = *std::move(result);
    ASSIGN_OR_RETURN(region, env->TransferRegion(result_.data(), meta.tensor_bytes, &transient_));
    if (region != nullptr) target = result_.data();
    if (region == nullptr && !where.host_accessible() && meta.tensor_bytes > 0) {
      // No proxy here: its bytes could not be copied into GPU memory on this thread.
      return RecvError(absl::FailedPreconditionError(
          absl::StrCat("the fabric cannot write into this ", where.ToString(), " memory (",
                       allocator_->Name(), " is not a pool the transport registers)")));
    }
  }
  if (target == nullptr) {
    // Strings, copy mode, or a destination the fabric cannot reach: a registered proxy.
    absl::StatusOr<Tensor> staging = env->memory->AllocateStaging(meta.tensor_bytes, &region);
    if (!staging.ok()) return RecvError(staging.status());
    staging_ = *std::move(staging);
    target = staging_.data();
    channel_->counters().proxies.fetch_add(1, std::memory_order_relaxed);
  }
  ASSIGN_OR_RETURN(*key, channel_->OfferKey(*region));
  *addr = reinterpret_cast<uint64_t>(target);
  return absl::OkStatus();
}

void RdmaTensorRequest::AskForSegments(Message& m) {
  segment_bytes_ = 0;
  segments_left_ = 1;
  stripe_lanes_ = 0;
  stripe_shares_ = {};
  if (!AskForProgressSegments(m)) AskForStripes(m);
}

bool RdmaTensorRequest::AskForProgressSegments(Message& m) {
  ChannelEnv* env = channel_->env();
  // Only the recv's own destination, whole and in place: a proxy is copied out at the end, a
  // checksum checks the bytes only once all are in, and the caller's memory is not `landing`.
  if (!on_landed_ || finished() || progress_bytes_ == 0 || m.remote_addr == 0 ||
      !result_.IsInitialized() || staging_.IsInitialized() || LandsInCallersMemory() ||
      env->options.data_validation || meta_.dtype == DataType::kString) {
    return false;
  }
  const uint64_t kMaxSegment = uint64_t{1} << 31;
  // No more than kMaxContentSegments, which the sender refuses.
  const uint64_t fewest = (meta_.tensor_bytes + kMaxContentSegments - 1) / kMaxContentSegments;
  const auto segment = static_cast<uint32_t>(
      std::clamp<uint64_t>(std::max(progress_bytes_, fewest), kMinSegmentBytes, kMaxSegment));
  if (meta_.tensor_bytes <= segment) return false;
  segment_bytes_ = segment;
  segments_left_ = ContentSegments(meta_.tensor_bytes, segment_bytes_);
  m.segment_bytes = segment_bytes_;
  return true;
}

void RdmaTensorRequest::AskForStripes(Message& m) {
  const size_t lanes = channel_->striping_lanes();  // those whose probe came back
  const uint64_t threshold = channel_->env()->options.stripe_bytes;
  const uint64_t bytes = meta_.tensor_bytes;
  // A recv told of its progress (on_landed_) takes its segments as landed prefixes, in order,
  // which segments over several lanes are not. The caller's memory (RecvArgs::into) goes back
  // to the caller when the recv ends, which a lane that fails under it would make early, while
  // the other lanes may still write there (EndStripedOver quarantines pool memory only).
  if (lanes < 2 || threshold == 0 || bytes < threshold || m.remote_addr == 0 || finished() ||
      meta_.dtype == DataType::kString || on_landed_ || LandsInCallersMemory()) {
    return;
  }
  // The destination must be memory every lane registered (the pool): a proxy or a transient
  // registration is lane 0's alone, and such a tensor keeps to lane 0.
  const void* target = reinterpret_cast<const void*>(m.remote_addr);
  absl::InlinedVector<fabric::RemoteKey, kMaxLanes - 1> keys;
  for (size_t lane = 1; lane < lanes; ++lane) {
    absl::StatusOr<fabric::RemoteKey> key = channel_->OfferLaneKey(lane, target, bytes);
    if (!key.ok() || key->size() != m.remote_key.size()) return;
    keys.push_back(*std::move(key));
  }
  // Each lane's share follows its measured rate; a round of the pattern, or (even) four
  // segments a lane, so that a lane that finishes its share early is not left idle for long,
  // of whole 64 KiB units and at least the minimum.
  const LaneShares shares = channel_->StripeShares(lanes);
  const StripePattern pattern(lanes, shares);
  const uint64_t rounds = (lanes * 4 + pattern.period() - 1) / pattern.period();
  const uint64_t kUnit = 64 << 10;
  const uint64_t wanted = (bytes / (pattern.period() * rounds) + kUnit - 1) / kUnit * kUnit;
  const uint64_t fewest = (bytes + kMaxContentSegments - 1) / kMaxContentSegments;
  const auto segment = static_cast<uint32_t>(
      std::clamp<uint64_t>(std::max(wanted, fewest), kMinSegmentBytes, uint64_t{1} << 31));
  if (bytes <= segment) return;
  segment_bytes_ = segment;
  segments_left_ = ContentSegments(bytes, segment);
  m.segment_bytes = segment;
  m.lane_keys = std::move(keys);
  m.lane_shares = shares;
  stripe_lanes_ = static_cast<uint8_t>(lanes);
  stripe_shares_ = shares;
  std::fill(std::begin(lane_segments_), std::end(lane_segments_), 0);
  stripes_began_ = absl::InfinitePast();
  channel_->env()->stats->striped_requests.fetch_add(1, std::memory_order_relaxed);
}

void RdmaTensorRequest::CountLane(size_t lane, absl::Time now) {
  if (stripe_lanes_ < 2 || lane >= kMaxLanes) return;
  if (stripes_began_ == absl::InfinitePast()) stripes_began_ = now;
  ++lane_segments_[lane];
  lane_last_[lane] = now;
}

std::array<double, kMaxLanes> RdmaTensorRequest::LaneRates() const {
  std::array<double, kMaxLanes> rates{};
  if (stripe_lanes_ < 2 || segments_left_ > 1) return rates;
  const uint64_t segments = ContentSegments(meta_.tensor_bytes, segment_bytes_);
  const StripePattern pattern(stripe_lanes_, stripe_shares_);
  const size_t last_lane = pattern.LaneOf(segments - 1);
  // The immediates in flight with this one count: the last is being taken now.
  for (size_t lane = 0; lane < stripe_lanes_; ++lane) {
    const uint64_t due = pattern.Due(lane, segments);
    // A sender that kept the tensor to lane 0 (it could not reach the source from every lane)
    // brought other counts: nothing to learn of the lanes' rates.
    if (lane_segments_[lane] != due) return std::array<double, kMaxLanes>{};
  }
  // A tensor that landed within a few milliseconds says more of how the receiver took its
  // completions (a progress thread off its core sees a lane's segments in one batch, as if
  // they took no time) than of the lanes: only longer ones teach.
  absl::Time last = stripes_began_;
  for (size_t lane = 0; lane < stripe_lanes_; ++lane) last = std::max(last, lane_last_[lane]);
  if (last - stripes_began_ < kLaneRateMinSpan) return rates;
  for (size_t lane = 0; lane < stripe_lanes_; ++lane) {
    const uint64_t due = pattern.Due(lane, segments);
    // From the tensor's first segment over any lane, not the lane's own first: a receiver
    // that takes completions in batches (a thread that was off its core) sees a lane's
    // segments at nearly one time, which would make its rate look boundless, while over the
    // whole tensor such a gap counts little.
    const absl::Duration took = lane_last_[lane] - stripes_began_;
    if (due < 2 || took <= absl::ZeroDuration()) continue;
    // The lanes' first segments land at about the same time, each whole: what came after
    // them came at the lane's rate, the tensor's short last segment counted at its length.
    uint64_t after_first = (due - 1) * uint64_t{segment_bytes_};
    if (lane == last_lane) after_first -= segments * uint64_t{segment_bytes_} - meta_.tensor_bytes;
    rates[lane] = static_cast<double>(after_first) / absl::ToDoubleSeconds(took);
  }
  return rates;
}

size_t RdmaTensorRequest::LaneOwingSegments(absl::Time* first_at) const {
  if (stripe_lanes_ < 2 || stripes_began_ == absl::InfinitePast() || segments_left_ == 0) {
    return 0;
  }
  const uint64_t segments = ContentSegments(meta_.tensor_bytes, segment_bytes_);
  const StripePattern pattern(stripe_lanes_, stripe_shares_);
  // A sender that could not reach the source from every lane sends it all over lane 0: then
  // no further lane owes anything.
  if (lane_segments_[0] > pattern.Due(0, segments)) return 0;
  for (size_t lane = 1; lane < stripe_lanes_; ++lane) {
    if (lane_segments_[lane] < pattern.Due(lane, segments)) {
      *first_at = stripes_began_;
      return lane;
    }
  }
  return 0;
}

void RdmaTensorRequest::RecvSegment() {
  DCHECK(segments_left_ > 1);
  --segments_left_;
  const uint64_t landed =
      (ContentSegments(meta_.tensor_bytes, segment_bytes_) - segments_left_) * segment_bytes_;
  channel_->env()->stats->content_segments.fetch_add(1, std::memory_order_relaxed);
  // An ended recv still counts the sender's immediates, so that the last one ends the record.
  if (finished() || !on_landed_) return;
  on_landed_(result_, landed);
}

bool RdmaTensorRequest::LandsInto(const TensorMetaData& meta) const {
  // (ReceivingSide::StartRecv gives no `into` to a request of the same-host fabric.)
  return into_.IsInitialized() && meta.tensor_bytes > 0 && !meta.is_dead &&
         meta.dtype == into_.dtype() && meta.shape == into_.shape() &&
         into_.placement().host_accessible() &&
         channel_->env()->options.registration != Registration::kCopy;
}

void RdmaTensorRequest::ReleaseUnusedInto() {
  // Memory the recv does not land in goes back to the caller at once: its release is how the
  // caller learns that nothing writes there.
  if (!LandsInCallersMemory()) into_.Clear();
}

void RdmaTensorRequest::RecvTensorMetaData(const Message& m) {
  if (state_ != State::kRequested) {
    channel_->Close(absl::DataLossError(
        absl::StrCat("META_DATA_RESPONSE for request ", index_, " that is not waiting for one")));
    return;  // the close ended this request
  }
  if (absl::Status s = mode_->Answered(*this, m); !s.ok()) {
    channel_->Close(s);
    return;  // the close ended this request
  }
  meta_ = m.meta;
  checksum_ = m.checksum;
  if (adoptable()) {
    // Pushed, and no recv has taken it yet: the sender holds the tensor for it, so it waits
    // here for the recv (Adopt) or for its step to end (Release), whichever comes first.
    TransitionTo(State::kMetaParked, Event::kMetaData);
    return;
  }
  if (mode_->TakesGrants() && !finished() && !meta_.is_dead &&
      !side_->GrantLargeDestination(*this)) {
    trace_.Phase("awaiting a large-destination grant");
    // The channel calls Grant when an earlier large recv has landed.
    TransitionTo(State::kAwaitingGrant, Event::kMetaData);
    return;
  }
  SendReRequest(Event::kMetaData);
}

void RdmaTensorRequest::Grant() {
  DCHECK(state_ == State::kAwaitingGrant);
  SendReRequest(Event::kGrant);
}

void RdmaTensorRequest::SendReRequest(Event event) {
  ChannelEnv* env = channel_->env();
  Message rr;
  rr.type = MessageType::kTensorReRequest;
  rr.step_id = step_id_;
  rr.request_index = index_;
  rr.meta = meta_;
  // A recv that already ended (abort, timeout) or cannot allocate still answers, with no
  // target: the sender then writes nothing but the immediate, and releases its tensor.
  if (!finished()) {
    if (absl::Status s = mode_->NameDestination(*this, rr); !s.ok()) Fail(s);
  }
  AskForSegments(rr);
  TransitionTo(State::kReRequested, event);
  env->stats->re_requests.fetch_add(1, std::memory_order_relaxed);
  channel_->counters().re_requests.fetch_add(1, std::memory_order_relaxed);
  trace_.Phase("awaiting content");
  channel_->SendMessage(std::move(rr));  // a failure closes the channel, which ends this
}

void RdmaTensorRequest::Release() {
  DCHECK(needs_release());
  SendReRequest(Event::kRelease);
}

absl::Status RdmaTensorRequest::RecvError(const absl::Status& status) const {
  return absl::Status(status.code(), absl::StrCat("recv of '", key_->key.full_key, "' from task ",
                                                  channel_->peer_task(), ": ", status.message()));
}

absl::StatusOr<Tensor> RdmaTensorRequest::ParseStringContent() const {
  // The encoding is the sender's word too: its elements are counted against the announced
  // shape (whose size the limit admitted) before parsing builds them.
  const absl::string_view encoded(static_cast<const char*>(staging_.data()),
                                  static_cast<size_t>(meta_.tensor_bytes));
  absl::StatusOr<EncodedTensorCounts> counts = CountEncodedTensor(encoded);
  if (counts.ok() && counts->strings != meta_.shape.num_elements()) {
    counts = absl::DataLossError(absl::StrCat("the string tensor carries ", counts->strings,
                                              " strings where its meta-data announced ",
                                              meta_.shape.DebugString()));
  }
  if (!counts.ok()) return RecvError(counts.status());
  absl::StatusOr<Tensor> t = TensorFromEncodedProto(encoded, *counts, allocator_);
  if (t.ok() && t->shape() != meta_.shape) {
    t = absl::DataLossError(absl::StrCat("the string tensor is ", t->shape().DebugString(),
                                         " where its meta-data announced ",
                                         meta_.shape.DebugString()));
  }
  return t.ok() ? t : RecvError(t.status());
}

void RdmaTensorRequest::RecvTensorContent() {
  // A pushed request no recv took keeps what landed for its recv: it moves to kLandedAhead once
  // its result is ready. One whose content cannot be kept (dead, a string, a failed check) is
  // declined on delivery (Deliver), and its record ends from kRequested as any other.
  const bool ahead = adoptable();
  if (!ahead) TransitionTo(State::kDone, Event::kContent);
  trace_.Phase("landed");
  if (finished() && !ahead) return;
  if (!mode_->Land(*this)) return;  // the mode delivered the outcome itself
  if (ahead) {
    TransitionTo(State::kLandedAhead, Event::kContent);
    return;  // result_ waits for the recv that takes this request
  }
  delivered_in_place_ = true;
  Tensor result = std::move(result_);
  Deliver(absl::OkStatus(), result, false);
}

bool RdmaTensorRequest::Adopt(RecvDoneCallback done, absl::Time deadline, Allocator* allocator) {
  DCHECK(adoptable()) << "request " << index_ << " for '" << key() << "' cannot be adopted";
  owner_ = Owner::kAdopted;
  if (allocator != nullptr) allocator_ = allocator;
  done_ = std::move(done);
  deadline_ = deadline;
  if (TraceEnabled()) {
    // Asked for ahead of this recv: the trace starts where the recv found the request.
    BeginTrace(state_ == State::kLandedAhead  ? "landed"
               : state_ == State::kMetaParked ? "awaiting meta-data"
                                              : "awaiting content");
  }
  if (state_ == State::kMetaParked) {
    // The sender described another tensor than the cached meta-data: now that a recv owns
    // this request, it names a destination for it (last: the send may close the channel).
    SendReRequest(Event::kAdopt);
    return false;
  }
  if (state_ != State::kLandedAhead) return false;
  TransitionTo(State::kDone, Event::kAdopt);
  delivered_in_place_ = true;
  Tensor result = std::move(result_);
  Deliver(absl::OkStatus(), result, false);
  return true;
}

Tensor RdmaTensorRequest::TakeLanded() {
  DCHECK(state_ == State::kLandedAhead);
  TransitionTo(State::kDone, Event::kClose);
  owner_ = Owner::kDeclined;
  return std::move(result_);
}

void RdmaTensorRequest::Fail(const absl::Status& status) {
  ReleaseUnusedInto();
  if (finished()) {
    Decline();
    return;
  }
  Deliver(status, Tensor(), false);
}

void RdmaTensorRequest::Deliver(const absl::Status& status, const Tensor& tensor, bool is_dead) {
  if (done_ == nullptr) {
    // A pushed request no recv took ends here (a dead or string tensor, a bad destination):
    // nobody to tell, and nothing kept for a recv.
    Decline();
    return;
  }
  RecvDoneCallback done = std::move(done_);
  done_ = nullptr;
  on_landed_ = nullptr;  // nothing more is told once the recv ended
  if (trace_.active()) {
    // The last phase waits for the callback executor and runs the callback; the trace ends
    // when it returns.
    trace_.Phase(status.ok() ? "callback" : "failing");
    done = EndTraceAfter(std::move(trace_), std::move(done));
  }
  channel_->env()->CountRecv(status, tensor);
  channel_->counters().CountRecv(status, tensor);
  channel_->env()->host->Deliver({std::move(done), status, tensor, is_dead, quick_callback_});
}

std::vector<Tensor> RdmaTensorRequest::TakeMemory() {
  std::vector<Tensor> memory;
  // The caller's memory stays with the record, which goes after the endpoint: only the
  // same-host fabric, which never writes it, lets a peer write once the endpoint is gone.
  if (result_.IsInitialized() && !LandsInCallersMemory()) memory.push_back(std::move(result_));
  if (staging_.IsInitialized()) memory.push_back(std::move(staging_));
  result_.Clear();
  staging_.Clear();
  return memory;
}

}  // namespace tensorverbs::protocol
