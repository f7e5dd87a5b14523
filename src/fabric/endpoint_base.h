// EndpointBase: what the backends' endpoints have in common. The three Post* calls become one
// Post(kind, with_imm, ...), and CheckRanges validates a post's buffers before anything reaches
// the provider (a bad range must be an error at the caller, never a silent drop at the peer).
// Same threading as Endpoint.
#ifndef TENSORVERBS_FABRIC_ENDPOINT_BASE_H_
#define TENSORVERBS_FABRIC_ENDPOINT_BASE_H_

#include "src/fabric/fabric.h"

namespace tensorverbs::fabric {

class EndpointBase : public Endpoint {
 public:
  absl::Status PostWrite(const LocalBuffer& local, const RemoteBuffer& remote,
                         uint64_t context) final {
    return Post(CompletionKind::kWrite, false, 0, local, remote, context);
  }
  absl::Status PostWriteWithImm(const LocalBuffer& local, const RemoteBuffer& remote, uint32_t imm,
                                uint64_t context) final {
    return Post(CompletionKind::kWrite, true, imm, local, remote, context);
  }
  absl::Status PostRead(const LocalBuffer& local, const RemoteBuffer& remote,
                        uint64_t context) final {
    return Post(CompletionKind::kRead, false, 0, local, remote, context);
  }

 protected:
  virtual absl::Status Post(CompletionKind kind, bool with_imm, uint32_t imm,
                            const LocalBuffer& local, const RemoteBuffer& remote,
                            uint64_t context) = 0;

  // The local buffer lies inside its region, local.length fits remote.length, and
  // [remote.addr, +local.length) lies inside the peer's region [region_base, +region_length).
  static absl::Status CheckRanges(absl::string_view backend, const LocalBuffer& local,
                                  const RemoteBuffer& remote, uint64_t region_base,
                                  uint64_t region_length);
};

}  // namespace tensorverbs::fabric

#endif  // TENSORVERBS_FABRIC_ENDPOINT_BASE_H_
