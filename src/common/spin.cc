#include "src/common/spin.h"

#include <sched.h>

#include <atomic>
#include <cstdint>
#include <ctime>

namespace tensorverbs {
namespace {

// Until when (CLOCK_MONOTONIC, ns) yields count as costly; 0: they do not.
std::atomic<int64_t> costly_until_ns{0};
// When the last late yield returned. One late yield alone proves little: the thread it let run
// may be one of ours with a millisecond of work (a Python rank, a reduction). Beside a thread
// that never blocks nearly every yield is late, so a second within kPairedWithin marks them.
std::atomic<int64_t> last_late_ns{0};
constexpr int64_t kPairedWithin = 50 * 1000 * 1000;

int64_t MonotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

}  // namespace

bool YieldsAreCostly() {
  const int64_t until = costly_until_ns.load(std::memory_order_relaxed);
  return until != 0 && MonotonicNs() < until;
}

void SpinYield() {
  const int64_t before = MonotonicNs();
  if (before < costly_until_ns.load(std::memory_order_relaxed)) {
    for (int i = 0; i < 16; ++i) CpuPause();
    return;
  }
  sched_yield();
  const int64_t after = MonotonicNs();
  if (after - before > absl::ToInt64Nanoseconds(kCostlyYield)) {
    const int64_t previous = last_late_ns.exchange(after, std::memory_order_relaxed);
    if (previous != 0 && after - previous < kPairedWithin) {
      costly_until_ns.store(after + absl::ToInt64Nanoseconds(kCostlyFor),
                            std::memory_order_relaxed);
    }
  }
}

}  // namespace tensorverbs
