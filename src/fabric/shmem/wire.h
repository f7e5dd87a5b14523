// The shmem fabric's wire: what two processes share and say to each other. The packed remote
// key, the descriptor server's requests and replies, the layout of an endpoint's inbound ring
// in shared memory, and the socket helpers that carry descriptors (SCM_RIGHTS) and tell who is
// on the other end. Used by the shmem fabric's files only; stateless, any thread.
#ifndef TENSORVERBS_FABRIC_SHMEM_WIRE_H_
#define TENSORVERBS_FABRIC_SHMEM_WIRE_H_

#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "src/common/unix_socket.h"

namespace tensorverbs::fabric::shmem {

constexpr uint32_t kKeyMagic = 0x314b5654;      // "TVK1"
constexpr uint32_t kRingMagic = 0x32525654;     // "TVR2"
constexpr uint32_t kRequestMagic = 0x31515654;  // "TVQ1"
constexpr uint32_t kReplyMagic = 0x31505654;    // "TVP1"
constexpr uint32_t kKeyShared = 1u << 0;        // the region lives in a memfd a peer can map
constexpr uint32_t kKeyDevice = 1u << 1;        // the region is GPU memory, exported by IPC
constexpr size_t kMaxDeviceHandle = 128;        // bytes of an exported device allocation
constexpr uint32_t kRingCapacity = 4096;        // immediates in flight per endpoint
constexpr absl::Duration kSocketTimeout = absl::Seconds(10);

// The packed remote key. `offset` is where `base` lies in the region's memfd.
struct PackedKey {
  uint32_t magic;
  uint32_t flags;
  uint64_t domain;
  uint64_t region;
  uint64_t base;
  uint64_t length;
  uint64_t offset;
  uint32_t access;
  uint32_t device;  // kKeyDevice: the owner's ordinal of the GPU the region is on
};
static_assert(sizeof(PackedKey) == 56);

// kDeviceRegion: the exported handle of a device region, in a DeviceRegionReply.
enum RequestType : uint32_t { kHello = 1, kRegion = 2, kDeviceRegion = 3 };
struct Request {
  uint32_t magic;
  uint32_t type;
  uint64_t id;  // kHello: the endpoint connected to; kRegion: the region
};
enum ReplyStatus : uint32_t {
  kOk = 0,
  kNoSuchEndpoint = 1,
  kEndpointTaken = 2,
  kNoSuchRegion = 3,
  kNotShared = 4,
  kNoAccess = 5,
  kNotConnected = 6,
  kNotDevice = 7,
};
struct Reply {
  uint32_t magic;
  uint32_t status;
  uint32_t type;      // of the request answered, with its id: a late answer is never taken for
  uint32_t capacity;  // kHello: ring entries                  another request's
  uint64_t id;
  uint64_t size;    // kHello: ring segment bytes; kRegion: memfd bytes
  uint32_t access;  // kRegion
  uint32_t reserved;
};

struct DeviceRegionReply {
  Reply reply;  // size: the region's bytes
  uint32_t device;
  uint32_t handle_size;
  char handle[kMaxDeviceHandle];
};

// A write the producer offers to share with the consumer (SharedWrites::Copy): its
// bytes in `parts` parts that either side claims, one at a time, by advancing `state`, so the
// consumer's progress thread, polling anyway, copies some of them into its own memory while the
// producer copies the rest. `state` is (seq << 32) | the next unclaimed part; the producer
// writes the other fields, then `state` with a new seq, and rewrites them only once every part
// of that seq is claimed and `done`: a claim that succeeded therefore read this job's fields.
// `done` counts the parts the consumer finished (the producer resets it before each job).
struct SharedWrite {
  alignas(64) uint64_t state;
  uint64_t src_key[sizeof(PackedKey) / 8];  // the producer's key of the region the bytes leave
  uint64_t src_addr;                        // producer's address
  uint64_t dst_region;                      // the consumer's region the bytes go to
  uint64_t dst_addr;                        // consumer's address
  uint64_t length;
  uint32_t part;  // bytes per part (the last may be shorter)
  uint32_t parts;
  uint32_t streaming;  // 1: non-temporal stores (the size the producer would use them at)
  uint32_t reserved;
  alignas(64) uint64_t done;
};

// The inbound ring of one endpoint, in shared memory. The producer (the peer's endpoint) owns
// `tail`, the consumer (this endpoint) `head` and `sleeping`; each is on its own cache line.
struct RingHeader {
  uint32_t magic;
  uint32_t capacity;
  alignas(64) uint64_t tail;
  alignas(64) uint64_t head;
  alignas(64) uint32_t sleeping;  // 1: the consumer may block on its doorbell; ring it
  SharedWrite share;
};
struct RingEntry {
  uint32_t imm;
  uint32_t reserved;
  uint64_t byte_len;
};
constexpr size_t kRingBytes = sizeof(RingHeader) + size_t{kRingCapacity} * sizeof(RingEntry);

// Atomics shared between processes must not fall back to a lock inside one process.
static_assert(std::atomic_ref<uint64_t>::is_always_lock_free);
static_assert(std::atomic_ref<uint32_t>::is_always_lock_free);

template <typename T>
inline std::atomic_ref<T> Atomic(T& field) {
  return std::atomic_ref<T>(field);
}

inline RingEntry* Entries(RingHeader* h) { return reinterpret_cast<RingEntry*>(h + 1); }

std::string ReplyText(uint32_t status);

std::string SocketName(uint64_t uid);
// The abstract-namespace address of domain `uid`'s descriptor server.
sockaddr_un SocketAddress(uint64_t uid, socklen_t* len);
// Send and receive timeouts of kSocketTimeout.
void SetTimeouts(int fd);
using ::tensorverbs::PeerCredentials;
using ::tensorverbs::RecvWithFds;
using ::tensorverbs::SendWithFds;
int PidfdOpen(pid_t pid);
// The size of a memfd a peer sent, if it is one we can map without risk: sealed against
// shrinking (so our accesses can never fault past its end) and at least `needed` bytes.
absl::StatusOr<uint64_t> CheckPeerMemory(int fd, uint64_t needed, absl::string_view what);

}  // namespace tensorverbs::fabric::shmem

#endif  // TENSORVERBS_FABRIC_SHMEM_WIRE_H_
