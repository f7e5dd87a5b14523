// RdmaTensorResponse: the sending side of one recv over a grpc+verbs channel (the acceptor's
// state machine of seed 000). Its rows are one table, kResponseTable in tensor_response.cc
// (state_table.h; drawn in docs/architecture/state-machines.md). In short: once the local tensor
// is there, the content goes at once when the REQUEST named a destination it fits (kWriting),
// else META_DATA_RESPONSE asks for one (kWaitReRequest); the last write completed ends it, and so
// does ERROR_STATUS or Cancel in any state.
//
// How the content is laid out and whether a REQUEST's destination fits it is the channel's
// transfer mode, a strategy the response holds from the start (transfer_modes.h).
//
// A device tensor the fabric cannot reach is staged to host memory. Where the proxy path
// moves in chunks (WorkerEnv::proxy_chunk_bytes), the response goes on at once with the
// staging tensor and writes each part as soon as its device-to-host copy completed
// (OnStaged), so the copies of later parts overlap the writes of earlier ones; a part that
// fails to stage ends the response with ERROR_STATUS once the writes already posted completed.
//
// Any sender-side failure (bad key, stale incarnation, cleaned-up or aborted step,
// unserializable tensor, unwritable destination) goes back as ERROR_STATUS with its code and
// message. The response keeps the tensor (or its registered staging copy) alive until the
// content writes complete.
//
// Owned by its channel's SendingSide; every method runs on the transport's progress thread.
#ifndef TENSORVERBS_PROTOCOL_TENSOR_RESPONSE_H_
#define TENSORVERBS_PROTOCOL_TENSOR_RESPONSE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/common/state_table.h"
#include "src/fabric/fabric.h"
#include "src/protocol/message.h"
#include "src/protocol/stripes.h"
#include "src/rendezvous/key_table.h"
#include "src/rendezvous/remote_rendezvous.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::protocol {

class Channel;
class ResponseMode;
class SendingSide;

class RdmaTensorResponse {
 public:
  enum class State { kWaitTensor, kWaitReRequest, kWriting, kDone };
  static constexpr int kStates = 4;
  // What moves a response: the table's events.
  enum class Event {
    kTensor,        // the local tensor (or why there is none)
    kReRequest,     // RE_REQUEST
    kExpire,        // no RE_REQUEST within the response timeout
    kStaged,        // chunked staging: a part failed to stage
    kWriteDone,     // the last content write completed
    kWriteRefused,  // the content write cannot go
    kCancel,        // the channel closed
  };
  static constexpr int kEvents = 7;

  RdmaTensorResponse(SendingSide* side, uint64_t serial, Message request);

  // Asks the local rendezvous for the tensor `key` names; Resume runs (on the progress thread)
  // when sent.
  void Start(std::shared_ptr<RemoteRendezvous> rendezvous, KeyRef key);
  // The local tensor, or why there is none (then ERROR_STATUS, and the channel forgets this).
  void Resume(const absl::Status& status, const Tensor& tensor, bool is_dead);
  void RecvReRequest(const Message& m);
  // One content write completed; true when the response is finished.
  bool OnWriteDone();
  // One content write failed over a lane taken out of the channel (`status` names it): nothing
  // more is posted, and once its other writes are done the receiver hears ERROR_STATUS. True
  // when the response is finished.
  bool OnWriteFailed(const absl::Status& status);
  // Whether its content went over several lanes and every byte was posted: the receiver, once
  // it counted every segment, may take the index again before this side has polled the last
  // completions from the other lanes' queues.
  bool StripedAndPosted() const {
    return state_ == State::kWriting && lanes_.size() > 1 && posted_ == meta_.tensor_bytes;
  }
  // The receiver took the index again, so every segment landed: finishes as if the last write
  // completed (true when finished). Its late completions carry its serial, which no longer
  // matches (ContentContext).
  bool TakeLanded();
  // The bits of serial() that content writes' contexts carry beside the index.
  static constexpr uint64_t kContentSerialMask = 0xFFFFFF;
  // Chunked staging: the first `staged_bytes` of the tensor are in host memory, or `status`
  // says why the staging failed. True when the response is finished.
  bool OnStaged(const absl::Status& status, uint64_t staged_bytes);
  // Stops waiting for the local tensor (channel closing).
  void Cancel();
  // The channel closes: the memory this response's writes still in flight read (its source,
  // its staging) goes to `memory`, for the caller to keep past the close. On an endpoint its
  // domain's channels share, closing a channel cannot take its operations back from the
  // provider, which reads them until they complete or the connection is torn down.
  void GiveUpInFlightMemory(std::vector<Tensor>* memory);
  // Gives up waiting for the RE_REQUEST (the receiver did not ask for the content in time):
  // ERROR_STATUS with `status`, and the channel forgets this. Only in kWaitReRequest.
  void Expire(const absl::Status& status);

  uint64_t serial() const { return serial_; }
  uint32_t index() const { return request_.request_index; }
  State state() const { return state_; }
  // When META_DATA_RESPONSE went out (kWaitReRequest).
  absl::Time meta_sent_at() const { return meta_sent_at_; }
  // Holds its tensor and is still sending it.
  bool in_progress() const { return state_ == State::kWriting || state_ == State::kWaitReRequest; }

 private:
  // The modes act on the response's source and meta (transfer_modes.h).
  friend class ZeroCopyResponses;
  friend class CopyResponses;

  // The one place the state changes; checks in debug and sanitizer builds that the move is a
  // row of kResponseTable.
  void TransitionTo(State next, Event event);
  absl::Status PrepareSource(const Tensor& tensor);
  // Whether the request already named a destination the tensor fits.
  bool CanWriteNow() const;
  // Writes the content to `addr`, in segments of `segment_bytes` each ending with the
  // immediate where the receiver asked for them (Message::segment_bytes), else in one.
  // `event` is what started the write.
  // `lane_keys`: the destination's keys on lanes 1.. (Message::lane_keys), for segments
  // spread over the lanes, each lane carrying its share (`shares`: Message::lane_shares).
  void WriteContent(uint64_t addr, const fabric::RemoteKey& key, uint32_t segment_bytes,
                    absl::Span<const fabric::RemoteKey> lane_keys, const LaneShares& shares,
                    Event event);
  // The lanes the content goes over (lanes_): lane 0, plus each further one the receiver gave a
  // key for and whose domain registered the source; and which segment goes over which
  // (stripes_: the receiver's shares when every lane it asked for serves, else even).
  void ChooseLanes(absl::Span<const fabric::RemoteKey> lane_keys, const LaneShares& shares);
  // A content write's context: the request index and the low bits of the serial.
  uint64_t ContentContext() const;
  // Posts the content writes whose bytes are staged (all of them unless staging in chunks).
  void PostStagedWrites();
  // Whether a device tensor is staged in chunks, and the callback that tells this response.
  bool StagesInChunks() const;
  RemoteRendezvous::StagedCallback TellStaged() const;
  // The bytes of the source there to write.
  uint64_t ready_bytes() const { return chunked_ ? staged_bytes_ : meta_.tensor_bytes; }
  // The requested key, for messages ("?" when it did not resolve).
  const std::string& name() const;
  // A message to the requester about this request (step and index filled in).
  Message Answer(MessageType type) const;
  // META_DATA_RESPONSE (in copy mode: the seed's BUFFER_REQUEST), then wait for RE_REQUEST.
  void SendMetaData();
  // ERROR_STATUS on `event`; the sending side then forgets this response.
  void SendError(const absl::Status& status, Event event);

  // Not const: a finished record is recycled by assignment (spare_records.h).
  SendingSide* side_;
  Channel* channel_;  // side_'s
  uint64_t serial_;
  Message request_;           // REQUEST as received (step, index, target, meta)
  const ResponseMode* mode_;  // the channel's mode (transfer_modes.h)
  KeyRef key_;                // what it asked for, once resolved (Start)
  State state_ = State::kWaitTensor;
  std::shared_ptr<RemoteRendezvous> rendezvous_;
  uint64_t token_ = 0;
  TensorMetaData meta_;
  Tensor tensor_;   // keeps the source alive until the writes complete
  Tensor staging_;  // registered copy (strings, unregistered sources, copy mode)
  const void* source_ = nullptr;
  const fabric::MemoryRegion* source_region_ = nullptr;
  std::unique_ptr<fabric::MemoryRegion> transient_;
  int writes_left_ = 0;
  absl::Time meta_sent_at_ = absl::InfiniteFuture();
  bool restaged_ = false;  // a device tensor the fabric cannot reach went to host staging
  // Staging in chunks: how far it got, and why it stopped if it failed.
  bool chunked_ = false;
  uint64_t staged_bytes_ = 0;
  absl::Status staging_error_;
  // The first content write that failed over a lane (OnWriteFailed).
  absl::Status lane_error_;
  // The content write: where, in what segments (0: one), and the bytes posted so far.
  uint64_t write_addr_ = 0;
  fabric::RemoteKey write_key_;
  uint32_t write_segment_ = 0;
  uint64_t posted_ = 0;
  // Where each lane writes from and to (lane 0 first); segment i goes over lane
  // stripes_.LaneOf(i).
  struct LaneTarget {
    fabric::Endpoint* endpoint;
    const fabric::MemoryRegion* region;
    fabric::RemoteKey key;
  };
  absl::InlinedVector<LaneTarget, kMaxLanes> lanes_;
  StripePattern stripes_{1, LaneShares{}};
  // The further lanes' registrations of a source outside the pool, like transient_.
  absl::InlinedVector<std::unique_ptr<fabric::MemoryRegion>, kMaxLanes - 1> lane_transients_;
};

// The table, for the diagrams and the tests.
StateTableView ResponseStateTable();

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_TENSOR_RESPONSE_H_
