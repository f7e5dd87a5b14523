#include "src/common/spin.h"

#include <sched.h>

#include <atomic>
#include <cstdint>
#include <ctime>

namespace tensorverbs {
namespace {

// Until when (CLOCK_MONOTONIC, ns) yields count as costly; 0: they do not.
std::atomic<int64_t> costly_until_ns{0};

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
    costly_until_ns.store(after + absl::ToInt64Nanoseconds(kCostlyFor), std::memory_order_relaxed);
  }
}

}  // namespace tensorverbs
