// BoundedQueue: a fixed-capacity queue of trivially copyable values that any number of threads
// push to and pop from without a lock. The pool allocator's deferred frees, the recycled blocks
// of tensor buffers and the progress engine's spare delivery batches use it: a free on one
// thread and an allocation on another meet here instead of on a mutex.
//
// Each cell carries a sequence number that says whose turn it is (the classic bounded-queue
// design of sequence-stamped cells): a producer claims a position with one compare-and-swap on
// the enqueue counter, writes its value and publishes it with a release store of the cell's
// sequence; a consumer claims a published cell with one compare-and-swap on the dequeue counter,
// reads it and hands the cell to the producer one lap later. The stamps make a cell's reuse
// unambiguous, so there is no ABA problem. TryPush fails, leaving the caller to fall back, when
// the queue is full. TryPop returns false when the next position is empty or its producer has
// claimed it but not yet published (a later call sees it).
//
// Threading: any thread, any number of producers and consumers. Never blocks, never allocates
// after construction.
#ifndef TENSORVERBS_COMMON_BOUNDED_QUEUE_H_
#define TENSORVERBS_COMMON_BOUNDED_QUEUE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>

namespace tensorverbs {

template <typename T>
class BoundedQueue {
  static_assert(std::is_trivially_copyable_v<T>);

 public:
  // `capacity` is rounded up to a power of two (at least 2).
  explicit BoundedQueue(size_t capacity) {
    size_t n = 2;
    while (n < capacity) n *= 2;
    mask_ = n - 1;
    cells_ = std::make_unique<Cell[]>(n);
    for (size_t i = 0; i < n; ++i) cells_[i].sequence.store(i, std::memory_order_relaxed);
  }
  BoundedQueue(const BoundedQueue&) = delete;
  BoundedQueue& operator=(const BoundedQueue&) = delete;

  size_t capacity() const { return mask_ + 1; }

  bool TryPush(const T& value) {
    uint64_t pos = enqueue_.load(std::memory_order_relaxed);
    while (true) {
      Cell& cell = cells_[pos & mask_];
      const uint64_t sequence = cell.sequence.load(std::memory_order_acquire);
      const auto lag = static_cast<int64_t>(sequence - pos);
      if (lag == 0) {
        if (enqueue_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          cell.value = value;
          cell.sequence.store(pos + 1, std::memory_order_release);
          return true;
        }
        // `pos` now holds the current counter: try that position.
      } else if (lag < 0) {
        return false;  // the cell still holds a value from one lap ago: full
      } else {
        pos = enqueue_.load(std::memory_order_relaxed);  // another producer took it
      }
    }
  }

  bool TryPop(T* value) {
    uint64_t pos = dequeue_.load(std::memory_order_relaxed);
    while (true) {
      Cell& cell = cells_[pos & mask_];
      const uint64_t sequence = cell.sequence.load(std::memory_order_acquire);
      const auto lag = static_cast<int64_t>(sequence - (pos + 1));
      if (lag == 0) {
        if (dequeue_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          *value = cell.value;
          cell.sequence.store(pos + mask_ + 1, std::memory_order_release);
          return true;
        }
        // `pos` now holds the current counter: try that position.
      } else if (lag < 0) {
        return false;  // empty, or its producer has not published yet
      } else {
        pos = dequeue_.load(std::memory_order_relaxed);  // another consumer took it
      }
    }
  }

 private:
  struct Cell {
    std::atomic<uint64_t> sequence{0};
    T value{};
  };

  size_t mask_ = 0;
  std::unique_ptr<Cell[]> cells_;
  alignas(64) std::atomic<uint64_t> enqueue_{0};
  alignas(64) std::atomic<uint64_t> dequeue_{0};
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_BOUNDED_QUEUE_H_
