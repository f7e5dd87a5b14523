#include "src/rendezvous/rendezvous_mgr.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/time/clock.h"

namespace tensorverbs {
namespace {

using ::testing::HasSubstr;

// A protocol whose remote recvs are answered by the test.
class FakeRemoteRendezvous : public RemoteRendezvous {
 public:
  using RemoteRendezvous::RemoteRendezvous;
  std::vector<std::pair<ParsedKey, RecvDoneCallback>> remote;
  absl::Status aborted_with;

 protected:
  void RecvFromRemoteAsync(const ParsedKey& key, const RecvArgs& args,
                           RecvDoneCallback done) override {
    remote.emplace_back(key, std::move(done));
  }
  void AbortRemote(const absl::Status& status) override {
    aborted_with = status;
    for (auto& [key, done] : remote) {
      if (done) std::move(done)(status, Tensor(), false);
    }
    remote.clear();
  }
};

class RendezvousMgrTest : public ::testing::Test {
 protected:
  RendezvousMgrTest() {
    env_.job = "worker";
    env_.task = 0;
    env_.task_name = "/job:worker/replica:0/task:0";
    env_.incarnation = 5;
    env_.recv_allocator = CpuAllocator();
  }
  RendezvousMgr::Factory Factory() {
    return [this](int64_t step) {
      auto r = std::make_shared<FakeRemoteRendezvous>(&env_, step);
      created_.push_back(r);
      return r;
    };
  }
  ParsedKey Key(const std::string& src_job, int src_task, const std::string& name) {
    return *ParsedKey::Parse(ParsedKey::Create(
        "/job:" + src_job + "/replica:0/task:" + std::to_string(src_task) + "/device:CPU:0", 5,
        "/job:worker/replica:0/task:0/device:CPU:0", name));
  }
  WorkerEnv env_;
  std::vector<std::shared_ptr<FakeRemoteRendezvous>> created_;
};

TEST_F(RendezvousMgrTest, FindCreatesOncePerStep) {
  RendezvousMgr mgr(Factory());
  auto a = mgr.Find(1);
  auto b = mgr.Find(1);
  auto c = mgr.Find(2);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->get(), b->get());
  EXPECT_NE(a->get(), c->get());
  EXPECT_EQ(mgr.NumActiveSteps(), 2u);
  EXPECT_EQ((*c)->step_id(), 2);
}

TEST_F(RendezvousMgrTest, CleanupOfAStepNeverMadeHereTellsTheStepEndedHook) {
  std::vector<int64_t> ended;
  RendezvousMgr mgr(Factory(), 100, [&ended](int64_t step) { ended.push_back(step); });
  ASSERT_TRUE(mgr.Find(1).ok());
  mgr.Cleanup(1);  // made here: its rendezvous is aborted, which tells the transport
  mgr.Cleanup(2);  // never made here: the hook tells it
  EXPECT_EQ(ended, std::vector<int64_t>{2});
  EXPECT_EQ(created_[0]->aborted_with.code(), absl::StatusCode::kCancelled);
}

// Peers' requests start steps ahead of this task; a flood of made-up step ids is bounded, and
// a step this task takes up (its own Find) stops counting.
TEST_F(RendezvousMgrTest, StepsStartedByPeersAreCappedUntilThisTaskTakesThemUp) {
  RendezvousMgr mgr(Factory());
  mgr.SetPeerStepLimits({/*max_steps=*/3, absl::InfiniteDuration()});
  for (int64_t step = 1; step <= 3; ++step) ASSERT_TRUE(mgr.FindForPeer(step).ok()) << step;
  EXPECT_TRUE(mgr.FindForPeer(2).ok()) << "an existing step is not a new one";
  absl::StatusOr<std::shared_ptr<RemoteRendezvous>> refused = mgr.FindForPeer(4);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("TENSORVERBS_MAX_PEER_STEPS=3"));
  EXPECT_THAT(refused.status().message(), HasSubstr("step 4"));
  EXPECT_EQ(mgr.NumPeerSteps(), 3u);
  // This task takes step 1 up and cleans step 2 up: room for two more.
  ASSERT_TRUE(mgr.Find(1).ok());
  mgr.Cleanup(2);
  EXPECT_EQ(mgr.NumPeerSteps(), 1u);
  EXPECT_TRUE(mgr.FindForPeer(4).ok());
  EXPECT_TRUE(mgr.FindForPeer(5).ok());
  EXPECT_FALSE(mgr.FindForPeer(6).ok());
  // This task's own steps are never refused.
  for (int64_t step = 100; step < 110; ++step) EXPECT_TRUE(mgr.Find(step).ok());
}

// A step only peers started, which this task does not take up within the expiry, is aborted
// (its waiting requests fail with DeadlineExceeded) and forgotten: the task may still run it.
TEST_F(RendezvousMgrTest, StepsOnlyPeersStartedExpire) {
  RendezvousMgr mgr(Factory());
  mgr.SetPeerStepLimits({/*max_steps=*/100, absl::Milliseconds(50)});
  auto early = *mgr.FindForPeer(1);
  absl::Status waiting;
  early->RecvAsync(Key("worker", 0, "never sent"), RecvArgs(),
                   [&](const absl::Status& s, const Tensor&, bool) { waiting = s; });
  ASSERT_TRUE(mgr.FindForPeer(2).ok());
  ASSERT_TRUE(mgr.Find(2).ok());  // taken up: it never expires
  absl::SleepFor(absl::Milliseconds(80));
  ASSERT_TRUE(mgr.FindForPeer(3).ok());  // a new peer step sweeps the expired ones
  EXPECT_EQ(waiting.code(), absl::StatusCode::kDeadlineExceeded) << waiting;
  EXPECT_THAT(waiting.message(), HasSubstr("step 1 was started by peers' requests"));
  EXPECT_EQ(mgr.NumPeerSteps(), 1u);    // step 3
  EXPECT_EQ(mgr.NumActiveSteps(), 2u);  // steps 2 and 3
  absl::StatusOr<std::shared_ptr<RemoteRendezvous>> again = mgr.Find(1);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(again->get(), early.get());
}

TEST_F(RendezvousMgrTest, SameTaskKeysAreServedLocallyOthersRemotely) {
  RendezvousMgr mgr(Factory());
  auto r = *mgr.Find(7);
  Tensor t = Tensor::Make(DataType::kInt8, TensorShape::Of({3}));
  ASSERT_TRUE(r->Send(Key("worker", 0, "local"), t).ok());
  bool got_local = false;
  r->RecvAsync(Key("worker", 0, "local"), RecvArgs(),
               [&](const absl::Status& s, const Tensor& v, bool) {
                 got_local = s.ok() && v.SharesBufferWith(t);
               });
  EXPECT_TRUE(got_local);
  bool remote_done = false;
  r->RecvAsync(Key("ps", 0, "remote"), RecvArgs(),
               [&](const absl::Status& s, const Tensor&, bool) { remote_done = s.ok(); });
  ASSERT_EQ(created_[0]->remote.size(), 1u);
  EXPECT_EQ(created_[0]->remote[0].first.edge_name, "remote");
  std::move(created_[0]->remote[0].second)(absl::OkStatus(), t, false);
  EXPECT_TRUE(remote_done);
}

TEST_F(RendezvousMgrTest, SendAndRecvCheckTheTask) {
  RendezvousMgr mgr(Factory());
  auto r = *mgr.Find(1);
  EXPECT_EQ(r->Send(Key("ps", 0, "x"), Tensor()).code(), absl::StatusCode::kInvalidArgument);
  ParsedKey wrong_dst = *ParsedKey::Parse(ParsedKey::Create(
      "/job:ps/replica:0/task:0/device:CPU:0", 1, "/job:worker/replica:0/task:9/device:CPU:0", "x"));
  absl::Status status;
  r->RecvAsync(wrong_dst, RecvArgs(), [&](const absl::Status& s, const Tensor&, bool) { status = s; });
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("destination device is on another task"));
}

// Host memory standing in for a GPU's: what the rendezvous decides only by placement.
class StandInDeviceAllocator : public Allocator {
 public:
  std::string Name() const override { return "stand-in cuda:1"; }
  void* AllocateRaw(size_t bytes) override { return CpuAllocator()->AllocateRaw(bytes); }
  void DeallocateRaw(void* p, size_t bytes) override { CpuAllocator()->DeallocateRaw(p, bytes); }
  MemoryPlacement Placement() const override { return MemoryPlacement::CudaDevice(1); }
};

TEST_F(RendezvousMgrTest, DeviceTensorsStayWithinTheTaskAndSayWhyOtherwise) {
  RendezvousMgr mgr(Factory());
  auto r = *mgr.Find(4);
  StandInDeviceAllocator device;
  Tensor t = *Tensor::Allocate(&device, DataType::kFloat32, TensorShape::Of({8}));
  EXPECT_EQ(t.placement(), MemoryPlacement::CudaDevice(1));
  EXPECT_EQ(t.placement().ToString(), "cuda:1");
  EXPECT_EQ(Tensor().placement(), MemoryPlacement::Host());
  EXPECT_EQ(t.Clone(CpuAllocator()).status().code(), absl::StatusCode::kFailedPrecondition)
      << "the CPU does not copy device memory";
  // Within the task a device tensor is handed over as it is.
  ASSERT_TRUE(r->Send(Key("worker", 0, "local"), t).ok());
  bool shared = false;
  r->RecvAsync(Key("worker", 0, "local"), RecvArgs(),
               [&](const absl::Status& s, const Tensor& v, bool) {
                 shared = s.ok() && v.SharesBufferWith(t);
               });
  EXPECT_TRUE(shared);
  // To another task it is refused at the send, naming key and placement.
  ParsedKey to_ps =
      *ParsedKey::Parse(ParsedKey::Create("/job:worker/replica:0/task:0/device:CPU:0", 5,
                                          "/job:ps/replica:0/task:0/device:CPU:0", "g"));
  absl::Status sent = r->Send(to_ps, t);
  EXPECT_EQ(sent.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(sent.message(), HasSubstr("'" + to_ps.full_key + "'"));
  EXPECT_THAT(sent.message(), HasSubstr("cuda:1 memory"));
  // And a recv from another task into device memory fails before reaching the protocol.
  RecvArgs args;
  args.allocator = &device;
  absl::Status received;
  r->RecvAsync(Key("ps", 0, "w"), args,
               [&](const absl::Status& s, const Tensor&, bool) { received = s; });
  EXPECT_EQ(received.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(received.message(), HasSubstr("stand-in cuda:1"));
  EXPECT_TRUE(created_[0]->remote.empty());
}

TEST_F(RendezvousMgrTest, CleanupAbortsPendingLocalAndRemoteRecvsAndRemembersTheStep) {
  RendezvousMgr mgr(Factory());
  auto r = *mgr.Find(3);
  absl::Status local, remote;
  r->RecvAsync(Key("worker", 0, "l"), RecvArgs(), [&](const absl::Status& s, const Tensor&, bool) { local = s; });
  r->RecvAsync(Key("ps", 0, "r"), RecvArgs(), [&](const absl::Status& s, const Tensor&, bool) { remote = s; });
  mgr.Cleanup(3);
  EXPECT_EQ(local.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(remote.code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(remote.message(), HasSubstr("step 3 was cleaned up"));
  EXPECT_EQ(mgr.NumActiveSteps(), 0u);
  absl::StatusOr<std::shared_ptr<RemoteRendezvous>> again = mgr.Find(3);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  // Later recvs on the aborted rendezvous fail at once, without reaching the protocol.
  absl::Status late;
  r->RecvAsync(Key("ps", 0, "r2"), RecvArgs(), [&](const absl::Status& s, const Tensor&, bool) { late = s; });
  EXPECT_EQ(late.code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(created_[0]->remote.empty());
}

TEST_F(RendezvousMgrTest, RemembersOnlyTheMostRecentCleanups) {
  RendezvousMgr mgr(Factory(), /*remembered_cleanups=*/2);
  mgr.Cleanup(1);
  mgr.Cleanup(2);
  mgr.Cleanup(3);
  EXPECT_TRUE(mgr.Find(1).ok());
  EXPECT_FALSE(mgr.Find(2).ok());
  EXPECT_FALSE(mgr.Find(3).ok());
}

TEST_F(RendezvousMgrTest, CleanupAllAbortsEverything) {
  absl::Status s1, s2;
  {
    RendezvousMgr mgr(Factory());
    (*mgr.Find(1))->RecvAsync(Key("ps", 0, "a"), RecvArgs(), [&](const absl::Status& s, const Tensor&, bool) { s1 = s; });
    (*mgr.Find(2))->RecvAsync(Key("worker", 0, "b"), RecvArgs(), [&](const absl::Status& s, const Tensor&, bool) { s2 = s; });
  }
  EXPECT_EQ(s1.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(s2.code(), absl::StatusCode::kCancelled);
}

TEST_F(RendezvousMgrTest, RecvAllGathersInOrderOrReportsTheFirstError) {
  RendezvousMgr mgr(Factory());
  auto r = *mgr.Find(1);
  for (int i = 0; i < 3; ++i) {
    Tensor t = Tensor::Make(DataType::kInt32, TensorShape());
    t.flat<int32_t>()[0] = i;
    ASSERT_TRUE(r->Send(Key("worker", 0, "k" + std::to_string(i)), t).ok());
  }
  absl::StatusOr<std::vector<Tensor>> all =
      RecvAll(*r, {Key("worker", 0, "k2"), Key("worker", 0, "k0"), Key("worker", 0, "k1")});
  ASSERT_TRUE(all.ok());
  EXPECT_EQ((*all)[0].flat<int32_t>()[0], 2);
  EXPECT_EQ((*all)[1].flat<int32_t>()[0], 0);
  r->StartAbort(absl::AbortedError("gone"));
  EXPECT_EQ(RecvAll(*r, {Key("worker", 0, "x")}).status().code(), absl::StatusCode::kAborted);
}

}  // namespace
}  // namespace tensorverbs
