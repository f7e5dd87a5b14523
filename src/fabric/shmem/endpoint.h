// ShmemEndpoint: one end of a connection of the same-host fabric (shmem.h says how the fabric
// works). The domain (shmem.cc) creates it and drives it from its progress thread: every
// method runs there, except that the descriptor server (domain_state.cc) finds it through
// DomainState and touches only its EndpointShared. It owns its inbound ring, its mappings of
// the peer's regions, the peer's GPU allocations it imported and its bounce buffer, and
// releases them when destroyed, after the device copies it started have finished.
// Completions go to DomainState::local in posting order, one per operation.
//
// endpoint.cc is the connection and the host data path; shared_write.cc the writes whose copy
// the peer's progress thread shares (both sides of it); endpoint_device.cc the device copies
// (DomainOptions::device_memory).
#ifndef TENSORVERBS_FABRIC_SHMEM_ENDPOINT_H_
#define TENSORVERBS_FABRIC_SHMEM_ENDPOINT_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/fabric/device_memory.h"
#include "src/fabric/endpoint_base.h"
#include "src/fabric/shmem/domain_state.h"
#include "src/fabric/shmem/region.h"
#include "src/fabric/shmem/shmem.h"
#include "src/fabric/shmem/wire.h"

namespace tensorverbs::fabric::shmem {

// Mappings of a peer's regions kept per endpoint; the oldest goes first beyond.
inline constexpr size_t kMaxMappingsPerEndpoint = 256;
// A bounced operation (GPU memory and a peer's private memory) moves in chunks of at most this
// many bytes, so its buffer stays small and page-locked once.
inline constexpr size_t kMaxBounceBytes = size_t{8} << 20;
// Writes of at least this many bytes into a peer's mapping use non-temporal stores. Measured
// (docs/PERFORMANCE.md): into destinations the writer has not touched lately
// (bench/copy_bench.cc) streaming stores beat memcpy at every size from 64 KiB, 1.3x at
// 4-64 MiB; but into a destination still in cache, as a pool chunk reused at once often is,
// memcpy won at 1 MiB (`bench fabric`: 0.72x memcpy streaming, 1.06x plain). From twice a
// core's L2 up a destination cannot be in that cache anyway.
inline constexpr size_t kStreamingCopyBytes = size_t{4} << 20;
// Host writes of at least this many bytes (and below what CopyHelpers shares) are offered to
// the peer to copy part of (SharedWrite): its progress thread, polling anyway on another core,
// copies parts into its own memory while this one copies the rest. At 256 KiB sharing cost
// more than it saved (docs/PERFORMANCE.md: the single recv's latency 7 -> 12 us).
inline constexpr size_t kMinSharedWriteBytes = size_t{512} << 10;
// A shared write's parts: at least this many bytes, and at most kMaxSharedWriteParts of them.
inline constexpr size_t kMinSharedWritePart = size_t{64} << 10;
inline constexpr uint32_t kMaxSharedWriteParts = 8;

class ShmemEndpoint final : public EndpointBase {
 public:
  ShmemEndpoint(std::shared_ptr<DomainState> d, std::shared_ptr<EndpointShared> shared,
                absl::Duration op_timeout);

  ~ShmemEndpoint() override;

  std::string LocalAddress() const override;

  absl::Status Connect(absl::string_view peer_address) override;

  size_t Outstanding() const override { return outstanding_; }

  // Progress thread: runs queued operations, so what waits for room in the peer's ring goes
  // as soon as there is some, or fails when the peer is gone or the operation too old. Device
  // copies start as soon as they are queued and complete in posting order with the rest: an
  // immediate is published once the copies posted before it are done.
  void RunPending();

  // Moves up to out.size() immediates that arrived into `out`.
  size_t TakeInbound(absl::Span<Completion> out);

  // Whether our connection to the peer's descriptor server has closed: then the peer process
  // is gone even if it never connected back to us (which is how we usually learn it).
  void CheckConnection();

  int conn_fd() const { return conn_fd_; }
  bool HasInbound() const;
  bool HasPending() const { return !pending_.empty(); }
  // Device copies this endpoint has running.
  int device_copies() const { return device_copies_; }
  void SetSleeping(uint32_t v) { Atomic(in_->sleeping).store(v, std::memory_order_seq_cst); }
  // Progress thread, each Poll: copies the parts of the peer's shared write into our memory that
  // the peer has not claimed yet, if it offered one (SharedWrite). A write it describes wrongly
  // (a destination that is not our shareable, remotely writable memory; a source outside its
  // key) is left to the peer to copy alone.
  void HelpWithSharedWrite();
  void Delivered() { --outstanding_; }

 protected:
  absl::Status Post(CompletionKind kind, bool with_imm, uint32_t imm, const LocalBuffer& local,
                    const RemoteBuffer& remote, uint64_t context) override;

 private:
  // An operation's device copy: not started, running on the GPU, done, or refused.
  enum class Phase { kQueued, kCopying, kCopied, kFailed };
  struct Op {
    CompletionKind kind;
    bool with_imm;
    uint32_t imm;
    char* local;
    size_t length;
    PackedKey key;
    uint64_t remote_addr;
    uint64_t context;
    absl::Time posted;
    const ShmemRegion* local_region = nullptr;  // where the local buffer is registered
    int local_device = -1;  // the local buffer is GPU memory of this ordinal
    bool device = false;    // either side is GPU memory: a device copy moves the bytes
    Phase phase = Phase::kQueued;
    uint64_t ticket = 0;
    absl::Status error;  // kFailed
    // GPU memory and the peer's private memory: the bytes go through the bounce buffer, a
    // chunk at a time; the chunk in flight is [bounce_done, bounce_done + bounce_chunk).
    bool bounce = false;
    size_t bounce_done = 0;
    size_t bounce_chunk = 0;
    int copy_device = 0;  // the GPU that runs the copies
  };
  struct Mapping {
    void* addr;
    size_t map_length;
    uint64_t delta;  // remote address + delta = local address
    PackedKey key;   // the key it was mapped for: base, length and offset must match
    bool writable;
    uint64_t order;  // for eviction: the oldest mapping goes first
    bool pinned;     // page-locked for device copies
  };
  // A peer's GPU allocation, imported into this process.
  struct DeviceMapping {
    void* base;
    PackedKey key;  // the key it was imported for: base and length must match
    int device;     // the ordinal it was imported on
  };
  // At most this many device copies in flight per endpoint.
  static constexpr int kMaxDeviceCopies = 64;

  absl::Status PeerGone() const;

  // OK while the peer may be written to.
  absl::Status Usable() const;

  // From now on every operation fails with `status`: the connection to the peer can no longer
  // be trusted (it hung up, timed out, or answered something else than what was asked).
  absl::Status Break(absl::Status status);

  absl::Status ConnectTo(uint64_t uid, uint64_t id, absl::string_view peer_address);

  // Releases everything Connect acquired; the endpoint is unconnected afterwards.
  void Disconnect();

  // One request to the peer's descriptor server, answered at once or within the socket
  // timeout. A failure to get the answer breaks the endpoint: a late answer would otherwise
  // be read as the answer to the next request.
  // `reply` starts a message of `reply_bytes` (a Reply, or a DeviceRegionReply).
  absl::Status Ask(RequestType type, uint64_t id, Reply* reply, int* fds, int max_fds, int* nfds,
                   size_t reply_bytes = sizeof(Reply));

  // Where region `key` is mapped here, mapping it on first use.
  absl::StatusOr<Mapping*> MapRegion(const PackedKey& key);

  void Unmap(const Mapping& m);

  // Where the peer's GPU region `key` is in this process, importing it on first use.
  absl::StatusOr<const DeviceMapping*> MapDevice(const PackedKey& key, int device);

  // The peer's side of a device copy.
  absl::StatusOr<DeviceMemory::Side> RemoteSide(const Op& op, int device);

  // Starts `op`'s device copy: kCopying, or kFailed with the reason.
  void StartDeviceCopy(Op& op);

  // Local GPU memory and the peer's private memory (a region that is not from its pool): the
  // kernel's cross-memory copy cannot reach GPU memory, so the bytes go through this endpoint's
  // page-locked bounce buffer, one operation at a time, in chunks of at most kMaxBounceBytes. A
  // write copies a chunk device-to-host into it, then (PollDeviceCopies) to the peer; a read
  // copies a chunk from the peer into it, then host-to-device. Leaves `op` queued while an
  // earlier operation holds the buffer.
  void StartBouncedCopy(Op& op, int device);

  // A bounce buffer of at least `bytes` (at most kMaxBounceBytes are asked for), page-locked
  // where the runtime allows (else its copies are synchronous, and still correct). It grows to
  // the largest chunk and stays until the endpoint closes.
  absl::Status EnsureBounce(size_t bytes);

  void ReleaseBounce();

  // A bounced operation's chunk copy ended with `copied`: a write's chunk goes on to the peer
  // if it succeeded and the peer may still be written (a failed copy left nothing worth
  // sending), and the next chunk starts. Returns the operation's outcome so far.
  absl::Status FinishBounceChunk(Op& op, absl::Status copied);
  // Starts the device copy of bounced `op`'s next chunk (a read brings it from the peer first).
  absl::Status StartBounceChunk(Op& op);

  // Starts every queued device copy, up to kMaxDeviceCopies running, also past host operations
  // queued ahead of them (control messages between tensors): the GPU then runs one copy after
  // another with no gap for the completions in between. Completions and immediates still go in
  // posting order (RunPending); only the bytes of a device write may land before those of a host
  // write posted earlier, which the protocol never aims at the same memory.
  void StartDeviceCopies();

  // Moves every finished device copy on (kCopied, or kFailed with its error), wherever it is in
  // the queue: device_copies_ counts the copies the GPU still runs, so a copy that finished
  // behind a host write waiting for ring room no longer keeps the progress thread polling.
  void PollDeviceCopies();

  // Waits (up to 10 s) for the device copies still running, at teardown. Memory a copy that
  // never finished may still touch is then left mapped and imported: a leak, not a fault.
  void DrainDeviceCopies();

  absl::Status DeviceError(const Op& op, const absl::Status& s) const;

  absl::Status Copy(const Op& op);

  // Whether host write `op` is offered to the peer to share (kMinSharedWriteBytes says why):
  // its source is our shareable memory, and the peer is polling (not asleep on its doorbell).
  bool ShouldShare(const Op& op) const;
  // Writes `op`'s bytes to `there` (our mapping of the peer's memory) with the peer: publishes
  // the job in the peer's ring, copies every part the peer has not claimed, and waits for the
  // parts it did. The peer then reads the source through a read-only mapping of its region,
  // lent to this endpoint's peer alone (EndpointShared::lent_for_reading).
  absl::Status SharedCopy(const Op& op, char* there);
  // Waits for `parts` parts of a shared write the peer claimed; fails if the peer goes or
  // takes longer than the operation timeout.
  absl::Status AwaitPeerParts(uint64_t parts);

  // `op` between `local` (host memory here) and the peer's private memory: the kernel's
  // cross-memory copy. The pidfd check first, so a recycled pid can never receive the bytes.
  absl::Status CrossMemory(const Op& op, char* local, size_t offset, size_t length);

  bool RingFull() const;

  void Publish(uint32_t imm, uint64_t byte_len);

  void Complete(const Op& op, absl::Status status);

  const absl::Duration op_timeout_;
  std::shared_ptr<DomainState> d_;
  std::shared_ptr<EndpointShared> shared_;
  RingHeader* const in_;
  uint64_t in_head_ = 0;
  bool ring_broken_ = false;

  int conn_fd_ = -1;
  uint64_t peer_uid_ = 0;
  pid_t peer_pid_ = 0;
  int peer_pidfd_ = -1;
  int peer_bell_fd_ = -1;
  RingHeader* out_ = nullptr;
  size_t out_bytes_ = 0;
  uint32_t out_capacity_ = 0;
  uint64_t out_tail_ = 0;
  absl::Status broken_;

  std::deque<Op> pending_;
  size_t outstanding_ = 0;
  std::map<uint64_t, Mapping> mappings_;
  uint64_t mapping_order_ = 0;
  // By (region, the local device it was imported on).
  std::map<std::pair<uint64_t, int>, DeviceMapping> device_mappings_;
  bool leak_device_memory_ = false;  // a copy never finished: keep what it may touch
  int device_copies_ = 0;
  // The bounce buffer between GPU memory and peers' private memory (StartBouncedCopy).
  char* bounce_ = nullptr;
  size_t bounce_bytes_ = 0;
  bool bounce_pinned_ = false;
  bool bounce_busy_ = false;
  // Shared writes: the sequence number of our last one, and the last one of the peer's we
  // refused to help with.
  uint64_t share_seq_ = 0;
  uint64_t refused_seq_ = 0;
  // The inodes of our inbound ring and of the peer's: the same ring has the same one on both
  // sides, which SharedCopy and HelpWithSharedWrite tell TSan their order by.
  uint64_t in_ring_inode_ = 0;
  uint64_t out_ring_inode_ = 0;
};

}  // namespace tensorverbs::fabric::shmem

#endif  // TENSORVERBS_FABRIC_SHMEM_ENDPOINT_H_
