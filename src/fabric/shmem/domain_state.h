// The shmem fabric's per-domain state and its descriptor server (shmem.h describes the fabric).
//
// DomainState is what a domain's objects share (ShmemDomain, its endpoints and regions hold it by
// shared_ptr, so it lives until the last of them): the domain's identity and descriptors, the
// endpoint and region tables the descriptor server answers from, and the progress thread's
// own lists. Serve() is the descriptor server's loop, on a thread of its own: peers of this
// user connect to the domain's abstract Unix socket, name the endpoint they connect to (kHello:
// they get its inbound ring and our doorbell) and then ask for regions by id (kRegion: a memfd;
// kDeviceRegion: a GPU allocation's exported handle). Used by the shmem fabric's files only.
//
// Threading: `endpoints` and `regions` (and EndpointShared::client_fd) under `mu`, shared by the
// server thread and whoever registers and creates endpoints; `local` and `live` belong to the
// progress thread; the rest is set before the server starts.
#ifndef TENSORVERBS_FABRIC_SHMEM_DOMAIN_STATE_H_
#define TENSORVERBS_FABRIC_SHMEM_DOMAIN_STATE_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "src/common/mutex.h"
#include "src/common/shared_memory.h"
#include "src/fabric/fabric.h"
#include "src/fabric/shmem/copy.h"
#include "src/fabric/shmem/wire.h"

namespace tensorverbs::fabric::shmem {

class ShmemEndpoint;

// One endpoint as the descriptor server sees it.
struct EndpointShared {
  uint64_t id = 0;
  std::unique_ptr<SharedMemory> ring;  // the inbound ring this endpoint consumes
  std::atomic<bool> claimed{false};    // a peer connected to it
  std::atomic<bool> peer_gone{false};  // that peer's connection closed
  int client_fd = -1;  // that connection, under DomainState::mu (shut down when we close)
  // Regions this endpoint offered its peer to read from (shared writes: the peer copies part
  // of a write out of them), which the descriptor server then hands that peer read-only even
  // without remote access. Under DomainState::mu.
  std::set<uint64_t> lent_for_reading;
};

struct RegionEntry {
  uint64_t base = 0;
  uint64_t length = 0;
  uint32_t access = 0;
  int fd = -1;  // memfd (ours, closed with the entry); -1 for private memory
  uint64_t file_size = 0;
  int device = -1;  // GPU memory: its ordinal, and the handle a peer imports it by
  std::string handle;
};

struct DomainState {
  uint64_t uid = 0;
  pid_t pid = 0;
  int listen_fd = -1;
  int bell_fd = -1;  // eventfd: the doorbell peers ring and Interrupt signals
  int stop_fd = -1;  // eventfd: ends the server thread
  std::thread server;
  std::shared_ptr<DeviceMemory> device;       // null: host memory only
  std::unique_ptr<CopyHelpers> copy_helpers;  // share large writes' copies (progress thread)
  bool peer_copy = true;                      // DomainOptions::peer_copy
  uint64_t peer_window_bytes = 0;             // DomainOptions::peer_window_bytes
  std::atomic<uint64_t> next_id{1};

  Mutex mu;
  std::map<uint64_t, std::shared_ptr<EndpointShared>> endpoints ABSL_GUARDED_BY(mu);
  std::map<uint64_t, RegionEntry> regions ABSL_GUARDED_BY(mu);

  // Progress thread only.
  std::deque<Completion> local;  // completions of operations already done
  std::vector<ShmemEndpoint*> live;

  // Stops the server thread and closes the descriptors and the regions' memfds.
  ~DomainState();

  // Rings our own doorbell: the progress thread's Wait returns.
  void Ring();

  // The descriptor server's thread.
  void Serve();
  // False when the reply could not be sent: the connection is then closed.
  bool Answer(int client, const Request& request, std::shared_ptr<EndpointShared>* hello);
};

}  // namespace tensorverbs::fabric::shmem

#endif  // TENSORVERBS_FABRIC_SHMEM_DOMAIN_STATE_H_
