// The libfabric backend: FI_EP_RDM endpoints on any provider that offers RMA with remote CQ
// data (shm, tcp;ofi_rxm here; verbs;ofi_rxm, efa, cxi, psm3 on real NICs).
//
// Provider differences are absorbed here: virtual vs offset addressing (the packed key carries
// the region base), provider vs application keys, FI_MR_LOCAL descriptors, FI_RX_CQ_DATA
// (receives kept posted), manual progress (Poll drives it), and send queue limits (posts beyond
// the queue depth or refused with -FI_EAGAIN are queued and retried). A domain's endpoints share
// one libfabric endpoint and completion queue where the provider carries 8 bytes of CQ data: an
// incoming immediate finds its endpoint by the id its writer put in the upper half (tcp;ofi_rxm
// has no FI_SOURCE), and one that names a closed endpoint is dropped (ofi_internal.h). Because
// these providers do not report a dead peer or a write to a bad key, ranges are validated before
// posting and every operation is bounded by DomainOptions::op_timeout. Wait blocks in poll() on
// the CQs' wait fds after fi_trywait; shm (libfabric 1.17) offers no fd wait object, so there
// Wait sleeps 50 µs and returns.
//
// Threading: as every Domain (see fabric.h).
#ifndef TENSORVERBS_FABRIC_OFI_OFI_H_
#define TENSORVERBS_FABRIC_OFI_OFI_H_

#include <memory>
#include <string>
#include <vector>

#include "src/fabric/fabric.h"

namespace tensorverbs::fabric::ofi {

// Opens `options.provider` ("shm", "tcp;ofi_rxm", ...; fabric::OpenDomain fills it with the
// policy's pick when the caller names none). Unavailable, with fi_getinfo's reason, when the
// provider cannot be used here.
absl::StatusOr<std::unique_ptr<Domain>> OpenOfiDomain(const DomainOptions& options);

// Providers that offer RDM endpoints with RMA and remote CQ data on this host, one line each:
// "name (fabric, fabric, ...)", for `tensorverbs info`.
std::vector<std::string> ListUsableProviders();
// The same, limited to providers that also report FI_HMEM (device memory) with `device_memory`.
std::vector<std::string> ListProviders(bool device_memory);

// libfabric endpoints this process holds open: one per domain whose endpoints share it, one per
// endpoint otherwise (see ofi_internal.h).
int64_t OpenPorts();
// Immediates this process's ports dropped because the endpoint they named had closed.
int64_t LateImmediatesDropped();
// Peers this process's domains hold address vector entries (over rxm, connections) for: one per
// domain and peer provider endpoint that at least one endpoint is connected to.
int64_t PeerAddresses();

}  // namespace tensorverbs::fabric::ofi

#endif  // TENSORVERBS_FABRIC_OFI_OFI_H_
