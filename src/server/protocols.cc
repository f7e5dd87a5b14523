#include "src/server/protocols.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/transport/grpc/grpc_rendezvous.h"
#include "src/transport/verbs/verbs_rendezvous.h"

namespace tensorverbs {

absl::Span<const ProtocolSpec> Protocols() {
  static constexpr ProtocolSpec kProtocols[] = {
      {"grpc+verbs", protocol::VerbsMode::kZeroCopy, /*serves_recv_tensor=*/false,
       /*lends_tensors=*/false},
      {"grpc+gdr", protocol::VerbsMode::kGdr, /*serves_recv_tensor=*/true,
       /*lends_tensors=*/true},
      {"grpc+verbs-copy", protocol::VerbsMode::kCopy, /*serves_recv_tensor=*/false,
       /*lends_tensors=*/false},
      {"grpc", std::nullopt, /*serves_recv_tensor=*/true, /*lends_tensors=*/false},
  };
  return kProtocols;
}

absl::StatusOr<const ProtocolSpec*> FindProtocol(absl::string_view name) {
  for (const ProtocolSpec& spec : Protocols()) {
    if (spec.name == name) return &spec;
  }
  std::vector<absl::string_view> names;
  for (const ProtocolSpec& spec : Protocols()) names.push_back(spec.name);
  return absl::InvalidArgumentError(
      absl::StrCat("unknown protocol '", name, "'; available: ", absl::StrJoin(names, ", ")));
}

std::unique_ptr<RendezvousMgr> NewRendezvousMgr(const ProtocolSpec& spec,
                                                const ProtocolParts& parts) {
  const WorkerEnv* env = parts.env;
  grpc_transport::GrpcWorkerCache* workers = parts.workers;
  const absl::Duration recv_timeout = parts.recv_timeout;
  verbs::VerbsTransport* transport = parts.verbs;
  if (!spec.verbs_mode.has_value() || spec.serves_recv_tensor) {
    // grpc, and grpc+gdr: the RecvTensor calls, with the transport (if any) reading the large
    // tensors.
    protocol::TensorPuller* puller = spec.lends_tensors ? transport : nullptr;
    return std::make_unique<RendezvousMgr>([env, workers, recv_timeout, puller](int64_t step) {
      return std::make_shared<grpc_transport::GrpcRemoteRendezvous>(env, step, workers,
                                                                    recv_timeout, puller);
    });
  }
  return std::make_unique<RendezvousMgr>(
      [env, transport](int64_t step) {
        return std::make_shared<verbs::VerbsRemoteRendezvous>(env, step, transport);
      },
      /*remembered_cleanups=*/100000,
      [transport](int64_t step) {
        // Requests made ahead for a step this task skipped end with it.
        transport->AbortStep(step,
                             absl::CancelledError(absl::StrCat("step ", step, " was cleaned up")));
      });
}

}  // namespace tensorverbs
