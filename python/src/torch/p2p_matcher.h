// P2pMatcher: torch.distributed's point-to-point matching (recv from a rank, or from any rank,
// by tag, in the order each sender sent) over tensorverbs' keyed rendezvous.
//
// The transport matches a recv to a send by key. The backend names the n-th message from rank
// `src` with tag `tag` after (src, tag, n), so a recv from a known rank needs only a counter. A
// recv from any source cannot know its key: the matcher posts, for every peer, a recv of that
// peer's next message on the tag, hands the first one to complete to the oldest waiting recv that
// accepts its source, and keeps the others, in order, for the recvs that come next. So no message
// is lost or taken twice, and the messages of one (src, tag) are handed out in the order they
// were sent, whichever of their network recvs completes first.
//
// A recv from a known rank may bring memory of its own (`into`, RecvOptions::into) for its
// message to land in. It goes with a network recv only when that recv's message is certain to be
// the one this recv gets: the recv starts it itself (no earlier network recv of the stream is
// spare) and no recv from any source waits on the tag, which could take the message first.
//
// Made with std::make_shared (network recvs keep it alive) and owned by the process group. Recv and
// RecvAny may be called from any thread; the PostRecv function runs inside them (it must not block
// and must call its callback exactly once, on any thread, also inside the call). Every Delivery
// runs exactly once, outside the matcher's lock: on the thread of the network recv's callback,
// inside Recv/RecvAny when a message was already kept, or inside Fail.
#ifndef TENSORVERBS_PYTHON_TORCH_P2P_MATCHER_H_
#define TENSORVERBS_PYTHON_TORCH_P2P_MATCHER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::torch_backend {

class P2pMatcher : public std::enable_shared_from_this<P2pMatcher> {
 public:
  // A recv's outcome: the message (or the error of its network recv) and the rank it came from.
  using Delivery = std::function<void(absl::StatusOr<Tensor> message, int src)>;
  using NetworkDone = std::function<void(absl::StatusOr<Tensor> message)>;
  // Starts the network recv of message `n` of (`src`, `tag`), which the recv that asked for it
  // expects to be `bytes` long (a hint: the message may differ), into `into` if it is
  // initialized (see above).
  using PostRecv = std::function<void(int src, int64_t tag, int64_t n, size_t bytes, Tensor into,
                                      NetworkDone done)>;

  P2pMatcher(int size, int self, PostRecv post);
  P2pMatcher(const P2pMatcher&) = delete;
  P2pMatcher& operator=(const P2pMatcher&) = delete;

  // The next message from `src` (not this rank) with `tag`, expected `bytes` long; `into` (may be
  // uninitialized): memory for it to land in, which goes with its network recv or is dropped.
  void Recv(int src, int64_t tag, size_t bytes, Delivery done, Tensor into = Tensor());
  // The next message with `tag` from any other rank.
  void RecvAny(int64_t tag, size_t bytes, Delivery done);
  // Fails every waiting recv and every later one with `status` (the group is going).
  void Fail(const absl::Status& status);

  // Messages that arrived before a recv asked for them, for tests and stats.
  int64_t kept() const;

 private:
  // The messages of one (src, tag), in the order they were sent.
  struct Stream {
    int64_t posted = 0;     // network recvs started: messages 0..posted-1
    int64_t delivered = 0;  // messages handed on (to a waiter or into `ready`)
    std::map<int64_t, absl::StatusOr<Tensor>> early;  // arrived ahead of an earlier message
    std::deque<absl::StatusOr<Tensor>> ready;         // in order, not asked for yet
  };
  struct Waiter {
    int src;  // -1: any
    Delivery done;
  };
  struct Post {
    int64_t n;
    size_t bytes;
    NetworkDone done;
    Tensor into;
  };

  Stream& StreamOf(int src, int64_t tag);
  // Starts network recvs of (src, tag) until as many are under way as waiters accept `src`.
  void PostNeeded(int src, int64_t tag, size_t bytes, std::deque<Post>* to_post);
  void Arrived(int src, int64_t tag, int64_t n, absl::StatusOr<Tensor> message);
  void Start(int src, int64_t tag, std::deque<Post>& to_post);

  const int size_;
  const int self_;
  const PostRecv post_;
  mutable std::mutex mu_;
  absl::Status failed_;                                // guarded by mu_
  std::map<std::pair<int, int64_t>, Stream> streams_;  // guarded by mu_
  std::map<int64_t, std::deque<Waiter>> waiters_;      // by tag; guarded by mu_
  int64_t kept_ = 0;                                   // guarded by mu_
};

}  // namespace tensorverbs::torch_backend

#endif  // TENSORVERBS_PYTHON_TORCH_P2P_MATCHER_H_
