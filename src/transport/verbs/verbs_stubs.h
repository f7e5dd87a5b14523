// VerbsStubs: the VerbsService clients of the other tasks, one per task, created on first use
// and kept for the transport's life (channel set-up and the watchdog's probes share them).
// Thread-safe.
#ifndef TENSORVERBS_TRANSPORT_VERBS_VERBS_STUBS_H_
#define TENSORVERBS_TRANSPORT_VERBS_VERBS_STUBS_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "proto/verbs.grpc.pb.h"
#include "src/common/mutex.h"
#include "src/rpc/grpc_util.h"
#include "src/rpc/security.h"

namespace tensorverbs::verbs {

class VerbsStubs {
 public:
  explicit VerbsStubs(std::shared_ptr<const rpc::RpcSecurity> security)
      : security_(std::move(security)) {}

  // The client of `task` at `address` (host:port).
  std::shared_ptr<proto::VerbsService::Stub> Get(const std::string& task,
                                                 const std::string& address) {
    MutexLock lock(&mu_);
    std::shared_ptr<proto::VerbsService::Stub>& stub = stubs_[task];
    if (stub == nullptr) {
      stub = proto::VerbsService::NewStub(
          security_->NewChannel(address, rpc::ClientChannelArguments(rpc::kMaxControlAnswerBytes)));
    }
    return stub;
  }

 private:
  const std::shared_ptr<const rpc::RpcSecurity> security_;
  Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<proto::VerbsService::Stub>> stubs_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace tensorverbs::verbs

#endif  // TENSORVERBS_TRANSPORT_VERBS_VERBS_STUBS_H_
