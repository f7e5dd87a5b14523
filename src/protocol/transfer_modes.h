// The transfer modes of a channel as strategies, chosen once, when a request or response is made,
// from its channel's mode, so that neither machine (tensor_request.cc, tensor_response.cc)
// branches on the mode:
//
// - Zero copy (grpc+verbs, grpc+gdr's channels): the request names a destination of its own,
//   in REQUEST from a cached meta-data or else in RE_REQUEST, and the sender writes the tensor
//   there from where it lies (or from a registered copy: strings, memory the fabric cannot
//   reach, copy registration).
// - Copy (grpc+verbs-copy, seed 002; copy_mode.h): each side offers the name's pre-registered
//   buffer instead; the sender lays the tensor out in its buffer and the receiver copies it out
//   of its own.
//
// RequestMode is called by the request's machine at four points: REQUEST (Ask),
// META_DATA_RESPONSE (Answered), RE_REQUEST (NameDestination) and the content's immediate
// (Land). ResponseMode by the response's at three: the local tensor (Prepare, Fits) and the last
// write (Written). Validation mode (TENSORVERBS_DATA_VALIDATION) is a checksum that both modes
// carry. The modes are stateless: one instance of each serves every operation, on the progress
// thread.
#ifndef TENSORVERBS_PROTOCOL_TRANSFER_MODES_H_
#define TENSORVERBS_PROTOCOL_TRANSFER_MODES_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/protocol/channel_env.h"
#include "src/protocol/message.h"

namespace tensorverbs::protocol {

class RdmaTensorRequest;
class RdmaTensorResponse;

class RequestMode {
 public:
  virtual ~RequestMode() = default;
  static const RequestMode& Of(VerbsMode mode);

  // REQUEST: fills in what it names in `m` and returns the recv trace's next phase, or why the
  // destination it would name cannot be made (the recv then fails before anything is sent).
  virtual absl::StatusOr<const char*> Ask(RdmaTensorRequest& r, Message& m) const = 0;
  // META_DATA_RESPONSE `m`, before the machine takes its meta-data: an error is the peer
  // breaking the protocol, and closes the channel.
  virtual absl::Status Answered(RdmaTensorRequest& r, const Message& m) const = 0;
  // Whether a destination named in RE_REQUEST may have to wait for one of the channel's
  // large-destination grants.
  virtual bool TakesGrants() const = 0;
  // RE_REQUEST `rr` of a recv that has not ended: names where the content goes, or says why it
  // cannot (the recv then fails, `rr` names nothing, and the sender only releases its tensor).
  virtual absl::Status NameDestination(RdmaTensorRequest& r, Message& rr) const = 0;
  // The content landed, for a recv that has not ended (or a pushed request): true when the
  // result is ready in the request for the machine to deliver or keep; false when this
  // delivered the outcome itself (a dead tensor, a string, a copied payload, an error).
  virtual bool Land(RdmaTensorRequest& r) const = 0;
};

class ResponseMode {
 public:
  virtual ~ResponseMode() = default;
  static const ResponseMode& Of(VerbsMode mode);

  // Whether a device tensor may go as it is: written from a device pool the fabric registers,
  // or staged to host memory in chunks that are written as they arrive. Copy mode lays every
  // tensor out in a buffer of its own instead.
  virtual bool SendsFromWhereItLies() const = 0;
  // The local tensor: lays out the content's source and describes it (the response's meta).
  virtual absl::Status Prepare(RdmaTensorResponse& r, const Tensor& tensor, bool is_dead) const = 0;
  // Whether the REQUEST named a destination the content fits, so that it goes at once.
  virtual bool Fits(const RdmaTensorResponse& r) const = 0;
  // The last content write completed.
  virtual void Written(RdmaTensorResponse& r) const = 0;
};

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_TRANSFER_MODES_H_
