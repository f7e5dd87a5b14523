// The ibverbs backend's shared queues against FakeNic (issue 51): one completion queue and one
// shared receive queue per device for every channel, the CQ's room shared so that it never
// overruns and no few channels hold all of it, and the fallback to queues per channel.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "src/fabric/fabric.h"
#include "src/fabric/ibverbs/ibverbs_internal.h"
#include "tests/unit/fabric/fake_nic.h"
#include "tests/unit/fabric/ibverbs_fake_nic_fixture.h"

namespace tensorverbs::fabric::ibverbs {
namespace {

using testing::ConnectedPair;
using testing::FakeNic;
using testing::IbverbsFakeNicTest;

// Issue 51: one completion queue and one shared receive queue per device, whatever the number of
// channels, and every write with immediate still reaches its own channel's endpoint.
TEST_F(IbverbsFakeNicTest, EveryChannelSharesTheDomainsCompletionAndReceiveQueues) {
  ASSERT_NO_FATAL_FAILURE(Open());
  std::vector<std::pair<std::unique_ptr<Endpoint>, std::unique_ptr<Endpoint>>> pairs;
  for (int i = 0; i < 32; ++i) pairs.push_back(ConnectedPair(*domain_));
  EXPECT_EQ(FakeNic::Get().cqs_created, 1);
  EXPECT_EQ(FakeNic::Get().srqs_created, 1);
  EXPECT_EQ(FakeNic::Get().qps_live, 66);
  std::map<const Endpoint*, uint32_t> expected;
  for (uint32_t i = 0; i < pairs.size(); ++i) {
    ASSERT_TRUE(
        pairs[i]
            .first->PostWriteWithImm({src_mr_.get(), src_.data(), 64}, Dst(64 * i, 64), i, i)
            .ok());
    expected[pairs[i].second.get()] = i;
  }
  size_t remote = 0;
  for (const Completion& c : Drain()) {
    ASSERT_TRUE(c.status.ok()) << c.status;
    if (c.kind != CompletionKind::kRemoteWriteImm) continue;
    ++remote;
    ASSERT_EQ(expected.count(c.endpoint), 1u) << "an immediate reached a sender";
    EXPECT_EQ(c.imm, expected[c.endpoint]) << "an immediate reached another channel";
  }
  EXPECT_EQ(remote, pairs.size());
}

// A device without shared receive queues: each endpoint keeps a completion queue and a receive
// queue of its own, as before.
TEST_F(IbverbsFakeNicTest, WithoutSharedReceiveQueuesEachEndpointHasItsOwnQueues) {
  FakeNic::Get().srq = false;
  RdmaConfig config;
  config.queue_depth = 8;
  ASSERT_NO_FATAL_FAILURE(Open(config));
  EXPECT_EQ(FakeNic::Get().cqs_created, 2);
  EXPECT_EQ(FakeNic::Get().srqs_created, 0);
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(a_->PostWriteWithImm({src_mr_.get(), src_.data(), 16}, Dst(16 * i, 16), i, i).ok());
  }
  size_t remote = 0;
  for (const Completion& c : Drain()) {
    ASSERT_TRUE(c.status.ok()) << c.status;
    if (c.kind == CompletionKind::kRemoteWriteImm) {
      EXPECT_EQ(c.endpoint, b_.get());
      ++remote;
    }
  }
  EXPECT_EQ(remote, 100u);
}

// Many channels posting at once against a shared CQ with room for 64 send completions: the
// operations beyond the room wait in their endpoints' queues, the CQ never overruns (an overrun
// loses completions for good on a NIC), and all of them complete.
TEST_F(IbverbsFakeNicTest, TheSharedCompletionQueueNeverOverrunsWhileEveryChannelPosts) {
  FakeNic::Get().max_cqe = static_cast<int>(kSrqDepth + kSharedBindRoom + kMinSharedSendRoom);
  ASSERT_NO_FATAL_FAILURE(Open());
  std::vector<std::pair<std::unique_ptr<Endpoint>, std::unique_ptr<Endpoint>>> pairs;
  for (int i = 0; i < 16; ++i) pairs.push_back(ConnectedPair(*domain_));
  constexpr int kPerPair = 400;  // 6,400 sends and as many receives, against 4,416 entries
  for (auto& [x, y] : pairs) {
    for (int i = 0; i < kPerPair; ++i) {
      ASSERT_TRUE(
          x->PostWriteWithImm({src_mr_.get(), src_.data(), 16}, Dst(16 * (i % 100), 16), i, i)
              .ok());
    }
  }
  size_t remote = 0, local = 0;
  for (const Completion& c : Drain()) {
    ASSERT_TRUE(c.status.ok()) << c.status;
    (c.kind == CompletionKind::kRemoteWriteImm ? remote : local)++;
  }
  EXPECT_EQ(FakeNic::Get().cq_overruns, 0);
  EXPECT_EQ(local, pairs.size() * kPerPair);
  EXPECT_EQ(remote, pairs.size() * kPerPair);
  for (auto& [x, y] : pairs) EXPECT_EQ(x->Outstanding(), 0u);
}

// A channel closed with completions still in the shared CQ, whose queue pair number the device
// gives at once to the next channel's: none of them reaches the new channel (a stale immediate
// would be taken for the new channel's message), and the CQ room the closed channel's work held
// comes back (else, the room gone, the next channel's operations would wait for ever).
TEST_F(IbverbsFakeNicTest, ACompletionOfAClosedChannelNeverReachesTheChannelGivenItsQueuePair) {
  FakeNic::Get().reuse_qp_numbers = true;
  FakeNic::Get().max_cqe = static_cast<int>(kSrqDepth + kSharedBindRoom + kMinSharedSendRoom);
  ASSERT_NO_FATAL_FAILURE(Open());
  // Fill the room: 64 writes from a_ to b_, nothing polled.
  for (int i = 0; i < static_cast<int>(kMinSharedSendRoom); ++i) {
    ASSERT_TRUE(
        a_->PostWriteWithImm({src_mr_.get(), src_.data(), 16}, Dst(16 * i, 16), 0xBAD, i).ok());
  }
  const std::string old_b = b_->LocalAddress();
  a_.reset();
  b_.reset();
  auto [c, d] = ConnectedPair(*domain_);
  // The address carries the queue pair number in bytes 3..6.
  ASSERT_EQ(d->LocalAddress().substr(3, 4), old_b.substr(3, 4)) << "the number was not reused";
  for (int i = 0; i < 200; ++i) {
    ASSERT_TRUE(c->PostWriteWithImm({src_mr_.get(), src_.data(), 16}, Dst(16 * i, 16), 7, i).ok());
  }
  size_t remote = 0;
  for (const Completion& got : Drain()) {
    ASSERT_TRUE(got.status.ok()) << got.status;
    ASSERT_TRUE(got.endpoint == c.get() || got.endpoint == d.get()) << "a closed channel's";
    if (got.kind == CompletionKind::kRemoteWriteImm) {
      EXPECT_EQ(got.imm, 7u) << "the closed channel's immediate reached its successor";
      ++remote;
    }
  }
  EXPECT_EQ(remote, 200u);
  EXPECT_EQ(c->Outstanding(), 0u);
  // All of the room is back: 16 channels of 4 (each within its fair share) fill it at once.
  EXPECT_EQ(SendsTakenAtOnce(16, 4), kMinSharedSendRoom)
      << "the closed channel's CQ room was not given back";
}

// A device that cleans a destroyed queue pair's completions from the CQ itself (mlx5) frees the
// shared receives they consumed without posting them again: the backend stops the queue pair and
// takes its completions out first, so channels closed with writes unpolled leave the shared
// receive queue as full as before.
TEST_F(IbverbsFakeNicTest, ClosingChannelsWithCompletionsUnpolledKeepsTheSharedReceiveQueueFull) {
  FakeNic::Get().destroy_cleans_cq = true;
  ASSERT_NO_FATAL_FAILURE(Open());
  const int full = FakeNic::Get().srq_posted;
  EXPECT_EQ(full, static_cast<int>(kSrqDepth));
  for (int round = 0; round < 5; ++round) {
    auto [x, y] = ConnectedPair(*domain_);
    for (int i = 0; i < 100; ++i) {
      ASSERT_TRUE(
          x->PostWriteWithImm({src_mr_.get(), src_.data(), 16}, Dst(16 * i, 16), 1, i).ok());
    }
    // Both ends go with 100 arrivals and 100 sends unpolled.
  }
  (void)Drain();
  EXPECT_EQ(FakeNic::Get().srq_posted, full) << "shared receives were lost with closed channels";
  ASSERT_TRUE(a_->PostWriteWithImm({src_mr_.get(), src_.data(), 16}, Dst(0, 16), 9, 1).ok());
  size_t remote = 0;
  for (const Completion& c : Drain()) remote += c.kind == CompletionKind::kRemoteWriteImm;
  EXPECT_EQ(remote, 1u);
}

// Channels to a peer that stopped answering, whose writes the NIC retries until the op timeout,
// hold at most three quarters of the shared CQ's room for send completions: a healthy channel's
// writes go on meanwhile, a few at a time, where before they waited as long as the stalled ones.
TEST_F(IbverbsFakeNicTest, ChannelsToASilentPeerLeaveRoomInTheSharedQueueForTheOthers) {
  FakeNic::Get().max_cqe = static_cast<int>(kSrqDepth + kSharedBindRoom + kMinSharedSendRoom);
  ASSERT_NO_FATAL_FAILURE(Open());
  std::vector<std::pair<std::unique_ptr<Endpoint>, std::unique_ptr<Endpoint>>> silent;
  for (int i = 0; i < 4; ++i) {
    silent.push_back(ConnectedPair(*domain_));
    const std::string address = silent.back().second->LocalAddress();
    uint32_t qpn;
    std::memcpy(&qpn, address.data() + 3, 4);  // the address carries the number in bytes 3..6
    FakeNic::Get().unanswering.insert(qpn);
    for (int j = 0; j < 100; ++j) {
      ASSERT_TRUE(
          silent.back()
              .first->PostWriteWithImm({src_mr_.get(), src_.data(), 16}, Dst(16 * j, 16), 0xDEAD, j)
              .ok());
    }
  }
  ASSERT_TRUE(Drain().empty()) << "a write to the silent peers completed";
  constexpr int kWrites = 300;
  for (int i = 0; i < kWrites; ++i) {
    ASSERT_TRUE(a_->PostWriteWithImm({src_mr_.get(), src_.data(), 16}, Dst(16 * i, 16), 7, i).ok());
  }
  size_t remote = 0, local = 0;
  for (const Completion& c : Drain()) {
    ASSERT_TRUE(c.status.ok()) << c.status;
    ASSERT_TRUE(c.endpoint == a_.get() || c.endpoint == b_.get()) << "a silent peer's write";
    (c.kind == CompletionKind::kRemoteWriteImm ? remote : local)++;
  }
  EXPECT_EQ(remote, static_cast<size_t>(kWrites)) << "the healthy channel's writes waited";
  EXPECT_EQ(local, static_cast<size_t>(kWrites));
  EXPECT_EQ(a_->Outstanding(), 0u);
  EXPECT_EQ(FakeNic::Get().cq_overruns, 0);
  // The silent channels closed, what they held is free: the whole room is taken at once again.
  silent.clear();
  EXPECT_EQ(SendsTakenAtOnce(16, 4), kMinSharedSendRoom);
}

// More window binds at once than the shared CQ keeps room for (channels set up by the thousand,
// nothing polled between): each waits for room, lent by the sends or freed by polling the CQ,
// where the 4,097th used to fail; the CQ never overruns and its room all comes back.
TEST_F(IbverbsFakeNicTest, WindowBindsBeyondTheirRoomInTheSharedQueueWaitForItAndSucceed) {
  FakeNic::Get().max_cqe = static_cast<int>(kSrqDepth + kSharedBindRoom + kMinSharedSendRoom);
  ASSERT_NO_FATAL_FAILURE(Open());
  std::string pool(1 << 16, 0);
  std::unique_ptr<MemoryRegion> region =
      *domain_->RegisterMemory(pool.data(), pool.size(), kAccessLocal);
  // 64 channels of 80 binds each (a queue pair's send queue holds its own 1,040).
  std::vector<std::pair<std::unique_ptr<Endpoint>, std::unique_ptr<Endpoint>>> pairs;
  for (int i = 0; i < 64; ++i) pairs.push_back(ConnectedPair(*domain_));
  std::vector<std::unique_ptr<MemoryRegion>> windows;
  const int binds = 64 * 80;
  ASSERT_GT(binds, static_cast<int>(kSharedBindRoom + kMinSharedSendRoom));
  for (int i = 0; i < binds; ++i) {
    absl::StatusOr<std::unique_ptr<MemoryRegion>> w = domain_->RegisterMemoryFor(
        *pairs[i % 64].second, pool.data() + 64 * (i % 512), 64, kAccessRemoteWrite);
    ASSERT_TRUE(w.ok()) << "bind " << i << ": " << w.status();
    windows.push_back(*std::move(w));
  }
  EXPECT_EQ(FakeNic::Get().windows_bound, binds);
  EXPECT_EQ(FakeNic::Get().cq_overruns, 0);
  ASSERT_TRUE(Drain().empty());
  windows.clear();
  pairs.clear();
  // Every entry lent to the binds came back to the sends: the whole room is taken at once.
  EXPECT_EQ(SendsTakenAtOnce(16, 4), kMinSharedSendRoom);
  EXPECT_EQ(FakeNic::Get().cq_overruns, 0);
}

// A device that refuses the domain's large CQ (short of memory, though its max_cqe allows it):
// the shared receive queue made before it goes, and each channel gets queues of its own, as on a
// device without shared receive queues, instead of the domain failing to open.
TEST_F(IbverbsFakeNicTest, ASharedQueueTheDeviceCannotMakeLeavesEachChannelItsOwnQueues) {
  FakeNic::Get().create_cq_limit = 1024;
  RdmaConfig config;
  config.queue_depth = 8;
  ASSERT_NO_FATAL_FAILURE(Open(config));
  EXPECT_EQ(FakeNic::Get().srqs_created, 1);
  EXPECT_EQ(FakeNic::Get().srqs_live, 0);
  EXPECT_EQ(FakeNic::Get().srq_posted, 0);
  EXPECT_EQ(FakeNic::Get().cqs_created, 2) << "one per endpoint";
  for (int i = 0; i < 50; ++i) {
    ASSERT_TRUE(a_->PostWriteWithImm({src_mr_.get(), src_.data(), 16}, Dst(16 * i, 16), i, i).ok());
  }
  size_t remote = 0;
  for (const Completion& c : Drain()) {
    ASSERT_TRUE(c.status.ok()) << c.status;
    remote += c.kind == CompletionKind::kRemoteWriteImm;
  }
  EXPECT_EQ(remote, 50u);
}

}  // namespace
}  // namespace tensorverbs::fabric::ibverbs
