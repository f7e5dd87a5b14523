// FabricContexts: the fabrics one grpc+verbs transport has open, one FabricContext each: the
// opened domain, the registrations of the pool with it (RdmaMemoryMgr), and the ChannelEnv that
// the channels over it share. The first context reaches every peer; a later one reaches only the
// peers its Reach names (today the same-host fabric beside a network one). Lanes over several
// devices or interfaces (TENSORVERBS_RAILS) are more entries of the primary's kind, which its
// channels use beside their own endpoint (ChannelEnv::lanes), not more members of the transport.
//
// The transport builds the collection before its progress engine starts and owns it. From then
// on the entries are fixed: channels keep a pointer to their context's env, and every context
// outlives every channel. Reads of the entries are safe from any thread once built; what a
// context's env says about the rendezvous manager is set on the progress thread
// (SetRendezvousMgr), and the registrations are released on the thread that shuts the
// transport down, after the loop stopped (ReleaseRegistrations).
#ifndef TENSORVERBS_PROTOCOL_FABRIC_CONTEXTS_H_
#define TENSORVERBS_PROTOCOL_FABRIC_CONTEXTS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "src/fabric/domain_set.h"
#include "src/fabric/fabric.h"
#include "src/protocol/channel_env.h"
#include "src/protocol/memory_mgr.h"

namespace tensorverbs::protocol {

struct FabricContext {
  // Which peers a context's channels may go to.
  enum class Reach {
    kAnyPeer,   // every task of the cluster (the network fabric, or the only one)
    kSameHost,  // the tasks that share this host (a same-host fabric such as shmem)
    kLane,      // no peer of its own: a further lane of the primary's channels (its env.lanes)
  };
  Reach reach = Reach::kAnyPeer;
  std::unique_ptr<fabric::Domain> domain;
  std::unique_ptr<RdmaMemoryMgr> memory;  // null once the registrations are released
  // What its channels share; env.domain and env.memory point at the two above.
  ChannelEnv env;

  // "ofi (tcp;ofi_rxm)": the backend and its provider.
  std::string Name() const;
  const std::string& family() const { return domain->capabilities().family; }
};

class FabricContexts {
 public:
  FabricContexts() = default;
  FabricContexts(const FabricContexts&) = delete;
  FabricContexts& operator=(const FabricContexts&) = delete;

  // Adds a context over `domain`, whose env starts as a copy of `shared` (the settings and
  // collaborators every fabric's channels share) with this fabric's domain and memory in it.
  // The first context added must reach every peer. Before the progress engine starts.
  FabricContext& Add(FabricContext::Reach reach, std::unique_ptr<fabric::Domain> domain,
                     std::unique_ptr<RdmaMemoryMgr> memory, const ChannelEnv& shared);

  bool empty() const { return contexts_.empty(); }
  size_t size() const { return contexts_.size(); }
  // The context that reaches every peer (the first one added).
  FabricContext& primary() { return *contexts_.front(); }
  const FabricContext& primary() const { return *contexts_.front(); }
  // The first context of `reach` other than the primary; null if none.
  FabricContext* FirstWith(FabricContext::Reach reach) const;
  // The context whose fabric family (fabric::Capabilities::family) is `family`; null if none.
  FabricContext* OfFamily(absl::string_view family) const;
  // The families of every context, "shmem and ofi" (for a refusal that lists them).
  std::string Families() const;
  // "ofi (tcp;ofi_rxm)", or with more contexts "ofi (tcp;ofi_rxm) + shmem (shmem) on this host".
  std::string Name() const;

  // What the progress engine drives: the one domain, or a DomainSet over every context's.
  fabric::Domain* polled();

  // The contexts in the order they were added.
  auto begin() const { return contexts_.begin(); }
  auto end() const { return contexts_.end(); }

  // Every context's env serves peers' requests from `mgr` (progress thread, or before it runs).
  void SetRendezvousMgr(RendezvousMgr* mgr);
  // The sum of every context's registration gauges (caller serializes with ReleaseRegistrations).
  RdmaMemoryMgr::RegistrationGauges Gauges() const;
  // Drops every context's registrations; the domains stay open until the collection goes.
  void ReleaseRegistrations();

 private:
  std::vector<std::unique_ptr<FabricContext>> contexts_;
  std::unique_ptr<fabric::DomainSet> set_;  // over the contexts' domains, when more than one
};

}  // namespace tensorverbs::protocol

#endif  // TENSORVERBS_PROTOCOL_FABRIC_CONTEXTS_H_
