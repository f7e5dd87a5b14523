// Reads what RDMA hardware the host has — devices, ports, link layers, MTUs and valid GIDs —
// through libibverbs, for device selection and `tensorverbs info`.
//
// On a host without RDMA support (no device, or a kernel without the InfiniBand stack, where
// ibv_get_device_list fails with ENOSYS) it returns Unavailable with the reason. Without
// libibverbs at build time it returns Unavailable saying so. Any thread.
#ifndef TENSORVERBS_FABRIC_IBVERBS_INVENTORY_H_
#define TENSORVERBS_FABRIC_IBVERBS_INVENTORY_H_

#include "absl/status/statusor.h"
#include "src/fabric/ibverbs/device_selection.h"

namespace tensorverbs::fabric::ibverbs {

absl::StatusOr<Inventory> ReadInventory();

}  // namespace tensorverbs::fabric::ibverbs

#endif  // TENSORVERBS_FABRIC_IBVERBS_INVENTORY_H_
