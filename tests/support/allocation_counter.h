// Counts the heap allocations (operator new) of every thread of the binary while counting is
// on. allocation_counter.cc replaces the global operator new and delete, so it is compiled into
// the one binary that wants counts (a test or a benchmark) and into no library; sanitizer
// builds, whose allocators count differently, should not use it. Any thread.
#ifndef TENSORVERBS_TESTS_SUPPORT_ALLOCATION_COUNTER_H_
#define TENSORVERBS_TESTS_SUPPORT_ALLOCATION_COUNTER_H_

#include <cstdint>

namespace tensorverbs::testing {

// Resets the count to zero and counts from now on.
void StartCountingAllocations();
// Stops counting; returns the allocations counted since the start.
int64_t StopCountingAllocations();

}  // namespace tensorverbs::testing

#endif  // TENSORVERBS_TESTS_SUPPORT_ALLOCATION_COUNTER_H_
