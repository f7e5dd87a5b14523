// Push-ahead (TENSORVERBS_PUSH): after a recv of a key at step s completes in place, the
// receiving side asks for the key at step s+1 before any recv wants it, so the next recv finds
// its request made, or its content landed.
//
// PushAhead is one receiving side's bookkeeping for it: per key, the index the peer knows the
// key by, how many recvs of it are in flight, and which request (if any) was pushed for its
// next step; and the channel's budget of pushed requests and their bytes. It decides whether a
// push may be made; the receiving side (receiving_side.h) makes the request, and a recv that
// finds it takes it over (RdmaTensorRequest::Adopt: the request only sees "adopted").
//
// LandedStore is PeerChannels' (peer_channels.h), one per transport: tensors that landed in pushed requests no recv took before
// their channel closed (the peer stopped after its sends were taken, as every task does at the
// end of training), kept for the recv of (peer task, key, step) until it comes, its step ends,
// or their time is up.
//
// Both run on the transport's progress thread only.
#ifndef TENSORVERBS_PROTOCOL_PUSH_AHEAD_H_
#define TENSORVERBS_PROTOCOL_PUSH_AHEAD_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "absl/container/node_hash_map.h"
#include "absl/time/time.h"
#include "src/protocol/message.h"
#include "src/rendezvous/key_table.h"
#include "src/tensor/allocator.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::protocol {

class RdmaMemoryMgr;

class PushAhead {
 public:
  static constexpr uint32_t kNoPush = 0xFFFFFFFF;
  // Per key on this channel.
  struct KeyState {
    uint32_t name_index = kNoNameIndex;  // how the peer knows it
    int active = 0;                      // requests of it that a recv owns
    uint32_t pushed = kNoPush;           // the request made ahead for its next step
  };
  struct Budget {
    int max_requests = 1024;
    uint64_t max_bytes = uint64_t{256} << 20;
  };

  explicit PushAhead(Budget budget) : budget_(budget) {}

  // The key's state; null past kMaxKeys keys (they are then neither indexed nor pushed).
  KeyState* StateOf(const KeyRef& key);
  // An existing key's state, or null.
  KeyState* Find(const KeyRef& key);

  // The destination bytes a push of `key`'s next step would take, if one may be made now: no
  // recv of the key in flight and none pushed, a host allocator, a cached meta-data of a small,
  // live, non-string tensor, and room in the budget. nullopt otherwise.
  std::optional<uint64_t> Plan(const KeyState& state, const KeyRef& key, Allocator* allocator,
                               const RdmaMemoryMgr& memory) const;
  // Request `index` was pushed for the key of `state`, with a destination of `bytes`.
  void Made(KeyState* state, uint32_t index, uint64_t bytes);
  // The pushed request `index` of `key` (of `bytes`) was adopted or finished: out of the key's
  // slot and the budget.
  void Unmade(const KeyRef& key, uint32_t index, uint64_t bytes);

 private:
  // Keys a channel names by index; later keys travel by name.
  static constexpr size_t kMaxKeys = 65536;
  // Larger tensors are not pushed: their transfer, not the REQUEST round trip, sets their
  // latency, and measured over shm a pushed 1 MiB recv was slower (58-83 us p50 against 49-51).
  static constexpr uint64_t kMaxPushedTensorBytes = uint64_t{256} << 10;

  const Budget budget_;
  // The table holds the keys, so an entry's pointer is never another key's.
  absl::node_hash_map<KeyRef, KeyState> keys_;
  int requests_ = 0;    // pushed, not adopted, not finished
  uint64_t bytes_ = 0;  // their destinations
};

class LandedStore {
 public:
  void Keep(const std::string& peer_task, const std::string& key, int64_t step, Tensor tensor,
            absl::Time until);
  // The tensor kept for the recv of (`key`, `step`) from `peer_task`, handed over; nullopt if
  // none is.
  std::optional<Tensor> Take(const std::string& peer_task, const std::string& key, int64_t step);
  // Drops what `step` kept (the step ended) and what is past its time.
  void DropStep(int64_t step);
  void Expire(absl::Time now);
  bool empty() const { return landed_.empty(); }

 private:
  std::map<std::tuple<std::string, std::string, int64_t>, std::pair<Tensor, absl::Time>> landed_;
};

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_PUSH_AHEAD_H_
