// LocalPeers: the ofi endpoints of this process, by fabric address, so that a write to a peer
// endpoint that lives in this process and has closed is refused before it reaches the
// provider. libfabric's shm provider (1.17) writes to a peer of the same process through a
// mapping that closing the peer unmaps, and fi_writedata then crashes the process; a peer in
// another process only ever shows up as an error, which every provider reports.
//
// Each endpoint registers a Gate under its address when it opens and closes the gate (with the
// lock held exclusively, so no post to it is under way) before the provider closes it. An
// endpoint connecting to an address registered here keeps that gate and posts under its shared
// lock; a peer in another process has none and costs nothing. Addresses are the exact bytes
// fi_getname gave; a later endpoint at a reused address (tcp ports) gets a new gate, and a
// connection made to the old one stays refused. Any thread.
#ifndef TENSORVERBS_FABRIC_OFI_LOCAL_PEERS_H_
#define TENSORVERBS_FABRIC_OFI_LOCAL_PEERS_H_

#include <memory>
#include <shared_mutex>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "src/common/mutex.h"

namespace tensorverbs::fabric::ofi {

class LocalPeers {
 public:
  // One endpoint's: open until its endpoint closes.
  struct Gate {
    std::shared_mutex mu;
    bool open = true;  // under mu
  };

  // The process's registry (never destroyed: endpoints may close during exit).
  static LocalPeers& Get();

  // Registers the endpoint at `address`; the gate stays open until Close.
  std::shared_ptr<Gate> Open(const std::string& address);
  // Closes `gate` (waiting for posts under way to it) and forgets `address` if it is still
  // that gate's.
  void Close(const std::string& address, const std::shared_ptr<Gate>& gate);
  // The gate of the endpoint of this process at `address`, or null for a peer elsewhere.
  std::shared_ptr<Gate> Find(absl::string_view address);

 private:
  LocalPeers() = default;
  Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Gate>> by_address_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tensorverbs::fabric::ofi

#endif  // TENSORVERBS_FABRIC_OFI_LOCAL_PEERS_H_
