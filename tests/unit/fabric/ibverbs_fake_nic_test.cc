// The ibverbs backend driven against FakeNic: QP attributes from the RDMA_* variables, the data
// path (immediate byte order, receives kept posted, send credits), error completions and
// set-up failures — everything a host without an RDMA NIC can check.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "src/fabric/fabric.h"
#include "src/fabric/ibverbs/ibverbs.h"
#include "src/fabric/ibverbs/ibverbs_internal.h"
#include "tests/unit/fabric/fake_nic.h"
#include "tests/unit/fabric/ibverbs_fake_nic_fixture.h"

namespace tensorverbs::fabric::ibverbs {
namespace {

using testing::FakeNic;
using ::testing::HasSubstr;
using testing::IbverbsFakeNicTest;

TEST_F(IbverbsFakeNicTest, SelectsTheDeviceAndMovesQpsThroughInitRtrRtsWithTheSeedsAttributes) {
  RdmaConfig config;
  config.timeout = 20;
  config.retry_count = 5;
  config.sl = 3;
  config.traffic_class = 106;
  config.pkey_index = 2;
  config.mtu = 512;
  ASSERT_NO_FATAL_FAILURE(Open(config));
  EXPECT_EQ(domain_->capabilities().backend, "ibverbs");
  EXPECT_EQ(domain_->capabilities().provider, "fake_0:1");
  // Two QPs: INIT at creation, then RTR and RTS at Connect.
  std::vector<FakeNic::Modify>& m = FakeNic::Get().modifies;
  ASSERT_EQ(m.size(), 6u);
  EXPECT_EQ(m[0].attr.qp_state, IBV_QPS_INIT);
  EXPECT_EQ(m[0].attr.pkey_index, 2);
  EXPECT_EQ(m[0].attr.port_num, 1);
  EXPECT_TRUE(m[0].attr.qp_access_flags & IBV_ACCESS_REMOTE_WRITE);
  const FakeNic::Modify& rtr = m[2];
  EXPECT_EQ(rtr.attr.qp_state, IBV_QPS_RTR);
  EXPECT_EQ(rtr.attr.path_mtu, IBV_MTU_512);
  EXPECT_EQ(rtr.attr.dest_qp_num, m[1].qp_num) << "a connects to b";
  EXPECT_EQ(rtr.attr.ah_attr.sl, 3);
  EXPECT_EQ(rtr.attr.ah_attr.is_global, 1) << "RoCE routes by GID";
  EXPECT_EQ(rtr.attr.ah_attr.grh.sgid_index, 1) << "the RoCEv2 IPv4 GID";
  EXPECT_EQ(rtr.attr.ah_attr.grh.traffic_class, 106);
  char gid[INET6_ADDRSTRLEN];
  inet_ntop(AF_INET6, rtr.attr.ah_attr.grh.dgid.raw, gid, sizeof(gid));
  EXPECT_STREQ(gid, "::ffff:10.0.0.7");
  const FakeNic::Modify& rts = m[3];
  EXPECT_EQ(rts.attr.qp_state, IBV_QPS_RTS);
  EXPECT_EQ(rts.attr.timeout, 20);
  EXPECT_EQ(rts.attr.retry_cnt, 5);
  EXPECT_EQ(rts.attr.rnr_retry, 7);
  EXPECT_EQ(rtr.attr.rq_psn, m[5].attr.sq_psn) << "a expects b's send PSN";
}

TEST_F(IbverbsFakeNicTest, WriteWithImmediateLandsAndTheImmediateKeepsItsValue) {
  ASSERT_NO_FATAL_FAILURE(Open());
  for (uint32_t imm : {0u, 7u, 0xFFFFFFFDu, 0xFFFFFFFEu, 0xFFFFFFFFu}) {
    ASSERT_TRUE(
        a_->PostWriteWithImm({src_mr_.get(), src_.data(), 4096}, Dst(0, 4096), imm, imm + 1).ok());
  }
  ASSERT_TRUE(a_->PostWriteWithImm({}, Dst(0, 0), 0x12345678, 99).ok()) << "zero bytes";
  std::vector<Completion> got = Drain();
  std::multiset<uint32_t> imms;
  size_t local = 0;
  for (const Completion& c : got) {
    ASSERT_TRUE(c.status.ok()) << c.status;
    if (c.kind == CompletionKind::kRemoteWriteImm) {
      EXPECT_EQ(c.endpoint, b_.get());
      imms.insert(c.imm);
    } else {
      EXPECT_EQ(c.endpoint, a_.get());
      ++local;
    }
  }
  EXPECT_EQ(local, 6u);
  EXPECT_EQ(imms, (std::multiset<uint32_t>{0, 7, 0xFFFFFFFD, 0xFFFFFFFE, 0xFFFFFFFF, 0x12345678}));
  EXPECT_EQ(std::memcmp(dst_.data(), src_.data(), 4096), 0);
}

// A host with two NICs: the task's first lane on the first, a rail (TENSORVERBS_RAILS) on the
// second, chosen by name or by count, carrying writes of its own registrations.
TEST_F(IbverbsFakeNicTest, ALaneOpensOnTheSecondDeviceAndCarriesWrites) {
  FakeNic::Get().second_device = true;
  ASSERT_NO_FATAL_FAILURE(Open());
  ASSERT_EQ(domain_->capabilities().provider, "fake_0:1") << "both ports rank alike: by name";
  FabricChoice choice;
  choice.fabric = "ibverbs";

  const RailPlan plan = PlanRails(choice, *domain_, 1);
  ASSERT_EQ(plan.rails, std::vector<std::string>{"fake_1:1"});
  EXPECT_THAT(plan.considered[0], HasSubstr("fake_0:1: the task's first lane"));
  EXPECT_THAT(plan.considered[1], HasSubstr("fake_1:1: rail 1"));
  EXPECT_EQ(PlanRails(choice, *domain_, 3).rails.size(), 1u) << "one further port";

  for (const std::string& named : {std::string("fake_1"), plan.rails[0]}) {
    absl::StatusOr<std::unique_ptr<Domain>> lane = OpenLaneDomain(choice, *domain_, named);
    ASSERT_TRUE(lane.ok()) << named << ": " << lane.status();
    EXPECT_EQ((*lane)->capabilities().provider, "fake_1:1");
  }
  absl::StatusOr<std::unique_ptr<Domain>> lane = OpenLaneDomain(choice, *domain_, "fake_1");
  ASSERT_TRUE(lane.ok()) << lane.status();
  std::unique_ptr<Endpoint> la = *(*lane)->CreateEndpoint();
  std::unique_ptr<Endpoint> lb = *(*lane)->CreateEndpoint();
  ASSERT_TRUE(la->Connect(lb->LocalAddress()).ok());
  ASSERT_TRUE(lb->Connect(la->LocalAddress()).ok());
  std::unique_ptr<MemoryRegion> src =
      *(*lane)->RegisterMemory(src_.data(), src_.size(), kAccessLocal);
  std::unique_ptr<MemoryRegion> dst =
      *(*lane)->RegisterMemory(dst_.data(), dst_.size(), kAccessRemoteWrite);
  ASSERT_TRUE(la->PostWriteWithImm(
                    {src.get(), src_.data(), 4096},
                    {dst->PackRemoteKey(), reinterpret_cast<uint64_t>(dst_.data()), 4096}, 42, 1)
                  .ok());
  bool landed = false;
  Completion c[8];
  for (int i = 0; i < 100 && !landed; ++i) {
    absl::StatusOr<size_t> n = (*lane)->Poll(absl::MakeSpan(c));
    ASSERT_TRUE(n.ok()) << n.status();
    for (size_t k = 0; k < *n; ++k) {
      ASSERT_TRUE(c[k].status.ok()) << c[k].status;
      if (c[k].kind == CompletionKind::kRemoteWriteImm) {
        EXPECT_EQ(c[k].endpoint, lb.get());
        EXPECT_EQ(c[k].imm, 42u);
        landed = true;
      }
    }
  }
  EXPECT_TRUE(landed);
  EXPECT_EQ(std::memcmp(dst_.data(), src_.data(), 4096), 0);
}

TEST_F(IbverbsFakeNicTest, ALaneOnTheFirstLanesPortOrOnNoDeviceIsAClearError) {
  FakeNic::Get().second_device = true;
  ASSERT_NO_FATAL_FAILURE(Open());
  FabricChoice choice;
  choice.fabric = "ibverbs";
  absl::StatusOr<std::unique_ptr<Domain>> same = OpenLaneDomain(choice, *domain_, "fake_0:1");
  ASSERT_FALSE(same.ok());
  EXPECT_THAT(std::string(same.status().message()), HasSubstr("fake_0:1, the port the task's"));
  absl::StatusOr<std::unique_ptr<Domain>> missing = OpenLaneDomain(choice, *domain_, "mlx9");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("mlx9, which is not on this host"));
  absl::StatusOr<std::unique_ptr<Domain>> bad_port = OpenLaneDomain(choice, *domain_, "fake_1:x");
  ASSERT_FALSE(bad_port.ok());
  EXPECT_EQ(bad_port.status().code(), absl::StatusCode::kInvalidArgument);
  FakeNic::Get().port_state = IBV_PORT_DOWN;
  absl::StatusOr<std::unique_ptr<Domain>> down = OpenLaneDomain(choice, *domain_, "fake_1");
  ASSERT_FALSE(down.ok()) << "a port that is down carries no lane";
  EXPECT_THAT(std::string(down.status().message()), HasSubstr("no active RDMA port"));
}

TEST_F(IbverbsFakeNicTest, ThousandsOfWritesBeyondTheQueueDepthKeepReceivesPosted) {
  RdmaConfig config;
  config.queue_depth = 8;
  ASSERT_NO_FATAL_FAILURE(Open(config));
  constexpr int kWrites = 3000;
  for (int i = 0; i < kWrites; ++i) {
    ASSERT_TRUE(
        a_->PostWriteWithImm({src_mr_.get(), src_.data(), 16}, Dst(16 * (i % 1000), 16), i, i)
            .ok());
  }
  EXPECT_GT(a_->Outstanding(), 8u) << "posts beyond the depth are queued, not refused";
  std::vector<Completion> got = Drain();
  size_t remote = 0, local = 0;
  for (const Completion& c : got) {
    ASSERT_TRUE(c.status.ok()) << c.status;  // an RNR error would mean a receive was not reposted
    (c.kind == CompletionKind::kRemoteWriteImm ? remote : local)++;
  }
  EXPECT_EQ(local, static_cast<size_t>(kWrites));
  EXPECT_EQ(remote, static_cast<size_t>(kWrites));
  EXPECT_EQ(a_->Outstanding(), 0u);
}

TEST_F(IbverbsFakeNicTest, ReadsAndErrorCompletionsBecomeStatuses) {
  ASSERT_NO_FATAL_FAILURE(Open());
  std::memset(dst_.data(), 'z', 100);
  ASSERT_TRUE(a_->PostRead({src_mr_.get(), src_.data(), 100}, Dst(0, 100), 1).ok());
  std::vector<Completion> got = Drain();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].kind, CompletionKind::kRead);
  EXPECT_EQ(src_[99], 'z');
  // A key the NIC does not know (the range itself is consistent, so the backend posts it).
  RemoteBuffer bogus = Dst(0, 64);
  std::string flipped = bogus.key.ToString();
  flipped[0] ^= 0x55;
  bogus.key = flipped;
  ASSERT_TRUE(a_->PostWrite({src_mr_.get(), src_.data(), 64}, bogus, 2).ok());
  got = Drain();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(got[0].status.message(), HasSubstr("remote access error"));
  // Ranges outside the registered region never reach the NIC.
  EXPECT_EQ(a_->PostWrite({src_mr_.get(), src_.data(), 64}, Dst(dst_.size() - 8, 64), 3).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_TRUE(Drain().empty());
}

TEST_F(IbverbsFakeNicTest, WaitBlocksOnTheCompletionChannelAndAcknowledgesEveryEvent) {
  ASSERT_NO_FATAL_FAILURE(Open());
  absl::Time start = absl::Now();
  ASSERT_TRUE(domain_->Wait(absl::Milliseconds(200)).ok());
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(150)) << "nothing to do: it slept";
  // The CQs are armed now, so these completions raise channel events.
  ASSERT_TRUE(a_->PostWriteWithImm({src_mr_.get(), src_.data(), 64}, Dst(0, 64), 5, 1).ok());
  EXPECT_GT(FakeNic::Get().cq_events_raised, 0);
  start = absl::Now();
  ASSERT_TRUE(domain_->Wait(absl::Seconds(5)).ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(1)) << "work was ready: no sleep";
  std::vector<Completion> got = Drain();
  EXPECT_EQ(got.size(), 2u) << "completions found while arming are not lost";
  ASSERT_TRUE(domain_->Wait(absl::Milliseconds(10)).ok());  // drains the channel
  // Endpoints, registrations and the domain: the domain's shared CQ goes with the last of them.
  a_.reset();
  b_.reset();
  src_mr_.reset();
  dst_mr_.reset();
  domain_.reset();
  EXPECT_EQ(FakeNic::Get().cq_events_acked, FakeNic::Get().cq_events_raised)
      << "destroying a CQ with unacknowledged events hangs in rdma-core";
}

TEST_F(IbverbsFakeNicTest, FatalQpEventFailsLaterPosts) {
  ASSERT_NO_FATAL_FAILURE(Open());
  ibv_async_event event{};
  event.event_type = IBV_EVENT_QP_FATAL;
  // Find a's QP through the recorded modifies (the first QP created).
  static ibv_qp fake_qp;
  fake_qp.qp_num = FakeNic::Get().modifies[0].qp_num;
  event.element.qp = &fake_qp;
  FakeNic::Get().async_events.push_back(event);
  Drain();
  absl::Status s = a_->PostWrite({src_mr_.get(), src_.data(), 8}, Dst(0, 8), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("queue pair error"));
  EXPECT_TRUE(b_->PostWrite({src_mr_.get(), src_.data(), 8}, Dst(0, 8), 1).ok())
      << "b is unaffected";
}

// `ulimit -l` too small for what a task registers: the registration fails with
// ResourceExhausted naming the limit, nothing crashes, and once memory is deregistered (or the
// limit raised) registrations succeed again.
TEST_F(IbverbsFakeNicTest, AMemlockLimitTooSmallIsResourceExhaustedNamingTheLimit) {
  Open();
  FakeNic& nic = FakeNic::Get();
  nic.memlock_bytes = nic.pinned_bytes + (64 << 10);
  std::vector<char> big(1 << 20), small(32 << 10);
  absl::StatusOr<std::unique_ptr<MemoryRegion>> refused =
      domain_->RegisterMemory(big.data(), big.size(), kAccessRemoteWrite);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("ulimit -l")) << refused.status();
  absl::StatusOr<std::unique_ptr<MemoryRegion>> fits =
      domain_->RegisterMemory(small.data(), small.size(), kAccessRemoteWrite);
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(domain_->RegisterMemory(big.data(), 48 << 10, kAccessRemoteWrite).status().code(),
            absl::StatusCode::kResourceExhausted)
      << "the limit counts every registration";
  fits->reset();
  nic.memlock_bytes = UINT64_MAX;
  EXPECT_TRUE(domain_->RegisterMemory(big.data(), big.size(), kAccessRemoteWrite).ok());
}

// The rights a region is registered with are the NIC's: a remote read of a write-only region
// (a grpc+verbs destination) completes with an access error, never with the bytes.
TEST_F(IbverbsFakeNicTest, AWriteOnlyRegionRefusesRemoteReads) {
  Open();
  std::string secret(4096, 's');
  std::unique_ptr<MemoryRegion> write_only =
      *domain_->RegisterMemory(secret.data(), secret.size(), kAccessRemoteWrite);
  const RemoteBuffer remote{write_only->PackRemoteKey(), reinterpret_cast<uint64_t>(secret.data()),
                            64};
  ASSERT_TRUE(a_->PostRead({src_mr_.get(), src_.data(), 64}, remote, 9).ok());
  bool failed = false;
  for (const Completion& c : Drain()) {
    if (c.context == 9) failed = !c.status.ok();
  }
  EXPECT_TRUE(failed) << "a remote read of a write-only region succeeded";
  EXPECT_EQ(src_[0], 'a') << "no byte was read";
}

TEST_F(IbverbsFakeNicTest, SetUpFailuresAreClearErrors) {
  FakeNic::Get().port_state = IBV_PORT_DOWN;
  absl::StatusOr<std::unique_ptr<Domain>> d = OpenIbverbsDomain(DomainOptions(), RdmaConfig());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("fake_0 port 1: down, Ethernet"))
      << d.status();
  FakeNic::Get().Reset();

  FakeNic::Get().fail_alloc_pd = true;
  d = OpenIbverbsDomain(DomainOptions(), RdmaConfig());
  EXPECT_THAT(d.status().message(), HasSubstr("ibv_alloc_pd"));
  FakeNic::Get().Reset();

  d = OpenIbverbsDomain(DomainOptions(), RdmaConfig());
  ASSERT_TRUE(d.ok());
  FakeNic::Get().fail_create_qp = true;
  EXPECT_THAT((*d)->CreateEndpoint().status().message(), HasSubstr("ibv_create_qp"));
  FakeNic::Get().fail_create_qp = false;
  FakeNic::Get().fail_modify_to = IBV_QPS_INIT;
  absl::Status init = (*d)->CreateEndpoint().status();
  EXPECT_EQ(init.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(init.message(), HasSubstr("RDMA_QP_PKEY_INDEX"));
  FakeNic::Get().fail_modify_to = IBV_QPS_RTR;
  auto ep = *(*d)->CreateEndpoint();
  absl::Status rtr = ep->Connect(ep->LocalAddress());
  EXPECT_EQ(rtr.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(rtr.message(), HasSubstr("RDMA_GID_INDEX"));
  EXPECT_EQ(ep->Connect("short").code(), absl::StatusCode::kInvalidArgument);
  RdmaConfig too_big;
  too_big.mtu = 4096;
  EXPECT_THAT(OpenIbverbsDomain(DomainOptions(), too_big).status().message(),
              HasSubstr("RDMA_QP_MTU=4096 exceeds the active MTU 1024"));
}

// Keys per channel on a NIC are type-2 memory windows bound to the channel's queue pair over
// the region's own (bindable, remotely inaccessible) registration: no second pinning, the key
// works from that channel's peer alone, and dropping the window revokes it.
TEST_F(IbverbsFakeNicTest, ChannelKeysAreWindowsBoundToTheChannelsQueuePair) {
  ASSERT_NO_FATAL_FAILURE(Open());
  EXPECT_TRUE(domain_->capabilities().channel_keys);
  EXPECT_TRUE(domain_->capabilities().endpoint_bound_keys);
  // Another channel between the same domains (one fake NIC plays both hosts).
  std::unique_ptr<Endpoint> c = *domain_->CreateEndpoint();
  std::unique_ptr<Endpoint> d = *domain_->CreateEndpoint();
  ASSERT_TRUE(c->Connect(d->LocalAddress()).ok());
  ASSERT_TRUE(d->Connect(c->LocalAddress()).ok());
  std::string pool(1 << 16, 0);
  // What the memory manager registers with channel keys: local access only.
  std::unique_ptr<MemoryRegion> shared =
      *domain_->RegisterMemory(pool.data(), pool.size(), kAccessLocal);
  const uint64_t pinned = FakeNic::Get().pinned_bytes;
  // b_ receives from a_: its window over 16 KiB of the pool.
  absl::StatusOr<std::unique_ptr<MemoryRegion>> window =
      domain_->RegisterMemoryFor(*b_, pool.data() + 4096, 16384, kAccessRemoteWrite);
  ASSERT_TRUE(window.ok()) << window.status();
  EXPECT_EQ(FakeNic::Get().pinned_bytes, pinned) << "a window pins nothing more";
  EXPECT_EQ(FakeNic::Get().windows_bound, 1);
  EXPECT_NE((*window)->PackRemoteKey(), shared->PackRemoteKey());
  ASSERT_TRUE(Drain().empty()) << "the bind's own completion is not the fabric's";
  auto write = [&](Endpoint& from, const RemoteKey& key, size_t offset) {
    RemoteBuffer remote{key, reinterpret_cast<uint64_t>(pool.data()) + offset, 1024};
    EXPECT_TRUE(from.PostWrite({src_mr_.get(), src_.data(), 1024}, remote, 5).ok());
    std::vector<Completion> got = Drain();
    return got.size() == 1 ? got[0].status : absl::InternalError("not one completion");
  };
  EXPECT_TRUE(write(*a_, (*window)->PackRemoteKey(), 4096).ok());
  EXPECT_EQ(pool[4096], 'a');
  std::fill(pool.begin(), pool.end(), 0);
  EXPECT_FALSE(write(*c, (*window)->PackRemoteKey(), 4096).ok()) << "another channel's peer";
  EXPECT_FALSE(write(*a_, shared->PackRemoteKey(), 4096).ok()) << "the unoffered registration";
  const RemoteKey old = (*window)->PackRemoteKey();
  window->reset();
  EXPECT_EQ(FakeNic::Get().windows_live, 0);
  EXPECT_FALSE(write(*a_, old, 4096).ok()) << "a dropped window's key";
  EXPECT_EQ(pool[4096], 0) << "nothing landed";

  // Memory outside every bindable registration gets one of its own under the window.
  std::string heap(8192, 0);
  absl::StatusOr<std::unique_ptr<MemoryRegion>> own =
      domain_->RegisterMemoryFor(*b_, heap.data(), heap.size(), kAccessRemoteWrite);
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ(FakeNic::Get().pinned_bytes, pinned + heap.size());
  own->reset();
  EXPECT_EQ(FakeNic::Get().pinned_bytes, pinned);
}

TEST_F(IbverbsFakeNicTest, BeforeItsQueuePairIsConnectedAnEndpointGetsARegistrationOfItsOwn) {
  ASSERT_NO_FATAL_FAILURE(Open());
  std::unique_ptr<Endpoint> fresh = *domain_->CreateEndpoint();
  std::string slots(4096, 0);
  absl::StatusOr<std::unique_ptr<MemoryRegion>> mr =
      domain_->RegisterMemoryFor(*fresh, slots.data(), slots.size(), kAccessRemoteWrite);
  ASSERT_TRUE(mr.ok()) << mr.status();
  EXPECT_EQ(FakeNic::Get().windows_bound, 0);
  RemoteBuffer remote{(*mr)->PackRemoteKey(), reinterpret_cast<uint64_t>(slots.data()), 64};
  ASSERT_TRUE(a_->PostWrite({src_mr_.get(), src_.data(), 64}, remote, 1).ok());
  std::vector<Completion> got = Drain();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_TRUE(got[0].status.ok()) << got[0].status;
}

TEST_F(IbverbsFakeNicTest, WithoutMemoryWindowsEveryPeerSharesTheRegionsKey) {
  FakeNic::Get().memory_windows = false;
  ASSERT_NO_FATAL_FAILURE(Open());
  EXPECT_FALSE(domain_->capabilities().channel_keys);
  std::string pool(4096, 0);
  EXPECT_TRUE(absl::IsUnimplemented(
      domain_->RegisterMemoryFor(*b_, pool.data(), pool.size(), kAccessRemoteWrite).status()));
}

}  // namespace
}  // namespace tensorverbs::fabric::ibverbs
