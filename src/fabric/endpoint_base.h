// EndpointBase: what the backends' endpoints have in common. The three Post* calls become one
// Post(kind, with_imm, ...), and CheckRanges validates a post's buffers before anything reaches
// the provider (a bad range must be an error at the caller, never a silent drop at the peer).
// DrainActive is the domains' pass over their endpoints with operations under way.
// Same threading as Endpoint.
#ifndef TENSORVERBS_FABRIC_ENDPOINT_BASE_H_
#define TENSORVERBS_FABRIC_ENDPOINT_BASE_H_

#include <cstddef>
#include <vector>

#include "absl/types/span.h"
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

// A domain's endpoints with operations under way, each with `Drain(out)` (issue what its queue
// holds, report deferred failures and time-outs), `idle()` and an `active` flag that says it is
// listed: each drains, and one left with nothing under way leaves the list. Only these have
// anything to do, so an idle turn costs the same with ten channels or ten thousand. They drain
// even when `out` is full: the completions just handed out gave back room to issue into.
template <typename EndpointT>
size_t DrainActive(std::vector<EndpointT*>& active, absl::Span<Completion> out) {
  size_t produced = 0;
  for (size_t i = 0; i < active.size();) {
    EndpointT* ep = active[i];
    produced += ep->Drain(out.subspan(produced));
    if (ep->idle()) {
      ep->active = false;
      active[i] = active.back();
      active.pop_back();
    } else {
      ++i;
    }
  }
  return produced;
}

}  // namespace tensorverbs::fabric

#endif  // TENSORVERBS_FABRIC_ENDPOINT_BASE_H_
