// libfabric's shm provider keeps its regions in /dev/shm under names that start with
// "<pid>:" and unlinks them when the process closes its endpoints. A SIGKILLed process never
// does, so tests that kill a peer remove its regions for it (support::Subprocess does for the
// children it kills); tests that check shm cleans up count only their own process's regions,
// since other tests may run beside them.
#ifndef TENSORVERBS_TESTS_SUPPORT_SHM_REGIONS_H_
#define TENSORVERBS_TESTS_SUPPORT_SHM_REGIONS_H_

#include "src/support/process_util.h"

namespace tensorverbs::testing {

using support::ShmRegionsOf;
using support::UnlinkShmRegionsOf;

}  // namespace tensorverbs::testing

#endif  // TENSORVERBS_TESTS_SUPPORT_SHM_REGIONS_H_
