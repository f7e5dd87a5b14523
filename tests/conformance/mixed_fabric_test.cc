// Per-peer fabrics (issue: clusters with several tasks per host): a task whose peers are partly
// on its host reaches those over the same-host shmem fabric and the others over libfabric
// tcp;ofi_rxm, in one progress loop. Three tasks in this process; ServerOptions::verbs.
// same_host_tasks says which share a "host" (tasks 0 and 1; task 2 is elsewhere), as addresses
// do on a real cluster. Every pair exchanges tensors both ways, and each channel's fabric is
// read from the per-channel stats.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>

#include "tensorverbs/device_name.h"
#include "tests/support/inprocess_cluster.h"
#include "tests/support/pending_recv.h"
#include "tests/support/protocol_params.h"

namespace tensorverbs::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

class MixedFabricTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!OfiProviderAvailable("tcp;ofi_rxm"))
      GTEST_SKIP() << "libfabric's tcp;ofi_rxm provider is not available here";
    ClusterOptions o;
    o.protocol = GetParam();
    o.fabric = "auto";
    o.tune = [](ServerOptions& s) {
      if (s.task == 2) {
        s.verbs.same_host_tasks.emplace();
      } else {
        s.verbs.same_host_tasks = absl::flat_hash_set<std::string>{TaskName("worker", 1 - s.task)};
      }
    };
    absl::Status s = cluster_.Start(3, o);
    ASSERT_TRUE(s.ok()) << s;
  }
  void TearDown() override { cluster_.Stop(); }

  // Task `t`'s channels: peer task name -> fabric, for each role.
  std::map<std::string, std::string> FabricsOf(int t, bool receives) {
    std::map<std::string, std::string> out;
    for (const auto& c : cluster_.transport(t).ChannelSnapshots(absl::Seconds(10))) {
      if (c.receives == receives && c.state == "ready") out[c.peer_task] = c.fabric;
    }
    return out;
  }

  InProcessCluster cluster_;
};

TEST_P(MixedFabricTest, EachPairGoesOverItsOwnFabricAndEveryPairExchanges) {
  for (int t = 0; t < 3; ++t) {
    ASSERT_TRUE(cluster_.server(t).WaitForPeers(absl::Seconds(60)).ok()) << t;
  }
  EXPECT_THAT(cluster_.transport(0).fabric_name(), HasSubstr("+ shmem (shmem) on this host"));
  EXPECT_THAT(cluster_.transport(2).fabric_name(), ::testing::Not(HasSubstr("shmem")));
  constexpr int64_t kStep = 7;
  std::vector<std::unique_ptr<PendingRecv>> recvs;
  std::vector<Tensor> sent;
  for (int src = 0; src < 3; ++src) {
    for (int dst = 0; dst < 3; ++dst) {
      if (src == dst) continue;
      // Small, and large enough to take the content path of a big tensor.
      for (int64_t elements : {int64_t{16}, int64_t{1} << 20}) {
        const std::string name = absl::StrCat("t", src, ">", dst, "/", elements);
        Tensor t = cluster_.PoolTensor(src, DataType::kFloat32, {elements},
                                       static_cast<uint32_t>(src * 10 + dst));
        ASSERT_TRUE(cluster_.Step(src, kStep)->Send(cluster_.Key(src, name, dst), t).ok());
        recvs.push_back(std::make_unique<PendingRecv>(*cluster_.Step(dst, kStep),
                                                      cluster_.Key(src, name, dst)));
        sent.push_back(t);
      }
    }
  }
  for (size_t i = 0; i < recvs.size(); ++i) {
    ASSERT_TRUE(recvs[i]->Wait(absl::Seconds(60))) << i;
    ASSERT_TRUE(recvs[i]->status().ok()) << recvs[i]->status();
    const Tensor got = recvs[i]->tensor();
    ASSERT_EQ(got.TotalBytes(), sent[i].TotalBytes());
    EXPECT_EQ(std::memcmp(got.data(), sent[i].data(), got.TotalBytes()), 0) << i;
  }
  const std::string t0 = TaskName("worker", 0), t1 = TaskName("worker", 1),
                    t2 = TaskName("worker", 2);
  for (bool receives : {true, false}) {
    std::map<std::string, std::string> of0 = FabricsOf(0, receives);
    std::map<std::string, std::string> of1 = FabricsOf(1, receives);
    std::map<std::string, std::string> of2 = FabricsOf(2, receives);
    EXPECT_EQ(of0[t1], "shmem (shmem)");
    EXPECT_EQ(of1[t0], "shmem (shmem)");
    EXPECT_THAT(of0[t2], StartsWith("ofi (tcp;ofi_rxm"));
    EXPECT_THAT(of1[t2], StartsWith("ofi (tcp;ofi_rxm"));
    EXPECT_THAT(of2[t0], StartsWith("ofi (tcp;ofi_rxm"));
    EXPECT_THAT(of2[t1], StartsWith("ofi (tcp;ofi_rxm"));
  }
}

TEST_P(MixedFabricTest, TheSameHostFabricRegistersThePoolOfItsOwn) {
  for (int t = 0; t < 3; ++t) {
    ASSERT_TRUE(cluster_.server(t).WaitForPeers(absl::Seconds(60)).ok()) << t;
  }
  Tensor t = cluster_.PoolTensor(1, DataType::kInt32, {1024}, 3);
  ASSERT_TRUE(cluster_.Step(1, 1)->Send(cluster_.Key(1, "x", 0), t).ok());
  Tensor u = cluster_.PoolTensor(2, DataType::kInt32, {1024}, 4);
  ASSERT_TRUE(cluster_.Step(2, 1)->Send(cluster_.Key(2, "y", 0), u).ok());
  PendingRecv x(*cluster_.Step(0, 1), cluster_.Key(1, "x", 0));
  PendingRecv y(*cluster_.Step(0, 1), cluster_.Key(2, "y", 0));
  ASSERT_TRUE(x.Wait(absl::Seconds(60)) && y.Wait(absl::Seconds(60)));
  ASSERT_TRUE(x.status().ok()) << x.status();
  ASSERT_TRUE(y.status().ok()) << y.status();
  // The pool's region is registered with both fabrics: two shared registrations at least.
  EXPECT_GE(cluster_.transport(0).registration_gauges().regions, 2);
}

INSTANTIATE_TEST_SUITE_P(Protocols, MixedFabricTest,
                         ::testing::Values("grpc+verbs", "grpc+verbs-copy"), ProtocolTestName);

}  // namespace
}  // namespace tensorverbs::testing
