// Inbox<Item>: items handed from any thread to the progress thread in batches.
//
// A producer on any thread pushes an item; the push that finds the inbox empty says so, and
// that producer posts one task to the loop that drains everything pushed until then. So a burst
// of items costs one posted task, not one each (a task owning an item would be a heap
// allocation per item), and the drain's batch keeps its capacity from turn to turn.
//
// Used for the recvs callers start (VerbsTransport) and for the tensors a sender's own task
// hands to the responses waiting for them (LocalTensorInbox). How the drain is posted, and what
// happens to items when the loop refuses it, stays with the owner.
//
// Threading: Push from any thread. Drain on the progress thread, or, once the loop has stopped,
// on whichever thread runs the refused task (with `on_loop` false: several such threads may
// drain at once, each with a batch of its own).
#ifndef TENSORVERBS_PROTOCOL_INBOX_H_
#define TENSORVERBS_PROTOCOL_INBOX_H_

#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "src/common/mutex.h"

namespace tensorverbs::protocol {

template <typename Item>
class Inbox {
 public:
  Inbox() = default;
  Inbox(const Inbox&) = delete;
  Inbox& operator=(const Inbox&) = delete;

  // Any thread. True when `item` is the first since the last drain: the caller then posts the
  // task that drains.
  bool Push(Item item) {
    MutexLock lock(&mu_);
    const bool first = items_.empty();
    items_.push_back(std::move(item));
    return first;
  }

  // Runs `each(Item&)` on every item pushed so far, in the order they were pushed.
  template <typename Each>
  void Drain(Each each, bool on_loop = true) {
    std::vector<Item> own;
    std::vector<Item>& batch = on_loop ? batch_ : own;
    {
      MutexLock lock(&mu_);
      batch.swap(items_);
    }
    for (Item& item : batch) each(item);
    batch.clear();
  }

 private:
  Mutex mu_;
  std::vector<Item> items_ ABSL_GUARDED_BY(mu_);
  std::vector<Item> batch_;  // the loop's batch, kept for its capacity (progress thread)
};

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_INBOX_H_
