// The ibverbs backend (rdma-core): RC queue pairs on an InfiniBand or RoCE NIC.
//
// The device, port, GID and MTU come from SelectDevice over the host's inventory and the seed's
// RDMA_* variables; QPs move INIT -> RTR -> RTS with RDMA_QP_* attributes (timeout, retry
// count, SL, traffic class, pkey index, MTU). Each endpoint is one RC QP with its own CQ, so
// completions are attributed without a QP-number lookup; a receive is kept posted for every
// write with immediate the peer may send. Posting beyond RDMA_QP_QUEUE_DEPTH queues (send
// credits). Asynchronous events are read without blocking from the progress thread inside
// Poll; a fatal QP event fails that endpoint's operations, a fatal device or port event the
// domain's. On a host without RDMA, OpenIbverbsDomain is Unavailable with the reason.
//
// Threading: as every Domain (see fabric.h).
#ifndef TENSORVERBS_FABRIC_IBVERBS_IBVERBS_H_
#define TENSORVERBS_FABRIC_IBVERBS_IBVERBS_H_

#include <memory>

#include "src/common/config.h"
#include "src/fabric/fabric.h"

namespace tensorverbs::fabric::ibverbs {

// The queue depth is the smaller of `options.queue_depth` and RDMA_QP_QUEUE_DEPTH (default 1024).
absl::StatusOr<std::unique_ptr<Domain>> OpenIbverbsDomain(const DomainOptions& options,
                                                          const RdmaConfig& config);

}  // namespace tensorverbs::fabric::ibverbs

#endif  // TENSORVERBS_FABRIC_IBVERBS_IBVERBS_H_
