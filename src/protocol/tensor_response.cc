#include "src/protocol/tensor_response.h"

#include <iterator>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/tensor.pb.h"
#include "src/common/logging.h"
#include "src/common/status_macros.h"
#include "src/protocol/channel.h"
#include "src/protocol/channel_table.h"
#include "src/protocol/local_tensor_inbox.h"
#include "src/protocol/sending_side.h"
#include "src/protocol/transfer_modes.h"
#include "src/tensor/tensor_codec.h"

namespace tensorverbs::protocol {
// A namespace of its own: the unity build compiles this file with the other machines'.
namespace response_machine {

using State = RdmaTensorResponse::State;
using Event = RdmaTensorResponse::Event;

constexpr const char* kStateNames[] = {"waiting for the tensor", "waiting for RE_REQUEST",
                                       "writing", "done"};
constexpr const char* kEventNames[] = {"Tensor",    "ReRequest",    "Expire", "Staged",
                                       "WriteDone", "WriteRefused", "Cancel"};
static_assert(std::size(kStateNames) == RdmaTensorResponse::kStates);
static_assert(std::size(kEventNames) == RdmaTensorResponse::kEvents);

// The response's machine, row by row (state_table.h).
constexpr StateRow<State, Event> kResponseRows[] = {
    {State::kWaitTensor, Event::kTensor, "the request named a destination the tensor fits",
     State::kWriting, "write the content"},
    {State::kWaitTensor, Event::kTensor, "none came, or it cannot be sent", State::kDone,
     "ERROR_STATUS"},
    {State::kWaitTensor, Event::kTensor, "", State::kWaitReRequest, "META_DATA_RESPONSE"},
    {State::kWaitTensor, Event::kCancel, "", State::kDone, "stop waiting for the tensor"},
    {State::kWaitReRequest, Event::kReRequest, "", State::kWriting,
     "write the content (the immediate alone when no destination is named)"},
    {State::kWaitReRequest, Event::kExpire, "", State::kDone, "ERROR_STATUS"},
    {State::kWaitReRequest, Event::kStaged, "a part failed to stage", State::kDone, "ERROR_STATUS"},
    {State::kWaitReRequest, Event::kCancel, "", State::kDone, "let go of the tensor"},
    {State::kWriting, Event::kStaged, "a part failed to stage, and no write is in flight",
     State::kDone, "ERROR_STATUS"},
    {State::kWriting, Event::kWriteDone, "the last write", State::kDone,
     "count the tensor sent (ERROR_STATUS when a part failed to stage or a write over a "
     "lane failed)"},
    {State::kWriting, Event::kWriteRefused,
     "the destination or its segments cannot be written, a part failed to stage, or a lane "
     "went with no write in flight",
     State::kDone, "ERROR_STATUS"},
    {State::kWriting, Event::kCancel, "", State::kDone, "let go of the tensor"},
};

constexpr StateTable kResponseTable("RdmaTensorResponse", kStateNames, kEventNames,
                                    State::kWaitTensor, kResponseRows);

}  // namespace response_machine

using response_machine::kResponseTable;

StateTableView ResponseStateTable() { return kResponseTable.View(); }

RdmaTensorResponse::RdmaTensorResponse(SendingSide* side, uint64_t serial, Message request)
    : side_(side),
      channel_(side->channel()),
      serial_(serial),
      request_(std::move(request)),
      mode_(&ResponseMode::Of(channel_->env()->options.mode)) {}

const std::string& RdmaTensorResponse::name() const {
  static const std::string kUnresolved = "?";
  return key_ != nullptr ? key_->key.full_key : kUnresolved;
}

void RdmaTensorResponse::TransitionTo(State next, Event event) {
  kResponseTable.Move(&state_, event, next, [&] {
    return absl::StrCat("response to request ", request_.request_index, " for '", name(),
                        "' of task ", channel_->peer_task());
  });
}

void RdmaTensorResponse::Start(std::shared_ptr<RemoteRendezvous> rendezvous, KeyRef key) {
  rendezvous_ = std::move(rendezvous);
  key_ = std::move(key);
  ChannelEnv* env = channel_->env();
  // A device tensor comes as it is where the fabric writes from it or it is staged in chunks.
  token_ = rendezvous_->RecvLocalAsync(
      key_, env->local_tensors->Open(channel_->id(), request_.request_index, serial_),
      /*keep_device=*/env->device_direct || StagesInChunks());
}

void RdmaTensorResponse::Cancel() {
  if (state_ == State::kWaitTensor && rendezvous_ != nullptr && token_ != 0) {
    rendezvous_->CancelLocalRecv(token_, absl::CancelledError("channel closed"));
  }
  if (state_ != State::kDone) TransitionTo(State::kDone, Event::kCancel);
}

void RdmaTensorResponse::GiveUpInFlightMemory(std::vector<Tensor>* memory) {
  if (writes_left_ <= 0) return;
  if (tensor_.IsInitialized()) memory->push_back(std::move(tensor_));
  if (staging_.IsInitialized()) memory->push_back(std::move(staging_));
}

absl::Status RdmaTensorResponse::PrepareSource(const Tensor& tensor) {
  ChannelEnv* env = channel_->env();
  if (meta_.is_dead) return absl::OkStatus();
  if (tensor.dtype() == DataType::kString) {
    // Its TensorProto travels from registered staging.
    proto::TensorProto tp;
    TensorToProto(tensor, &tp);
    meta_.tensor_bytes = tp.ByteSizeLong();
    ASSIGN_OR_RETURN(staging_, env->memory->AllocateStaging(meta_.tensor_bytes, &source_region_));
    if (!tp.SerializeToArray(staging_.data(), static_cast<int>(meta_.tensor_bytes))) {
      return absl::InternalError("serializing the string tensor failed");
    }
    source_ = staging_.data();
    return absl::OkStatus();
  }
  if (meta_.tensor_bytes == 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(source_region_,
                   env->TransferRegion(tensor.data(), meta_.tensor_bytes, &transient_));
  if (chunked_ && source_region_ == nullptr) {
    // Its chunks are still being copied in: a copy of it now would send what is not there yet.
    return absl::InternalError("the tensor staged in chunks is outside the registered pool");
  }
  const bool on_device = !tensor.placement().host_accessible();
  if (source_region_ != nullptr) {
    source_ = tensor.data();
    if (on_device && env->worker != nullptr && env->worker->stats != nullptr) {
      env->worker->stats->device_direct_sends.fetch_add(1, std::memory_order_relaxed);
    }
    return absl::OkStatus();
  }
  if (!on_device && env->options.registration == Registration::kPool &&
      meta_.tensor_bytes >= kRegisterSourcesFrom) {
    // Memory outside the pool, large enough that registering it for this write is cheaper than
    // staging a copy. A fabric that refuses it still gets the copy below.
    absl::StatusOr<std::unique_ptr<fabric::MemoryRegion>> mr =
        env->memory->RegisterSource(tensor.data(), meta_.tensor_bytes);
    if (mr.ok()) {
      transient_ = *std::move(mr);
      env->stats->transient_registrations.fetch_add(1, std::memory_order_relaxed);
      source_region_ = transient_.get();
      source_ = tensor.data();
      return absl::OkStatus();
    }
  }
  if (on_device) {
    return absl::FailedPreconditionError(
        absl::StrCat("the tensor is in ", tensor.placement().ToString(),
                     " memory that the fabric cannot reach and that was not staged"));
  }
  // Copy registration, or a tensor outside the registered pool: stage it.
  ASSIGN_OR_RETURN(staging_,
                   env->memory->StageCopyOf(tensor.data(), meta_.tensor_bytes, &source_region_));
  env->CountCopy(meta_.tensor_bytes);
  source_ = staging_.data();
  return absl::OkStatus();
}

bool RdmaTensorResponse::StagesInChunks() const {
  const ChannelEnv* env = channel_->env();
  // Zero copy only: copy mode lays the tensor out in a buffer of its own, and a checksum needs
  // every byte before META_DATA_RESPONSE.
  // Pool registration only: the staging tensor is then registered already, so the writes
  // read it where the copies land; a staged copy of it would take whatever is there yet.
  return env->worker != nullptr && env->worker->device_copier != nullptr &&
         env->worker->proxy_chunk_bytes > 0 && mode_->SendsFromWhereItLies() &&
         !env->options.data_validation && env->options.registration == Registration::kPool;
}

RemoteRendezvous::StagedCallback RdmaTensorResponse::TellStaged() const {
  ChannelEnv* env = channel_->env();
  // From the copier's thread to the progress thread, where the response is (if it still is).
  return [env, channel_id = channel_->id(), serial = serial_, index = request_.request_index](
             const absl::Status& status, uint64_t staged_bytes) {
    env->host->Post([env, channel_id, serial, index, status, staged_bytes] {
      if (SendingSide* side = env->channels->FindSending(channel_id)) {
        side->OnStaged(serial, index, status, staged_bytes);
      }
    });
  };
}

bool RdmaTensorResponse::OnStaged(const absl::Status& status, uint64_t staged_bytes) {
  if (!chunked_ || state_ == State::kDone) return false;
  if (!status.ok()) {
    // Writing nothing (the receiver gave up and only the release goes) or all of it already:
    // the failure changes nothing any more.
    if (state_ == State::kWriting && (meta_.tensor_bytes == 0 || posted_ >= meta_.tensor_bytes)) {
      return false;
    }
    staging_error_ = status;
    if (state_ == State::kWriting && writes_left_ > 0) return false;  // OnWriteDone answers
    // Parts that went over several lanes may be behind the ERROR_STATUS: the receiver of a
    // tensor spread over lanes quarantines its destination when it hears.
    SendError(status, Event::kStaged);  // finishes the response
    return false;
  }
  staged_bytes_ = std::max(staged_bytes_, staged_bytes);
  if (state_ == State::kWriting) PostStagedWrites();
  return false;
}

bool RdmaTensorResponse::CanWriteNow() const {
  // The checksum rides META_DATA_RESPONSE.
  return !channel_->env()->options.data_validation && mode_->Fits(*this);
}

void RdmaTensorResponse::Resume(const absl::Status& status, const Tensor& tensor, bool is_dead) {
  ChannelEnv* env = channel_->env();
  if (state_ != State::kWaitTensor) return;
  if (!status.ok()) {
    SendError(status, Event::kTensor);
    return;
  }
  if (!is_dead && !tensor.placement().host_accessible() && tensor.TotalBytes() > 0 && !restaged_) {
    // A device tensor kept as it is (ChannelEnv::device_direct): written from GPU memory when it
    // lies in a device pool the fabric registers, else staged to host after all, once.
    absl::StatusOr<const fabric::MemoryRegion*> region =
        env->device_direct && mode_->SendsFromWhereItLies()
            ? env->memory->FindRegistered(tensor.data(), tensor.TotalBytes())
            : nullptr;
    if (region.ok() && *region == nullptr) {
      restaged_ = true;
      const uint64_t chunk = env->worker != nullptr ? env->worker->proxy_chunk_bytes : 0;
      if (!StagesInChunks() || tensor.TotalBytes() <= chunk) {
        rendezvous_->StageToHostAsync(
            name(), tensor,
            env->local_tensors->Open(channel_->id(), request_.request_index, serial_));
        return;
      }
      // The response goes on with the staging tensor; its parts are written as they get there.
      absl::StatusOr<Tensor> staged =
          rendezvous_->StageToHostInChunks(name(), tensor, chunk, TellStaged());
      if (!staged.ok()) {
        SendError(staged.status(), Event::kTensor);
        return;
      }
      chunked_ = true;
      staged_bytes_ = 0;
      Resume(absl::OkStatus(), *staged, false);
      return;
    }
  }
  tensor_ = tensor;
  if (absl::Status prepared = mode_->Prepare(*this, tensor, is_dead); !prepared.ok()) {
    SendError(absl::Status(prepared.code(), absl::StrCat("the sender cannot transfer the tensor: ",
                                                         prepared.message())),
              Event::kTensor);
    return;
  }
  if (CanWriteNow()) {
    WriteContent(request_.remote_addr, request_.remote_key, request_.segment_bytes,
                 request_.lane_keys, request_.lane_shares, Event::kTensor);
    return;
  }
  SendMetaData();
}

Message RdmaTensorResponse::Answer(MessageType type) const {
  Message m;
  m.type = type;
  m.step_id = request_.step_id;
  m.request_index = request_.request_index;
  return m;
}

void RdmaTensorResponse::SendMetaData() {
  ChannelEnv* env = channel_->env();
  Message m = Answer(MessageType::kMetaDataResponse);
  m.meta = meta_;
  if (env->options.data_validation) m.checksum = ContentChecksum(source_, meta_.tensor_bytes);
  TransitionTo(State::kWaitReRequest, Event::kTensor);
  meta_sent_at_ = absl::Now();
  env->stats->meta_responses.fetch_add(1, std::memory_order_relaxed);
  channel_->counters().meta_responses.fetch_add(1, std::memory_order_relaxed);
  channel_->SendMessage(std::move(m));
}

void RdmaTensorResponse::RecvReRequest(const Message& m) {
  if (state_ != State::kWaitReRequest) {
    channel_->Close(absl::DataLossError(
        absl::StrCat("RE_REQUEST for request ", m.request_index, " that is not waiting for one")));
    return;  // the close ended this response
  }
  if (m.remote_addr == 0 && meta_.tensor_bytes > 0 && !meta_.is_dead) {
    // The receiver gave up on this recv (or could not allocate): nothing to write but the
    // release, which the immediate alone carries.
    meta_.tensor_bytes = 0;
  }
  WriteContent(m.remote_addr, m.remote_key, m.segment_bytes, m.lane_keys, m.lane_shares,
               Event::kReRequest);
}

uint64_t RdmaTensorResponse::ContentContext() const {
  return MakeContext(OpTag::kContent,
                     (serial_ & kContentSerialMask) << 32 | uint64_t{request_.request_index});
}

void RdmaTensorResponse::ChooseLanes(absl::Span<const fabric::RemoteKey> lane_keys,
                                     const LaneShares& shares) {
  lanes_.clear();
  stripes_ = StripePattern(1, LaneShares{});
  lanes_.push_back({channel_->endpoint(), source_region_, write_key_});
  // Every further lane must reach the source too (pool memory each lane registered, or a source
  // each registers for this write as lane 0 did); else the tensor keeps to lane 0, still in the
  // receiver's segments.
  const size_t lanes = std::min(channel_->lanes(), lane_keys.size() + 1);
  if (lanes < 2 || write_segment_ == 0) return;
  lane_transients_.clear();
  for (size_t lane = 1; lane < lanes; ++lane) {
    const fabric::MemoryRegion* region = channel_->LaneRegion(lane, source_, meta_.tensor_bytes);
    if (region == nullptr && transient_ != nullptr) {
      // Lane 0 registered the source for this write (memory outside the pool): so does each
      // further lane.
      absl::StatusOr<std::unique_ptr<fabric::MemoryRegion>> mr =
          channel_->RegisterLaneSource(lane, source_, meta_.tensor_bytes);
      if (mr.ok()) {
        region = mr->get();
        lane_transients_.push_back(*std::move(mr));
        channel_->env()->stats->transient_registrations.fetch_add(1, std::memory_order_relaxed);
      }
    }
    fabric::Endpoint* ep = channel_->lane_endpoint(lane);
    if (region == nullptr || ep == nullptr) {
      lanes_.resize(1);
      return;
    }
    lanes_.push_back({ep, region, lane_keys[lane - 1]});
  }
  // Every lane the receiver asked for serves: its shares are what it counts on each.
  stripes_ =
      StripePattern(lanes_.size(), lanes_.size() == lane_keys.size() + 1 ? shares : LaneShares{});
}

void RdmaTensorResponse::WriteContent(uint64_t addr, const fabric::RemoteKey& key,
                                      uint32_t segment_bytes,
                                      absl::Span<const fabric::RemoteKey> lane_keys,
                                      const LaneShares& shares, Event event) {
  MessageBuffer* mb = channel_->message_buffer();
  fabric::Endpoint* ep = channel_->endpoint();
  TransitionTo(State::kWriting, event);
  if (meta_.is_dead || meta_.tensor_bytes == 0) {
    const uint64_t context = ContentContext();
    writes_left_ = 1;
    absl::Status s = ep->PostWriteWithImm(mb->EmptyLocalSource(), mb->EmptyRemoteTarget(),
                                          request_.request_index, context);
    if (!s.ok()) {
      channel_->Close(absl::UnavailableError(absl::StrCat(
          "content write to task ", channel_->peer_task(), " failed midway: ", s.message())));
    }
    return;
  }
  write_addr_ = addr;
  write_key_ = key;
  write_segment_ = segment_bytes;
  posted_ = 0;
  writes_left_ = 0;
  ChooseLanes(lane_keys, shares);
  if (chunked_ && !staging_error_.ok()) {
    SendError(staging_error_, Event::kWriteRefused);  // a part failed to stage before
    return;
  }
  if (const uint64_t segments = ContentSegments(meta_.tensor_bytes, segment_bytes);
      segments > kMaxContentSegments) {
    // Each segment is an immediate the receiver takes: a bound on what one tensor costs it.
    SendError(absl::InvalidArgumentError(absl::StrCat("the receiver asked for ", segments,
                                                      " segments of ", segment_bytes,
                                                      " bytes, more than ", kMaxContentSegments)),
              Event::kWriteRefused);
    return;
  }
  PostStagedWrites();
}

void RdmaTensorResponse::PostStagedWrites() {
  // A part failed to stage, or a write failed over a lane: nothing more goes.
  if (!staging_error_.ok() || !lane_error_.ok()) return;
  const uint64_t context = ContentContext();
  const uint32_t imm = request_.request_index;
  const uint64_t total = meta_.tensor_bytes;
  const uint64_t ready = ready_bytes();
  // What one immediate closes: the receiver's segments, else (staging in chunks) the chunks,
  // else the whole tensor. Only the receiver's segments and the last unit carry it.
  const uint64_t chunk = chunked_ ? channel_->env()->worker->proxy_chunk_bytes : 0;
  const uint64_t unit = write_segment_ > 0 ? write_segment_ : chunked_ ? chunk : total;
  auto* source = const_cast<uint8_t*>(static_cast<const uint8_t*>(source_));
  absl::Status s;
  while (posted_ < total && s.ok()) {
    const uint64_t start = posted_;
    const uint64_t end = std::min(total, start + unit);
    if (end > ready) break;  // its bytes are still being staged
    const bool imm_at_end = write_segment_ > 0 || end == total;
    // Segments go round the lanes by their shares; the receiver counts them whichever lane
    // they came by.
    const size_t lane = lanes_.size() > 1 ? stripes_.LaneOf(start / unit) : 0;
    if (lane > 0 && lane >= channel_->lanes()) {
      // Taken out since the tensor chose its lanes (staging in chunks posts as parts arrive).
      lane_error_ = absl::UnavailableError(
          absl::StrCat("lane ", lane, " to task ", channel_->peer_task(),
                       " was taken out while the tensor was being written over it"));
      break;
    }
    const LaneTarget& to = lanes_[lane];
    int posted = 0;
    std::tie(posted, s) = PostInPieces(end - start, [&](uint64_t offset, uint64_t len, bool last) {
      fabric::LocalBuffer local{to.region, source + start + offset, len};
      fabric::RemoteBuffer remote{to.key, write_addr_ + start + offset, len};
      return last && imm_at_end ? to.endpoint->PostWriteWithImm(local, remote, imm, context)
                                : to.endpoint->PostWrite(local, remote, context);
    });
    writes_left_ += posted;
    // Counted for a tensor kept to lane 0 too (asked for before lane 1's probe came back, or
    // too small to spread): the snapshot's lane0_bytes_sent is all that lane 0 carried.
    if (s.ok()) {
      channel_->counters().lane_bytes_sent[lane].fetch_add(static_cast<int64_t>(end - start),
                                                           std::memory_order_relaxed);
    }
    if (s.ok()) posted_ = end;
    if (!s.ok() && lane > 0) {
      // A further lane refused the post (an ibverbs queue pair in error after a failed write):
      // the lane goes, and the tensor fails as for a write that failed over it.
      lane_error_ = absl::UnavailableError(absl::StrCat("a content write to task ",
                                                        channel_->peer_task(), " over lane ", lane,
                                                        " could not be posted: ", s.message()));
      channel_->TakeLanesOut(lane, lane_error_);
      s = absl::OkStatus();
      break;
    }
  }
  if (!lane_error_.ok()) {
    // Once the writes already posted are done, OnWriteDone answers; if none are, now.
    if (writes_left_ == 0) SendError(lane_error_, Event::kWriteRefused);
    return;
  }
  if (s.ok()) return;
  if (writes_left_ > 0 || posted_ > 0) {
    channel_->Close(absl::UnavailableError(absl::StrCat(
        "content write to task ", channel_->peer_task(), " failed midway: ", s.message())));
    return;
  }
  // The target the receiver named is not writable (a bad key or range): report it to the
  // receiver rather than trusting the peer's description.
  SendError(
      absl::InvalidArgumentError(absl::StrCat(
          "the sender could not write the tensor to the receiver's destination: ", s.message())),
      Event::kWriteRefused);
}

bool RdmaTensorResponse::TakeLanded() {
  writes_left_ = 1;  // the rest are the fabric's word on writes whose bytes already landed
  // Every segment landed, so a failure still to be reported was of a write that landed anyway:
  // the receiver took the index for a new request, which must not hear of it.
  lane_error_ = absl::OkStatus();
  return OnWriteDone();
}

bool RdmaTensorResponse::OnWriteFailed(const absl::Status& status) {
  if (lane_error_.ok()) lane_error_ = status;
  return OnWriteDone();
}

bool RdmaTensorResponse::OnWriteDone() {
  if (--writes_left_ > 0) return false;
  if (!lane_error_.ok()) {
    // Nothing reads the source any more. The receiver quarantines the destination of a tensor
    // spread over lanes when it hears, since the other lanes' segments may still be on their
    // way behind this ERROR_STATUS.
    SendError(lane_error_, Event::kWriteDone);
    return false;  // SendError finished the response
  }
  if (!staging_error_.ok() && posted_ < meta_.tensor_bytes) {
    // A part failed to stage: now that nothing reads the source any more, the receiver hears.
    SendError(staging_error_, Event::kWriteDone);
    return false;  // SendError finished the response
  }
  if (posted_ < meta_.tensor_bytes && !meta_.is_dead) return false;  // parts still staging
  ChannelEnv* env = channel_->env();
  mode_->Written(*this);
  env->stats->content_writes.fetch_add(1, std::memory_order_relaxed);
  env->stats->content_bytes.fetch_add(static_cast<int64_t>(meta_.tensor_bytes),
                                      std::memory_order_relaxed);
  channel_->counters().tensors_sent.fetch_add(1, std::memory_order_relaxed);
  channel_->counters().bytes_sent.fetch_add(static_cast<int64_t>(meta_.tensor_bytes),
                                            std::memory_order_relaxed);
  TransitionTo(State::kDone, Event::kWriteDone);
  return true;
}

void RdmaTensorResponse::Expire(const absl::Status& status) {
  if (state_ != State::kWaitReRequest) return;
  SendError(status, Event::kExpire);
}

void RdmaTensorResponse::SendError(const absl::Status& status, Event event) {
  ChannelEnv* env = channel_->env();
  Message m = Answer(MessageType::kErrorStatus);
  m.error = status.ok() ? absl::InternalError("unknown error") : status;
  TransitionTo(State::kDone, event);
  env->stats->errors_sent.fetch_add(1, std::memory_order_relaxed);
  channel_->counters().errors_sent.fetch_add(1, std::memory_order_relaxed);
  // A failed send closes the channel, which moves this response out of its table first.
  channel_->SendMessage(std::move(m));
  side_->FinishResponse(request_.request_index);
}

}  // namespace tensorverbs::protocol
