// The same-host fabric: one-sided writes and reads between processes on one machine by plain
// memory copies, with no kernel copy and no provider in between.
//
// Memory that comes from SharedMemory (the pool allocator's regions when this fabric is chosen,
// every message buffer) is registered as shareable: a peer maps its memfd once, on first use,
// and a write is one copy through that mapping straight into the receiver's tensor (from 4 MiB
// with streaming stores, from 8 MiB shared with the domain's copy threads:
// DomainOptions::copy_threads, CopyHelpers in copy.h; from 512 KiB below that, shared with the
// receiving process's progress thread, which copies parts into its own memory: DomainOptions::
// peer_copy, SharedWrite in wire.h, shared_writes.h). Any other
// registered memory is reached with the kernel's cross-memory copy (process_vm_writev/readv),
// so every destination works; the two paths are counted separately (CopyCounters).
//
// With DomainOptions::device_memory (CUDA IPC), GPU memory registers too
// (RegisterDeviceMemory): its key carries no memfd but names a device region, whose exported
// handle a peer asks for once and imports; every operation with GPU memory on either side is an
// asynchronous device copy, polled by the progress thread, and a write's immediate is published
// only once its copy (and every operation posted before it) completed. Device copies start at
// once, past host operations queued ahead of them, so a device write's bytes may land, and a
// device read may read, before an earlier host write's (never the same memory in the protocol,
// which reads only what the peer lent it); completions keep posting order.
// Peers' host regions that device copies reach are page-locked once, so those copies run by DMA
// too. Between GPU memory and a peer's private memory the bytes go through a page-locked bounce
// buffer of the endpoint and the cross-memory copy, one such operation at a time.
//
// Each endpoint owns an inbound ring of immediates in a memfd that its one peer maps: a write
// with immediate is copy, then publish {imm, length} with release ordering, so completions
// arrive in posting order with the data visible. Waiting is an eventfd doorbell per domain that
// a writer rings only when the reader declared it is about to sleep, so blocking and adaptive
// progress sleep without napping and wake in microseconds.
//
// Descriptors travel over a Unix socket in the abstract namespace (SCM_RIGHTS), served by one
// thread per domain: a peer says which endpoint it connects to and receives that ring and the
// doorbell, then asks for a region's memfd the first time a key names it. The socket needs no
// ptrace permission (pidfd_getfd would), leaves no file behind, and its closing is how a dead or
// departed peer is noticed: its endpoint's posts fail from then on, within microseconds.
//
// Threading: as every Domain (see fabric.h); the descriptor server runs on its own thread and
// shares only the endpoint and region tables (under a mutex) and per-endpoint atomics.
#ifndef TENSORVERBS_FABRIC_SHMEM_SHMEM_H_
#define TENSORVERBS_FABRIC_SHMEM_SHMEM_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "src/fabric/fabric.h"

namespace tensorverbs::fabric::shmem {

absl::StatusOr<std::unique_ptr<Domain>> OpenShmemDomain(const DomainOptions& options);

// Bytes moved by each path, over the process's lifetime (every shmem domain adds to them).
struct CopyCounters {
  std::atomic<uint64_t> mapped_ops{0};
  std::atomic<uint64_t> mapped_bytes{0};
  std::atomic<uint64_t> cross_memory_ops{0};
  std::atomic<uint64_t> cross_memory_bytes{0};
  std::atomic<uint64_t> regions_mapped{0};
  // Windows of a peer's mapped regions whose page tables were made (PeerMappings), and their
  // bytes: what this process's mappings of its peers' pools cost it.
  std::atomic<uint64_t> windows_populated{0};
  std::atomic<uint64_t> bytes_populated{0};
  // Of those, windows whose page tables were given back to keep an endpoint within
  // DomainOptions::peer_window_bytes.
  std::atomic<uint64_t> windows_released{0};
  std::atomic<uint64_t> device_ops{0};  // moved by device copies (DomainOptions::device_memory)
  std::atomic<uint64_t> device_bytes{0};
  std::atomic<uint64_t> device_regions_imported{0};
  // Of device_ops, those between GPU memory and a peer's private memory, through a bounce
  // buffer (the kernel's cross-memory copy cannot reach GPU memory).
  std::atomic<uint64_t> device_bounced_ops{0};
  // Of mapped_ops, the writes offered to the peer to share (SharedWrite), and those of them the
  // peer took parts of; and the bytes this process copied into its own memory for its peers'.
  std::atomic<uint64_t> shared_write_ops{0};
  std::atomic<uint64_t> shared_write_helped_ops{0};
  std::atomic<uint64_t> shared_write_bytes_copied{0};
};
CopyCounters& Counters();

}  // namespace tensorverbs::fabric::shmem

#endif  // TENSORVERBS_FABRIC_SHMEM_SHMEM_H_
