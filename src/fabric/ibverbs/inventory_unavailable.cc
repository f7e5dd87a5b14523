// ReadInventory for builds without libibverbs.
#include "src/fabric/ibverbs/inventory.h"

namespace tensorverbs::fabric::ibverbs {

absl::StatusOr<Inventory> ReadInventory() {
  return absl::UnavailableError(
      "ibverbs: this build has no libibverbs (install libibverbs-dev and rebuild)");
}

}  // namespace tensorverbs::fabric::ibverbs
