// The fabric boundary: the RDMA operations the grpc+verbs protocol needs, behind one interface
// with several backends (loopback, shmem, ofi, ibverbs).
//
// A Domain is one opened NIC / provider. It registers memory (MemoryRegion), creates endpoints
// (one per peer), and reports completions through Poll(). An Endpoint is a reliable connection
// to one peer: PostWrite, PostWriteWithImm and PostRead are one-sided operations on the peer's
// registered memory, named by a RemoteBuffer whose key is the opaque bytes the peer's
// MemoryRegion::PackRemoteKey() produced. Nothing above this layer interprets keys or addresses.
//
// Threading: a Domain, its endpoints and its regions are used from one thread at a time — the
// domain's progress thread. Poll() never blocks. Registration may be called from any thread
// that the owner serializes with the progress thread (the pool allocator's visitor does).
//
// Contract: a Post* that returns OK produces exactly one completion (kind kWrite or kRead, with
// the caller's context) from Poll(), successful or not; a Post* that returns an error produced
// nothing. Each write with immediate that lands produces exactly one kRemoteWriteImm completion
// on the target's domain. Ranges are validated before posting (a bad key or range is an
// InvalidArgument here, never a silent drop on the peer). Sends beyond the queue depth are
// queued inside the backend. Writes with immediate posted on one endpoint land, and their
// kRemoteWriteImm completions are reported on the target, in posting order (RC queue pairs,
// and FI_ORDER_WAW, which the ofi backend requires); the protocol's multi-slot message
// buffers depend on it and check it with a sequence number. Outstanding operations that do
// not complete within DomainOptions::op_timeout complete with DeadlineExceeded. Objects may be
// destroyed in any order; the underlying handles are released when the last user lets go.
// Destroying an endpoint drops its completions not yet polled, with its operations.
#ifndef TENSORVERBS_FABRIC_FABRIC_H_
#define TENSORVERBS_FABRIC_FABRIC_H_

#include <poll.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "src/common/config.h"
#include "src/common/host_identity.h"
#include "src/fabric/device_memory.h"
#include "src/fabric/rails.h"

namespace tensorverbs::fabric {

// Access rights of a registered region (bit mask).
enum Access : uint32_t {
  kAccessLocal = 0,
  kAccessRemoteWrite = 1u << 0,
  kAccessRemoteRead = 1u << 1,
};

struct Capabilities {
  std::string backend;   // "loopback", "ofi", "ibverbs"
  std::string provider;  // "shm", "tcp;ofi_rxm", "mlx5_0:1", "loopback"
  // What two domains must share to talk to each other: "ofi/shm", "ibverbs" (device names
  // differ between the hosts of one fabric), "loopback". Peers compare it before connecting.
  std::string family;
  uint64_t max_message_size = 0;
  bool virtual_addressing = true;  // false: the provider addresses regions by offset
  size_t queue_depth = 0;          // operations in flight per endpoint before queueing
  // Peers reach memory from SharedMemory (src/common/shared_memory.h) by mapping it: memory
  // that peers write often (message buffers, the receive pool) should come from there.
  bool shared_memory = false;
  // RegisterMemoryFor gives each endpoint registrations of its own: a key offered to one peer
  // is not the key offered to another, and it stops working when its registration is dropped
  // (the protocol drops a channel's when the channel closes).
  bool channel_keys = false;
  // ... and the fabric refuses such a key on any other endpoint: a peer cannot use a key it
  // guessed or was not offered (loopback; ibverbs memory windows would give it). Without it
  // (libfabric's shm and tcp choose keys themselves and do not bind them to endpoints) a peer
  // that learns another channel's key can still use it while it lives.
  bool endpoint_bound_keys = false;
  // RegisterDeviceMemory works, and writes and reads move bytes from and to GPU memory
  // directly (DomainOptions::device_memory; the shmem fabric by CUDA IPC).
  bool device_memory = false;
};

struct DomainOptions {
  // Backend-specific provider: an ofi provider name ("shm", "tcp;ofi_rxm", "verbs;ofi_rxm");
  // empty chooses the backend's default.
  std::string provider;
  // Operations in flight per endpoint; more are queued inside the backend.
  size_t queue_depth = 1024;
  // An operation that has not completed after this long completes with DeadlineExceeded.
  absl::Duration op_timeout = absl::Seconds(30);
  // ibverbs: device, port, GID and queue-pair settings (the seed's RDMA_* variables).
  RdmaConfig rdma;
  // The GPU runtime through which a backend that can reaches device memory directly (null:
  // host memory only).
  std::shared_ptr<DeviceMemory> device_memory;
  // shmem: threads that share each large write's copy with the progress thread (0: none).
  int copy_threads = 0;
  // shmem: offer peers' progress threads a part of each write from 512 KiB (below what the copy
  // threads share), and take part in theirs (shmem.h).
  bool peer_copy = true;
  // shmem: bytes of a peer's regions whose page tables an endpoint keeps populated, in windows
  // of 2 MiB; beyond it the windows least recently written or read give theirs back (the memory
  // stays the peer's, and a later write populates the window again).
  uint64_t peer_window_bytes = uint64_t{128} << 20;
  // ofi, socket-addressed providers (tcp, verbs): this host's address that peers reach it at
  // (the task's host in the cluster spec). Endpoints bind to the interface that has it. Empty,
  // or no interface of the provider has it: the provider's first interface, which can be any
  // (a container's or another job's veth, listed before eth0) and vanish under the endpoint.
  std::string source_address;
  // ofi: no interface with source_address is an error rather than the first interface (a
  // further lane, which must not share lane 0's interface unnoticed).
  bool require_source = false;
  // ofi: every endpoint of the domain shares one libfabric endpoint and completion queue where
  // the provider carries 8 bytes of CQ data (shm, tcp;ofi_rxm); off, or with 4 bytes, each
  // endpoint opens its own. A channel then costs an address-vector entry and its own state
  // rather than a provider endpoint with its receive buffers (about 7.5 MiB over tcp;ofi_rxm).
  bool ofi_shared_endpoint = true;
};

// A packed remote key, held inline: the opaque bytes MemoryRegion::PackRemoteKey produced. Every
// backend's key fits kCapacity bytes, so keys travel in control messages and posts without heap
// allocations (one per tensor each way, otherwise). Bytes longer than kCapacity make an empty
// key, which every backend refuses as malformed.
class RemoteKey {
 public:
  static constexpr size_t kCapacity = 64;

  RemoteKey() = default;
  RemoteKey(absl::string_view bytes) { assign(bytes); }   // NOLINT(google-explicit-constructor)
  RemoteKey(const std::string& bytes) { assign(bytes); }  // NOLINT(google-explicit-constructor)
  RemoteKey(const char* bytes) { assign(absl::string_view(bytes)); }  // NOLINT
  RemoteKey& operator=(absl::string_view bytes) {
    assign(bytes);
    return *this;
  }
  RemoteKey& operator=(const std::string& bytes) {
    assign(bytes);
    return *this;
  }
  RemoteKey& operator=(const char* bytes) {
    assign(absl::string_view(bytes));
    return *this;
  }

  void assign(absl::string_view bytes) {
    size_ = bytes.size() <= kCapacity ? static_cast<uint8_t>(bytes.size()) : 0;
    if (size_ > 0) std::memcpy(bytes_, bytes.data(), size_);
  }
  void clear() { size_ = 0; }
  const char* data() const { return bytes_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  absl::string_view view() const { return absl::string_view(bytes_, size_); }
  operator absl::string_view() const { return view(); }  // NOLINT(google-explicit-constructor)
  std::string ToString() const { return std::string(view()); }

  friend bool operator==(const RemoteKey& a, const RemoteKey& b) { return a.view() == b.view(); }

 private:
  uint8_t size_ = 0;
  char bytes_[kCapacity] = {};  // zeroed, so that copying a short key copies no indeterminate bytes
};

// Whether [addr, addr + len) lies inside [base, base + length), without overflow for any values
// (a peer's, say).
inline bool RangeInside(uint64_t addr, uint64_t len, uint64_t base, uint64_t length) {
  return addr >= base && len <= length && addr - base <= length - len;
}

class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;  // deregisters
  void* base() const { return base_; }
  size_t length() const { return length_; }
  // Opaque bytes a peer needs (with an address inside the region) to access it.
  virtual RemoteKey PackRemoteKey() const = 0;
  bool Contains(const void* p, size_t len) const {
    return RangeInside(reinterpret_cast<uintptr_t>(p), len, reinterpret_cast<uintptr_t>(base_),
                       length_);
  }

 protected:
  MemoryRegion(void* base, size_t length) : base_(base), length_(length) {}

 private:
  void* const base_;
  const size_t length_;
};

// Local memory of an operation; must lie inside `region` (length 0 is always fine).
struct LocalBuffer {
  const MemoryRegion* region = nullptr;
  void* addr = nullptr;
  size_t length = 0;
};

// The peer's memory: `key` from its PackRemoteKey, `addr` its virtual address there.
struct RemoteBuffer {
  RemoteKey key;
  uint64_t addr = 0;
  uint64_t length = 0;
};

class Endpoint;

enum class CompletionKind { kWrite, kRead, kRemoteWriteImm };

struct Completion {
  CompletionKind kind = CompletionKind::kWrite;
  Endpoint* endpoint = nullptr;  // the local endpoint (the one that posted, or was written to)
  uint64_t context = 0;          // the poster's context (kWrite, kRead)
  uint32_t imm = 0;              // kRemoteWriteImm
  // kRemoteWriteImm: bytes written, where the provider reports it (tcp;ofi_rxm reports 0, as
  // the libfabric spec allows); the protocol knows the size it expects and must not rely on it.
  uint64_t byte_len = 0;
  absl::Status status;
};

class Endpoint {
 public:
  virtual ~Endpoint() = default;
  // Opaque bytes the peer passes to Connect.
  virtual std::string LocalAddress() const = 0;
  virtual absl::Status Connect(absl::string_view peer_address) = 0;

  // Writes local.length bytes to remote.addr (remote.length must be >= local.length).
  virtual absl::Status PostWrite(const LocalBuffer& local, const RemoteBuffer& remote,
                                 uint64_t context) = 0;
  // As PostWrite, then the peer gets a kRemoteWriteImm completion carrying `imm`.
  virtual absl::Status PostWriteWithImm(const LocalBuffer& local, const RemoteBuffer& remote,
                                        uint32_t imm, uint64_t context) = 0;
  // Reads local.length bytes from remote.addr into local.
  virtual absl::Status PostRead(const LocalBuffer& local, const RemoteBuffer& remote,
                                uint64_t context) = 0;

  // Operations posted and not yet completed (queued ones included).
  virtual size_t Outstanding() const = 0;
};

class Domain {
 public:
  virtual ~Domain() = default;
  virtual const Capabilities& capabilities() const = 0;
  virtual absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemory(void* addr, size_t length,
                                                                       uint32_t access) = 0;
  // Registers [addr, addr+length) for the peer of `endpoint` alone (see Capabilities::
  // channel_keys and endpoint_bound_keys): local operations may use it like any region. A
  // region that outlives its endpoint accepts nothing more. Unimplemented where the fabric has
  // no such keys; callers then share one RegisterMemory registration among peers.
  virtual absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemoryFor(Endpoint& endpoint,
                                                                          void* addr, size_t length,
                                                                          uint32_t access) {
    (void)endpoint, (void)addr, (void)length, (void)access;
    return absl::UnimplementedError(
        absl::StrCat(capabilities().backend, ": no per-endpoint registrations"));
  }
  // Registers [addr, addr+length), one whole allocation of GPU `device`'s memory, where
  // Capabilities::device_memory says the backend can; Unimplemented otherwise. Operations on it
  // are device copies, completed asynchronously like any other.
  virtual absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterDeviceMemory(void* addr,
                                                                             size_t length,
                                                                             int device,
                                                                             uint32_t access) {
    (void)addr, (void)length, (void)device, (void)access;
    return absl::UnimplementedError(
        absl::StrCat(capabilities().backend, ": no direct device memory here"));
  }
  virtual absl::StatusOr<std::unique_ptr<Endpoint>> CreateEndpoint() = 0;
  // Drives progress and returns up to out.size() completions. Never blocks.
  virtual absl::StatusOr<size_t> Poll(absl::Span<Completion> out) = 0;
  // Blocks the progress thread until a completion may be ready or `timeout` passes, without
  // spinning: a completion channel (ibverbs), the CQs' wait objects (ofi), a condition
  // (loopback). Early returns are allowed; the caller polls afterwards. This is what the
  // blocking and adaptive poll modes build on; busy polling never calls it.
  virtual absl::Status Wait(absl::Duration timeout) = 0;
  // Ends the current Wait, or makes the next one return at once. The only Domain method any
  // thread may call at any time: it is how work queued for the progress thread wakes it.
  virtual void Interrupt() = 0;

  // Wait in two halves, so that one thread can sleep on several domains at once (DomainSet,
  // and SleepOn below, on which the backends build their Wait). PrepareToSleep arms the
  // domain's wake-ups and appends the fds whose readiness ends the sleep (Interrupt's among
  // them) to `fds`, lowering `*timeout` where the domain must be polled again sooner. It
  // returns false when a completion may be ready already: the caller polls instead of
  // sleeping. FinishSleep follows every PrepareToSleep, with the fds the domain appended, their
  // revents set by the caller's poll (0 where it did not sleep), and drains them. The default
  // suits a domain with no fd to sleep on (loopback): no fds, and naps of at most 50 us.
  virtual absl::StatusOr<bool> PrepareToSleep(std::vector<pollfd>* fds, absl::Duration* timeout) {
    (void)fds;
    *timeout = std::min(*timeout, absl::Microseconds(50));
    return true;
  }
  virtual void FinishSleep(absl::Span<const pollfd> fds) { (void)fds; }
};

// Sleeps on every domain of `domains` (PrepareToSleep, one poll of all their fds, FinishSleep)
// until one may have a completion or `timeout` passes. A domain's Wait, or a DomainSet's.
absl::Status SleepOn(absl::Span<Domain* const> domains, absl::Duration timeout);

// What tells two tasks they share a host (src/common/host_identity.h).
using ::tensorverbs::ThisHostIdentity;

// What this process's fabric backends hold and have done, for `bench scale` and the tests that
// check that a domain's channels share one provider endpoint. Any thread.
struct FabricProcessStats {
  // libfabric endpoints open (the ofi backend's): one per domain where its endpoints share one.
  int64_t provider_endpoints = 0;
  // Immediates that arrived for an endpoint that had closed, dropped rather than handed to it
  // or to the endpoint that took its place on a shared provider endpoint.
  int64_t late_immediates_dropped = 0;
  // Address vector entries (over rxm, connections) held for peers: one per domain and peer
  // provider endpoint while an endpoint is connected to it, none once the last one closes.
  int64_t peer_addresses = 0;
};
FabricProcessStats ReadFabricProcessStats();

// The backends compiled in: "loopback", "ofi", and "ibverbs" when rdma-core was found.
std::vector<std::string> BackendNames();

// Opens a domain of `backend`. Unavailable, with the reason, where it cannot run here.
absl::StatusOr<std::unique_ptr<Domain>> OpenDomain(absl::string_view backend,
                                                   const DomainOptions& options);

// What to open, as the task's configuration says (TENSORVERBS_FABRIC,
// TENSORVERBS_OFI_PROVIDER, RDMA_*) and where its peers are.
struct FabricChoice {
  std::string fabric = "auto";   // auto | shmem | ofi | ibverbs | loopback
  std::string ofi_provider;      // empty: ChooseOfiProvider's pick
  bool all_peers_local = false;  // every task runs on this host, so shm serves
  RdmaConfig rdma;
  std::shared_ptr<DeviceMemory> device_memory;  // DomainOptions::device_memory
  int copy_threads = 0;                         // DomainOptions::copy_threads
  bool peer_copy = true;                        // DomainOptions::peer_copy
  // Some peers run on this host and others do not: "auto" then opens the same-host fabric for
  // the first beside the network fabric for the others (OpensSameHostFabric).
  bool some_peers_local = false;
  std::string source_address;  // DomainOptions::source_address
  bool ofi_shared_endpoint = true;  // DomainOptions::ofi_shared_endpoint

  static FabricChoice FromConfig(const Config& config, bool all_peers_local) {
    FabricChoice c;
    c.fabric = config.fabric;
    c.ofi_provider = config.ofi_provider;
    c.all_peers_local = all_peers_local;
    c.rdma = config.rdma;
    c.copy_threads = config.shmem_copy_threads;
    c.peer_copy = config.shmem_peer_copy;
    c.ofi_shared_endpoint = config.ofi_shared_endpoint;
    return c;
  }
};

// The selection policy: opens `choice.fabric` or, for "auto", the same-host shmem fabric when
// every peer is on this host, else ibverbs where a port is usable, else libfabric with the
// provider ChooseOfiProvider picks. The error says what was tried and why each failed.
absl::StatusOr<std::unique_ptr<Domain>> OpenFabric(const FabricChoice& choice);

// Whether OpenFabric(choice) tries the shmem fabric first. Memory that peers will write into
// (the pool allocator's regions) should then come from SharedMemory, so a write is one memcpy
// instead of the kernel's cross-memory copy.
bool UsesSharedMemory(const FabricChoice& choice);

// Whether a task opens the same-host shmem fabric for its peers on this host beside the fabric
// OpenFabric chose for the others: "auto", with some peers on this host but not all. Memory
// peers write into should then come from SharedMemory too.
bool OpensSameHostFabric(const FabricChoice& choice);
// The same-host fabric of such a task, with the choice's options.
absl::StatusOr<std::unique_ptr<Domain>> OpenSameHostFabric(const FabricChoice& choice);
// A further lane beside `primary` (a domain OpenFabric(choice) opened): another domain of the
// same backend. Over libfabric's socket-addressed providers (tcp), of the same provider bound
// to `source`, an address of this host or an interface's name, which must exist. Over ibverbs,
// on the device (and port) `source` names, "mlx5_1" or "mlx5_1:2", with the choice's other
// RDMA_* settings; it must exist, be active, and be another port than the primary's.
// Unimplemented for a fabric that has nothing to choose from (the same-host fabrics).
absl::StatusOr<std::unique_ptr<Domain>> OpenLaneDomain(const FabricChoice& choice,
                                                       const Domain& primary,
                                                       const std::string& source);
// The rails a count in TENSORVERBS_RAILS takes beside `primary`: over libfabric's socket
// providers this host's interfaces ranked for the task (ChooseRails, against the choice's
// source address), over ibverbs the active ports ranked as the primary's was
// (ibverbs::RankPorts: RDMA_DEVICE's order, else the task's NUMA node first), the primary's
// port left out. Each rail is a `source` for OpenLaneDomain. Nothing for other fabrics.
RailPlan PlanRails(const FabricChoice& choice, const Domain& primary, int count);
// Whether a fabric family (Capabilities::family) reaches only peers on its own host (the shmem
// backend, libfabric's shm): its peers must prove that they share the host (ThisHostIdentity)
// before a channel uses it.
bool SameHostOnly(absl::string_view family);

// The one libfabric provider policy: `configured` if set; else a hardware provider among
// `available` (verbs;ofi_rxm, efa, cxi, psm3, in that order); else shm when every peer is on
// this host and shm is available; else tcp;ofi_rxm. `available` holds provider names as
// ListOfiProviders gives them.
std::string ChooseOfiProvider(const std::string& configured, bool all_peers_local,
                              const std::vector<std::string>& available);
// Providers that offer RDM endpoints with RMA and remote CQ data on this host, one line each:
// "name (fabric, fabric, ...)".
std::vector<std::string> ListOfiProviders();

// What this host offers each backend, for `tensorverbs info`: callers above the fabric layer
// learn it here instead of reaching into the backends.
struct FabricInventory {
  struct Backend {
    std::string name;
    absl::Status status;  // OK: a domain opened with the default options
    Capabilities capabilities;
  };
  std::vector<Backend> backends;
  // ibverbs: the devices (one line each) or why there are none, and the port the RDMA_*
  // settings select (with the reason) or why none can be chosen.
  absl::Status rdma_status;
  std::vector<std::string> rdma_devices;
  absl::StatusOr<std::string> rdma_selection = std::string();
  // libfabric: usable providers and the policy's picks for local and remote peers.
  std::vector<std::string> ofi_providers;
  // Of those, the ones that report FI_HMEM (they could write device memory directly).
  std::vector<std::string> ofi_device_memory_providers;
  std::string ofi_local_choice;
  std::string ofi_remote_choice;
};
FabricInventory ReadFabricInventory(const FabricChoice& choice);

}  // namespace tensorverbs::fabric

#endif  // TENSORVERBS_FABRIC_FABRIC_H_
