// SameHostGroup: one memory segment shared by every rank of a process group that all run on this
// host, and all_reduce and reduce_scatter through it (broadcast, all_gather and barrier too,
// which need no reduction: a copy in, a copy out): each rank copies its input into its own
// slot once, reduces its share of the elements straight out of every rank's slot, and copies the
// result out, instead of passing one message per ring step (NCCL's and oneCCL's shared-memory
// algorithms do the same). Per rank and byte that is two copies and a reduction pass, against a
// ring's (ranks - 1) messages with a reduction each, and no protocol message at all.
//
// Made by ProcessGroupTensorVerbs::Create on every rank at once, when every rank published this
// host's identity (src/common/host_identity.h) and grpc+verbs: rank 0 creates the segment (a
// sealed memfd), listens on an abstract Unix socket whose name it publishes in the group's store,
// and hands the descriptor to each other rank, which checks its size and seals before it maps it.
// Only processes of this user may connect.
//
// Allreduce and ReduceScatter are called by the thread that runs the group's collectives, one at
// a time and in the same order on every rank; each takes its turn numbers from a counter all
// ranks advance alike. Between the phases of an operation the ranks meet at barriers in the
// segment: a rank spins on them briefly, then sleeps on a futex in the segment, and each second
// asks the Collective whether it is still wanted (its deadline, an abandoned work, another rank's
// failure) and whether every other rank's process is still alive. An error names the rank waited
// for. The caller's tensors are written only through the Collective (WriteOut), so nothing
// touches them once their work has failed.
#ifndef TENSORVERBS_PYTHON_TORCH_SAME_HOST_H_
#define TENSORVERBS_PYTHON_TORCH_SAME_HOST_H_

#include <c10/core/ScalarType.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "python/src/torch/reduce.h"

namespace tensorverbs::torch_backend {

class Collective;

class SameHostGroup {
 public:
  // At most this many ranks share one segment; a larger group keeps the ring.
  static constexpr int kMaxRanks = 64;

  // What the group's store offers Join: set a key, and get one (waiting for it up to the
  // group's timeout; an exception's text on failure).
  struct Store {
    std::function<void(const std::string& key, const std::string& value)> set;
    std::function<absl::StatusOr<std::string>(const std::string& key)> get;
  };
  // Rank `rank` of `size` joins the group's segment under `key`; Unavailable, naming what failed
  // and the rank, if it cannot (every rank then fails the group's creation alike, or times out).
  static absl::StatusOr<std::unique_ptr<SameHostGroup>> Join(const Store& store,
                                                             const std::string& key, int rank,
                                                             int size,
                                                             std::chrono::milliseconds timeout);
  SameHostGroup(const SameHostGroup&) = delete;
  SameHostGroup& operator=(const SameHostGroup&) = delete;
  ~SameHostGroup();

  // Every rank's `count` elements at `data` become their reduction (AVG: their mean).
  absl::Status Allreduce(Collective& c, void* data, int64_t count, c10::ScalarType dtype, RedOp op);
  // ins[i] is this rank's block for rank i; `out` gets the reduction of every rank's block for
  // this rank, `count` elements.
  absl::Status ReduceScatter(Collective& c, const void* const* ins, void* out, int64_t count,
                             c10::ScalarType dtype, RedOp op);

  // Broadcast and Allgather above this many bytes (per rank) pass messages instead: there the
  // message path lends the sender's tensor, and where the fabric writes the caller's memory it
  // lands in the output itself, so each byte moves once rather than in and out of a slot; below
  // it the message path's cost per message dominates and the slots win.
  static constexpr size_t kMaxCopyBytes = size_t{1} << 20;

  // Rank `root`'s `bytes` at `data` into every rank's `data`.
  absl::Status Broadcast(Collective& c, void* data, size_t bytes, int root);
  // outs[i] gets rank i's `bytes` at `in`.
  absl::Status Allgather(Collective& c, const void* in, void* const* outs, size_t bytes);
  // Returns once every rank reached it.
  absl::Status Barrier(Collective& c);

  size_t slot_bytes() const { return slot_bytes_; }

 private:
  struct Header;
  // Where the slots begin: the header, in whole pages.
  static size_t HeaderBytes();
  SameHostGroup(void* base, size_t bytes, int rank, int size, size_t slot_bytes);

  uint8_t* Slot(int rank) const;
  uint8_t* Result() const;
  // Publishes this rank's arrival at phase `which` of turn `turn`, and waits until every rank
  // has: the rank that did not come, and why waiting stopped, on failure.
  absl::Status Meet(Collective& c, int which, uint64_t turn);
  // Publishes what this rank's operation reduces (before its first barrier of a turn), and,
  // after it, checks that every rank reduces the same; InvalidArgument naming the first that
  // does not.
  void Announce(uint64_t bytes, c10::ScalarType dtype);
  absl::Status Agree(Collective& c, uint64_t bytes, c10::ScalarType dtype);

  void* const base_;
  const size_t bytes_;
  const int rank_;
  const int size_;
  const size_t slot_bytes_;
  Header* const header_;
  uint64_t next_turn_ = 1;  // the collectives' thread's
};

}  // namespace tensorverbs::torch_backend

#endif  // TENSORVERBS_PYTHON_TORCH_SAME_HOST_H_
