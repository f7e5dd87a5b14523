// Internals that the three files of the progress engine share: the batches a turn's
// deliveries travel in (progress_callbacks.cc runs them; the engine keeps the spares), the
// thread-local state of QuietScope, which posts (progress_engine.cc) and waiters
// (progress_waiters.cc) both read, and the poll-set helper. Not for use outside
// src/protocol/progress_*.cc.
#ifndef TENSORVERBS_PROTOCOL_PROGRESS_ENGINE_INTERNAL_H_
#define TENSORVERBS_PROTOCOL_PROGRESS_ENGINE_INTERNAL_H_

#include <poll.h>

#include <atomic>
#include <memory>
#include <vector>

#include "src/common/bounded_queue.h"
#include "src/protocol/progress_engine.h"

namespace tensorverbs::protocol {

// A turn's deliveries travel to the executor in a batch that comes back, emptied but with its
// capacity, for a later turn: a fresh vector per turn would cost a malloc per turn and its
// growth. A parked batch holds no reference to the spares, and one in flight holds the spares
// alive, so a batch whose callbacks run after the engine is gone still has a home to go to or
// is freed. Each callback is claimed with `next`, so that when the loop leaves a batch it was
// running inline, the executor runs the rest and each callback still runs exactly once; the last
// of its holders (the thread the loop left, the executor's task) sends it home.
struct ProgressEngine::DeliveryBatch {
  std::vector<RecvDelivery> items;
  std::shared_ptr<SpareBatches> home;  // set only while in flight
  std::atomic<size_t> next{0};
  std::atomic<int> holders{1};

  // Runs the callbacks nobody claimed yet.
  void RunRest() {
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items.size();) {
      RecvDelivery& d = items[i];
      std::move(d.done)(d.status, d.tensor, d.is_dead);
    }
  }
  static void Release(DeliveryBatch* batch);
};

struct ProgressEngine::SpareBatches {
  // A batch that once carried more than this many callbacks is freed, not kept.
  static constexpr size_t kMaxKeptCapacity = 1024;
  BoundedQueue<DeliveryBatch*> queue{8};

  ~SpareBatches() {
    DeliveryBatch* batch = nullptr;
    while (queue.TryPop(&batch)) delete batch;
  }

  static void Return(DeliveryBatch* batch) {
    std::shared_ptr<SpareBatches> home = std::move(batch->home);
    batch->items.clear();
    batch->next.store(0, std::memory_order_relaxed);
    batch->holders.store(1, std::memory_order_relaxed);
    if (batch->items.capacity() > kMaxKeptCapacity || !home->queue.TryPush(batch)) delete batch;
  }
};

namespace progress_internal {

// The engine whose posts the calling thread makes quietly (QuietScope), and whether one of them
// still owes a wake-up (nobody has driven since).
extern thread_local constinit ProgressEngine* quiet_engine;
extern thread_local constinit bool quiet_owed;

// The fds of a sleep that did not happen (or whose wake-ups another thread takes): FinishSleep
// drains nothing for them.
inline void ClearRevents(std::vector<pollfd>* fds) {
  for (pollfd& f : *fds) f.revents = 0;
}

}  // namespace progress_internal
}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_PROGRESS_ENGINE_INTERNAL_H_
