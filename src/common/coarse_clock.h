// CoarseNow: the wall clock at the kernel tick's resolution (CLOCK_REALTIME_COARSE: a few
// milliseconds), for deadlines of seconds that hot loops check on every turn. It reads the
// vDSO's last tick without the cycle counter, several times cheaper than absl::Now(), and is
// comparable with absl::Now() to within one tick. Any thread.
#ifndef TENSORVERBS_COMMON_COARSE_CLOCK_H_
#define TENSORVERBS_COMMON_COARSE_CLOCK_H_

#include <time.h>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tensorverbs {

inline absl::Time CoarseNow() {
  timespec ts;
  if (clock_gettime(CLOCK_REALTIME_COARSE, &ts) != 0) return absl::Now();
  return absl::TimeFromTimespec(ts);
}

// How far CoarseNow moves at a time (the kernel tick, 4 ms at HZ=250), or 1 ms if the kernel
// does not say.
inline absl::Duration CoarseClockGrain() {
  static const absl::Duration grain = [] {
    timespec ts;
    if (clock_getres(CLOCK_REALTIME_COARSE, &ts) != 0) return absl::Milliseconds(1);
    return absl::DurationFromTimespec(ts);
  }();
  return grain;
}

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_COARSE_CLOCK_H_
