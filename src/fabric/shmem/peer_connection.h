// PeerConnection: a ShmemEndpoint's link to its one peer. It holds the connection to the peer's
// descriptor server (asked for the peer's ring and regions), who the peer is (user, pid,
// pidfd), the peer's doorbell and our mapping of the peer's inbound ring, into which we publish
// immediates, and whether the connection can still be trusted (broken()).
//
// Owned by ShmemEndpoint and used by it and by its other parts (PeerMappings asks for regions,
// DeviceCopyQueue and SharedWrites check it is usable and break it), all on the progress thread.
// It takes no lock and calls nothing back. Close() releases what Open acquired; the destructor
// releases nothing, so the endpoint decides when (after its device copies finished). A broken
// connection stays broken, even across a failed Open: every later operation fails with why.
#ifndef TENSORVERBS_FABRIC_SHMEM_PEER_CONNECTION_H_
#define TENSORVERBS_FABRIC_SHMEM_PEER_CONNECTION_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "src/fabric/shmem/domain_state.h"
#include "src/fabric/shmem/pending_op.h"
#include "src/fabric/shmem/wire.h"

namespace tensorverbs::fabric::shmem {

class PeerConnection {
 public:
  // `d` and `shared` are the endpoint's and outlive this.
  PeerConnection(DomainState& d, EndpointShared& shared) : d_(d), shared_(shared) {}
  PeerConnection(const PeerConnection&) = delete;
  PeerConnection& operator=(const PeerConnection&) = delete;

  // Connects to endpoint `id` of domain `uid` (the peer's address, for errors): asks its
  // descriptor server for its ring and doorbell and maps the ring. On failure the caller
  // releases what was acquired (Close).
  absl::Status Open(uint64_t uid, uint64_t id, absl::string_view peer_address);

  // Releases everything Open acquired; unconnected afterwards. broken() stays as it was.
  void Close();

  bool connected() const { return conn_fd_ >= 0; }
  int conn_fd() const { return conn_fd_; }
  uint64_t peer_uid() const { return peer_uid_; }
  pid_t peer_pid() const { return peer_pid_; }
  // Whether Break was called: the connection can no longer be trusted.
  bool broken() const { return !broken_.ok(); }

  // The endpoint's own address, as ShmemEndpoint::LocalAddress, for errors.
  std::string LocalAddress() const;

  // One request to the peer's descriptor server, answered at once or within the socket
  // timeout. A failure to get the answer breaks the connection: a late answer would otherwise
  // be read as the answer to the next request.
  // `reply` starts a message of `reply_bytes` (a Reply, or a DeviceRegionReply).
  absl::Status Ask(RequestType type, uint64_t id, Reply* reply, int* fds, int max_fds, int* nfds,
                   size_t reply_bytes = sizeof(Reply));

  // From now on every operation fails with `status`: the connection to the peer can no longer
  // be trusted (it hung up, timed out, or answered something else than what was asked).
  // Returns the first status it was broken with.
  absl::Status Break(absl::Status status);

  // OK while the peer may be written to.
  absl::Status Usable() const;

  absl::Status PeerGone() const;

  // Whether our connection to the peer's descriptor server has closed: then the peer process
  // is gone even if it never connected back to us (which is how we usually learn it).
  void CheckConnection();

  // `op` between `local` (host memory here) and the peer's private memory: the kernel's
  // cross-memory copy. The pidfd check first, so a recycled pid can never receive the bytes.
  absl::Status CrossMemory(const PendingOp& op, char* local, size_t offset, size_t length);

  // The peer's ring has no room for another immediate.
  bool RingFull() const;
  // The peer moved its ring's head past what we published: it cannot be trusted.
  bool RingInconsistent() const;

  // Publishes immediate {imm, byte_len} in the peer's ring, ringing its doorbell if it sleeps.
  void Publish(uint32_t imm, uint64_t byte_len);

  // The peer's inbound ring as we map it (null while unconnected), and its inode, which the
  // peer's side of the ring has too (SharedWrites tells TSan their order by it).
  RingHeader* out() const { return out_; }
  uint64_t out_ring_inode() const { return out_ring_inode_; }

 private:
  DomainState& d_;
  EndpointShared& shared_;

  int conn_fd_ = -1;
  uint64_t peer_uid_ = 0;
  pid_t peer_pid_ = 0;
  int peer_pidfd_ = -1;
  int peer_bell_fd_ = -1;
  RingHeader* out_ = nullptr;
  size_t out_bytes_ = 0;
  uint32_t out_capacity_ = 0;
  uint64_t out_tail_ = 0;
  uint64_t out_ring_inode_ = 0;
  absl::Status broken_;
};

}  // namespace tensorverbs::fabric::shmem

#endif  // TENSORVERBS_FABRIC_SHMEM_PEER_CONNECTION_H_
