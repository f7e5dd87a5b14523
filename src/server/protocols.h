// The protocols this build provides, in one table: for each name, the RDMA transport mode it
// runs (if any), whether gRPC's RecvTensor serves its tensors, and how its steps' rendezvous
// are made. Server::Create looks a name up here once and works from the entry from then on;
// nothing else compares protocol names.
//
// Plain data and free functions, callable from any thread; the table lives for the process.
#ifndef TENSORVERBS_SERVER_PROTOCOLS_H_
#define TENSORVERBS_SERVER_PROTOCOLS_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/protocol/channel_env.h"
#include "src/rendezvous/remote_rendezvous.h"
#include "src/rendezvous/rendezvous_mgr.h"
#include "src/transport/grpc/worker_client.h"
#include "src/transport/verbs/verbs_transport.h"

namespace tensorverbs {

struct ProtocolSpec {
  absl::string_view name;
  // The mode of the RDMA transport (VerbsTransport) this protocol runs, or none: gRPC's
  // RecvTensor alone carries its tensors.
  std::optional<protocol::VerbsMode> verbs_mode;
  // Whether WorkerService.RecvTensor serves peers' recvs (grpc, and grpc+gdr's meta-data);
  // under the others it answers UNIMPLEMENTED, their tensors going over RDMA channels.
  bool serves_recv_tensor = false;
  // grpc+gdr: RecvTensor answers lend large tensors, which peers read over the transport.
  bool lends_tensors = false;
};

// Every protocol of this build, best first.
absl::Span<const ProtocolSpec> Protocols();
// The entry named `name`, or InvalidArgument listing the available ones.
absl::StatusOr<const ProtocolSpec*> FindProtocol(absl::string_view name);

// What a protocol's steps reach their peers through: the task's environment, its gRPC clients
// of the other tasks, and the RDMA transport when the protocol runs one. All outlive the
// rendezvous manager made from them.
struct ProtocolParts {
  const WorkerEnv* env = nullptr;
  grpc_transport::GrpcWorkerCache* workers = nullptr;
  absl::Duration recv_timeout;
  verbs::VerbsTransport* verbs = nullptr;  // non-null exactly when spec.verbs_mode is set
};
// The rendezvous manager of `spec`'s steps: grpc's calls (with the transport reading the large
// tensors under grpc+gdr), or the transport's channels, whose requests made ahead for a step
// the task skipped end when that step is cleaned up.
std::unique_ptr<RendezvousMgr> NewRendezvousMgr(const ProtocolSpec& spec,
                                                const ProtocolParts& parts);

}  // namespace tensorverbs

#endif  // TENSORVERBS_SERVER_PROTOCOLS_H_
