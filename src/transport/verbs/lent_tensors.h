// LentTensors: grpc+gdr's sender side. A tensor a RecvTensor response names instead of
// carrying is lent: kept (or a registered copy of it, when it is not pool memory) under a
// tensor key from the request-index space, until a zero-byte write whose immediate is that key
// arrives over the requester's own channel, or the lease ends (a receiver that died or gave up
// never releases).
//
// Tensor keys are drawn at random from the whole space, not counted up: a release names a
// lease, and a faulty peer that guesses keys must not be able to end another lease early (the
// sender would then reuse memory a reader is still reading). A release from any task but the
// requester is ignored, and at most env->transfer.max_responses tensors are lent at once
// (TENSORVERBS_MAX_RESPONSES): beyond, Lend refuses and the tensor goes inline in the response
// instead.
//
// Owned by the transport; every method runs on its progress thread.
#ifndef TENSORVERBS_TRANSPORT_VERBS_LENT_TENSORS_H_
#define TENSORVERBS_TRANSPORT_VERBS_LENT_TENSORS_H_

#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/random/random.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "src/protocol/channel_env.h"
#include "src/protocol/remote_tensor.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::verbs {

class LentTensors {
 public:
  // `env` (memory, stats, max_responses) outlives this.
  explicit LentTensors(const protocol::ChannelEnv* env) : env_(env) {}

  // Keeps `tensor` for `requester` until `expires` and says where it can be read.
  absl::StatusOr<protocol::RemoteTensorRef> Lend(const std::string& requester, const Tensor& tensor,
                                                 absl::Time expires);
  // `task` finished reading `tensor_key`. Unknown, already released or another task's keys are
  // counted as dropped immediates and ignored.
  void Release(const std::string& task, uint32_t tensor_key);
  // Ends the leases that passed `now`.
  void Expire(absl::Time now);
  // Ends every lease of `task` (it stopped answering): the memory is quarantined through the
  // env (a reader frozen mid-read still reads the right bytes until the quarantine ends), not
  // freed at once.
  void EndLeasesOf(const std::string& task);
  // The tasks something is lent to (one pass over the leases).
  absl::flat_hash_set<std::string> Borrowers() const;
  size_t size() const { return lent_.size(); }
  bool empty() const { return lent_.empty(); }
  void Clear() { lent_.clear(); }

 private:
  struct Lent {
    Tensor tensor;
    std::string requester;
    absl::Time expires;
  };
  const protocol::ChannelEnv* const env_;
  absl::flat_hash_map<uint32_t, Lent> lent_;
  absl::BitGen random_;
};

}  // namespace tensorverbs::verbs

#endif  // TENSORVERBS_TRANSPORT_VERBS_LENT_TENSORS_H_
