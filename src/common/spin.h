// SpinYield: one pause of a bounded spin-wait for something another thread or process of this
// host is about to do (a peer's answer, a rank reaching a barrier). Any thread; no state but a
// process-wide record of how the last yields went.
//
// A spinning thread yields its core, because on a machine where the threads that would act share
// the cores, a yield lets them run now rather than at the scheduler's next tick. That holds while
// the other runnable threads block soon (ours do). Beside a thread that never blocks (another
// job's computation, a busy loop) a yield hands it the core for a whole time slice, milliseconds.
// So each yield is timed: two that return later than kCostlyYield within 50 ms mark yields
// costly for kCostlyFor, during which SpinYield pauses the core instead and spin-waits should end
// soon and block in the kernel (YieldsAreCostly), where a wake-up gets the core back at once.
#ifndef TENSORVERBS_COMMON_SPIN_H_
#define TENSORVERBS_COMMON_SPIN_H_

#include "absl/time/time.h"

namespace tensorverbs {

inline constexpr absl::Duration kCostlyYield = absl::Microseconds(1000);
inline constexpr absl::Duration kCostlyFor = absl::Seconds(1);
// The longest a spin-wait goes on while yields are costly: about a core-to-core hand-off, so a
// thread on another core that is about to act is still caught.
inline constexpr absl::Duration kSpinWhileCostly = absl::Microseconds(5);

// Yields the core, or pauses it while yields are costly. Reads the clock twice when it yields.
void SpinYield();

// Whether a yield returned late within the last kCostlyFor: spin-waits should be short.
bool YieldsAreCostly();

// A pause instruction: tells the core this thread spins.
inline void CpuPause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_SPIN_H_
