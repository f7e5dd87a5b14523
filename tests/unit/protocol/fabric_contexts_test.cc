// FabricContexts: the collection of a transport's open fabrics. Two loopback domains stand for a
// network fabric and a same-host one; what is checked is what PeerChannels and VerbsTransport
// rely on: the first reaches every peer, each env points at its own domain and registrations,
// lookups by reach and family, what the engine polls, and the sums over every context.
#include "src/protocol/fabric_contexts.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <utility>

#include "src/fabric/domain_set.h"
#include "src/fabric/fabric.h"
#include "src/rendezvous/rendezvous_mgr.h"
#include "src/tensor/allocator.h"

namespace tensorverbs::protocol {
namespace {

using ::testing::ElementsAre;
using Reach = FabricContext::Reach;

class FabricContextsTest : public ::testing::Test {
 protected:
  FabricContextsTest()
      : pool_("test pool",
              PoolAllocator::Options{.region_bytes = size_t{1} << 20, .pretouch = false}) {
    shared_.stats = &stats_;
    shared_.options.message_slots = 7;
  }

  // Adds a loopback domain of `reach` with its own registrations of the pool.
  FabricContext& AddLoopback(Reach reach) {
    std::unique_ptr<fabric::Domain> domain = *fabric::OpenDomain("loopback", {});
    auto memory = std::make_unique<RdmaMemoryMgr>(domain.get(), &pool_,
                                                  RemoteAccessFor(VerbsMode::kZeroCopy));
    return contexts_.Add(reach, std::move(domain), std::move(memory), shared_);
  }

  PoolAllocator pool_;
  VerbsStats stats_;
  ChannelEnv shared_;
  FabricContexts contexts_;
};

TEST_F(FabricContextsTest, OneFabricIsPolledAsItselfAndReachesEveryPeer) {
  FabricContext& only = AddLoopback(Reach::kAnyPeer);
  EXPECT_EQ(contexts_.size(), 1u);
  EXPECT_EQ(&contexts_.primary(), &only);
  EXPECT_EQ(contexts_.polled(), only.domain.get());
  EXPECT_EQ(contexts_.FirstWith(Reach::kSameHost), nullptr);
  EXPECT_EQ(contexts_.Name(), "loopback (loopback)");
  EXPECT_EQ(contexts_.Families(), "loopback");
  // The env is the shared one with this fabric's domain and registrations in it.
  EXPECT_EQ(only.env.domain, only.domain.get());
  EXPECT_EQ(only.env.memory, only.memory.get());
  EXPECT_EQ(only.env.stats, &stats_);
  EXPECT_EQ(only.env.options.message_slots, 7);
}

TEST_F(FabricContextsTest, TheFirstContextReachesEveryPeerWhateverItWasAddedAs) {
  AddLoopback(Reach::kSameHost);
  EXPECT_EQ(contexts_.primary().reach, Reach::kAnyPeer);
  EXPECT_EQ(contexts_.FirstWith(Reach::kSameHost), nullptr);
}

TEST_F(FabricContextsTest, ASameHostFabricBesideTheNetworkOne) {
  FabricContext& network = AddLoopback(Reach::kAnyPeer);
  FabricContext& local = AddLoopback(Reach::kSameHost);
  EXPECT_EQ(&contexts_.primary(), &network);
  EXPECT_EQ(contexts_.FirstWith(Reach::kSameHost), &local);
  EXPECT_EQ(contexts_.FirstWith(Reach::kAnyPeer), nullptr);  // the primary is not "another"
  EXPECT_EQ(local.env.domain, local.domain.get());
  EXPECT_EQ(local.env.memory, local.memory.get());
  EXPECT_NE(local.env.memory, network.env.memory);
  EXPECT_EQ(contexts_.Name(), "loopback (loopback) + loopback (loopback) on this host");
  // Both share a family here, so the lookup finds the first.
  EXPECT_EQ(contexts_.OfFamily("loopback"), &network);
  EXPECT_EQ(contexts_.OfFamily("shmem"), nullptr);
  EXPECT_EQ(contexts_.Families(), "loopback and loopback");

  // The engine polls both through one set, built once.
  auto* set = dynamic_cast<fabric::DomainSet*>(contexts_.polled());
  ASSERT_NE(set, nullptr);
  EXPECT_THAT(set->members(), ElementsAre(network.domain.get(), local.domain.get()));
  EXPECT_EQ(contexts_.polled(), set);

  std::vector<const FabricContext*> order;
  for (const auto& c : contexts_) order.push_back(c.get());
  EXPECT_THAT(order, ElementsAre(&network, &local));
}

TEST_F(FabricContextsTest, RendezvousManagerGaugesAndReleaseCoverEveryContext) {
  FabricContext& network = AddLoopback(Reach::kAnyPeer);
  FabricContext& local = AddLoopback(Reach::kSameHost);
  RendezvousMgr mgr([](int64_t) { return nullptr; });  // only compared, never asked
  contexts_.SetRendezvousMgr(&mgr);
  EXPECT_EQ(network.env.rendezvous_mgr, &mgr);
  EXPECT_EQ(local.env.rendezvous_mgr, &mgr);

  // A pool region, registered by each context's manager as it is found.
  void* p = pool_.AllocateRaw(4096);
  ASSERT_NE(p, nullptr);
  ASSERT_TRUE(network.memory->FindRegistered(p, 4096).ok());
  ASSERT_TRUE(local.memory->FindRegistered(p, 4096).ok());
  const RdmaMemoryMgr::RegistrationGauges one = network.memory->gauges();
  const RdmaMemoryMgr::RegistrationGauges sum = contexts_.Gauges();
  EXPECT_GT(one.regions, 0);
  EXPECT_EQ(sum.regions, one.regions + local.memory->gauges().regions);
  EXPECT_EQ(sum.bytes, one.bytes + local.memory->gauges().bytes);

  contexts_.ReleaseRegistrations();
  EXPECT_EQ(network.memory, nullptr);
  EXPECT_EQ(local.memory, nullptr);
  EXPECT_EQ(contexts_.Gauges().regions, 0);
  EXPECT_NE(network.domain, nullptr);  // the domains stay open until the collection goes
  pool_.DeallocateRaw(p, 4096);
}

}  // namespace
}  // namespace tensorverbs::protocol
