// VerbsRemoteRendezvous: the `grpc+verbs` protocol's per-step rendezvous. A remote recv goes to
// the server's VerbsTransport; StartAbort fails the step's in-flight recvs there. Thread-safe;
// created by the RendezvousMgr factory through std::make_shared.
#ifndef TENSORVERBS_TRANSPORT_VERBS_VERBS_RENDEZVOUS_H_
#define TENSORVERBS_TRANSPORT_VERBS_VERBS_RENDEZVOUS_H_

#include <memory>

#include "src/rendezvous/remote_rendezvous.h"
#include "src/transport/verbs/verbs_transport.h"

namespace tensorverbs::verbs {

class VerbsRemoteRendezvous final : public RemoteRendezvous,
                                    public std::enable_shared_from_this<VerbsRemoteRendezvous> {
 public:
  VerbsRemoteRendezvous(const WorkerEnv* env, int64_t step_id, VerbsTransport* transport)
      : RemoteRendezvous(env, step_id), transport_(transport) {}

 protected:
  bool CountsOwnRecvs() const override { return true; }  // VerbsTransport and its channels
  void RecvFromRemoteAsync(const ParsedKey& key, const RecvArgs& args,
                           RecvDoneCallback done) override {
    transport_->Recv(
        shared_from_this(), key, args.allocator != nullptr ? args.allocator : env_->recv_allocator,
        args.expected_dtype, args.expected_shape, RecvLanding::Of(args), std::move(done));
  }
  void AbortRemote(const absl::Status& status) override {
    transport_->AbortStep(step_id(), status);
  }
  bool LandsOnDevice(const ParsedKey& key, Allocator* allocator) const override {
    return transport_->device_direct() && transport_->LandsOnDevice(key.src.TaskName(), allocator);
  }

 private:
  VerbsTransport* const transport_;
};

}  // namespace tensorverbs::verbs

#endif  // TENSORVERBS_TRANSPORT_VERBS_VERBS_RENDEZVOUS_H_
