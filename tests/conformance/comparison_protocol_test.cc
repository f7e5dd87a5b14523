// The two comparison modes built from the grpc+verbs machinery, over every fabric that runs
// here: grpc+verbs-copy (seed 002: a pre-registered buffer per tensor name on each side, a copy
// in and a copy out) and grpc+gdr (meta-data over the RecvTensor call, the bytes pulled by one
// RDMA read and released by a zero-byte write with immediate). Task 0 receives.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "src/fabric/loopback/loopback.h"
#include "src/server/server.h"
#include "tests/support/fixtures.h"
#include "tests/support/inprocess_cluster.h"
#include "tests/support/pending_recv.h"
#include "src/support/process_util.h"

namespace tensorverbs {
namespace {

using ::testing::HasSubstr;

struct Param {
  const char* name;
  const char* protocol;
  const char* fabric;
  const char* provider;
};

class ComparisonProtocolTest : public testing::ClusterTest<Param> {
 protected:
  bool copy_mode() const { return std::string(GetParam().protocol) == "grpc+verbs-copy"; }

  // `n` tasks in this process; `protocols` overrides the protocol per task.
  void StartCluster(int n, std::function<void(verbs::VerbsOptions&)> tune = nullptr,
                    std::vector<std::string> protocols = {}) {
    testing::ClusterOptions o;
    o.protocol = GetParam().protocol;
    o.fabric = GetParam().fabric;
    o.provider = GetParam().provider;
    o.recv_timeout = recv_timeout_;
    o.tune = std::move(tune);
    o.protocols = std::move(protocols);
    StartWith(n, o);
  }

  int64_t Copies(int task) { return server(task).stats().copies.load(); }

  // Every tensor a gdr sender lent has been released (the release immediate can trail the
  // receiver's completion a little).
  void ExpectNothingLent(int task) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (transport(task).NumLentTensors() > 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(transport(task).NumLentTensors(), 0u) << "every lent tensor was released";
  }
};

TEST_P(ComparisonProtocolTest, EveryFixtureArrivesIntactWithItsDeadness) {
  StartCluster(2);
  const bool big = !kUnderThreadSanitizer && (std::string(GetParam().fabric) != "ofi" ||
                                               std::string(GetParam().provider) == "shm");
  std::vector<testing::Fixture> fixtures = testing::MakeFixtures(/*seed=*/11, big);
  std::vector<std::unique_ptr<PendingRecv>> recvs;
  for (const testing::Fixture& f : fixtures) {
    recvs.push_back(std::make_unique<PendingRecv>(*Step(0, 1), Key(1, f.name)));
  }
  for (const testing::Fixture& f : fixtures) {
    ASSERT_TRUE(Step(1, 1)->Send(Key(1, f.name), f.tensor, f.is_dead).ok());
  }
  for (size_t i = 0; i < fixtures.size(); ++i) {
    const testing::Fixture& f = fixtures[i];
    ASSERT_TRUE(recvs[i]->Wait(absl::Seconds(90))) << f.name;
    ASSERT_TRUE(recvs[i]->status().ok()) << f.name << ": " << recvs[i]->status();
    EXPECT_EQ(recvs[i]->is_dead(), f.is_dead) << f.name;
    if (!f.is_dead) {
      EXPECT_TRUE(recvs[i]->tensor().ContentEquals(f.tensor))
          << f.name << ": got " << recvs[i]->tensor().DebugString();
    }
    EXPECT_EQ(recvs[i]->calls(), 1) << f.name;
  }
  if (!copy_mode()) ExpectNothingLent(1);
}

TEST_P(ComparisonProtocolTest, CopiesPerTransferAreWhatTheDesignSays) {
  StartCluster(2);
  constexpr int kSteps = 4;
  for (int step = 1; step <= kSteps; ++step) {
    Tensor big = PoolTensor(1, DataType::kFloat32, {256, 1024}, step);  // 1 MiB
    ASSERT_TRUE(Step(1, step)->Send(Key(1, "w"), big).ok());
    PendingRecv recv(*Step(0, step), Key(1, "w"));
    ASSERT_TRUE(recv.Wait());
    ASSERT_TRUE(recv.status().ok()) << recv.status();
    EXPECT_TRUE(recv.tensor().ContentEquals(big));
  }
  if (copy_mode()) {
    EXPECT_EQ(Copies(1), kSteps) << "a copy in on the sender per transfer";
    EXPECT_EQ(Copies(0), kSteps) << "a copy out on the receiver per transfer";
    // The name's buffers were set up once (BUFFER_REQUEST/RESPONSE) and reused after.
    EXPECT_EQ(transport(1).stats().meta_responses.load(), 1);
  } else {
    EXPECT_EQ(Copies(0) + Copies(1), 0) << "read straight into the result tensor";
    ExpectNothingLent(1);
  }
  // A small tensor: over gdr it goes inline in the gRPC response (one copy, like grpc).
  Tensor small = PoolTensor(1, DataType::kInt32, {4}, 9);
  ASSERT_TRUE(Step(1, 99)->Send(Key(1, "small"), small).ok());
  PendingRecv recv(*Step(0, 99), Key(1, "small"));
  ASSERT_TRUE(recv.Wait());
  ASSERT_TRUE(recv.status().ok()) << recv.status();
  EXPECT_TRUE(recv.tensor().ContentEquals(small));
}

TEST_P(ComparisonProtocolTest, UnregisteredSourcesAndDestinationsGoThroughRegisteredCopies) {
  StartCluster(2);
  Tensor heap = Tensor::Make(DataType::kFloat64, TensorShape::Of({4096}));  // not pool memory
  testing::FillPattern(heap, 5);
  ASSERT_TRUE(Step(1, 1)->Send(Key(1, "h"), heap).ok());
  RecvArgs args;
  args.allocator = CpuAllocator();
  PendingRecv recv(*Step(0, 1), Key(1, "h"), args);
  ASSERT_TRUE(recv.Wait());
  ASSERT_TRUE(recv.status().ok()) << recv.status();
  EXPECT_TRUE(recv.tensor().ContentEquals(heap));
  EXPECT_EQ(recv.tensor().allocator(), CpuAllocator());
  if (!copy_mode()) {
    EXPECT_EQ(Copies(1), 1) << "the sender lends a registered copy";
    EXPECT_EQ(Copies(0), 1) << "the receiver reads into a registered proxy";
  }
}

TEST_P(ComparisonProtocolTest, AGrowingTensorGetsALargerBufferAndShrinkingOnesReuseIt) {
  StartCluster(2);
  const std::vector<int64_t> sizes = {100, 1000, 500, 5000, 5000, 10};
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t step = static_cast<int64_t>(i) + 1;
    Tensor t = PoolTensor(1, DataType::kInt64, {sizes[i]}, static_cast<uint32_t>(i));
    ASSERT_TRUE(Step(1, step)->Send(Key(1, "act"), t).ok());
    PendingRecv recv(*Step(0, step), Key(1, "act"));
    ASSERT_TRUE(recv.Wait());
    ASSERT_TRUE(recv.status().ok()) << recv.status();
    EXPECT_TRUE(recv.tensor().ContentEquals(t)) << "step " << step;
  }
  if (copy_mode()) {
    // The first transfer and each growth asked for a buffer; the rest fit.
    EXPECT_EQ(transport(1).stats().meta_responses.load(), 3);
  }
}

TEST_P(ComparisonProtocolTest, SenderSideErrorsReachTheReceiver) {
  StartCluster(2);
  ParsedKey stale = *ParsedKey::Parse(ParsedKey::Create(
      server(1).device_name(), server(1).incarnation() ^ 1, server(0).device_name(), "x"));
  PendingRecv wrong_incarnation(*Step(0, 5), stale);
  ASSERT_TRUE(wrong_incarnation.Wait());
  EXPECT_EQ(wrong_incarnation.status().code(), absl::StatusCode::kAborted)
      << wrong_incarnation.status();
  EXPECT_THAT(std::string(wrong_incarnation.status().message()), HasSubstr("restarted"));
  server(1).rendezvous_mgr()->Cleanup(6);
  PendingRecv cleaned(*Step(0, 6), Key(1, "y"));
  ASSERT_TRUE(cleaned.Wait());
  EXPECT_EQ(cleaned.status().code(), absl::StatusCode::kFailedPrecondition) << cleaned.status();
  PendingRecv aborted(*Step(0, 7), Key(1, "z"));
  absl::SleepFor(absl::Milliseconds(100));
  Step(1, 7)->StartAbort(absl::InternalError("the producer op failed"));
  ASSERT_TRUE(aborted.Wait());
  EXPECT_EQ(aborted.status().code(), absl::StatusCode::kInternal) << aborted.status();
  EXPECT_THAT(std::string(aborted.status().message()), HasSubstr("the producer op failed"));
  // The channel (and the gRPC path) survived.
  Tensor t = PoolTensor(1, DataType::kFloat32, {4096}, 1);
  ASSERT_TRUE(Step(1, 8)->Send(Key(1, "after"), t).ok());
  PendingRecv after(*Step(0, 8), Key(1, "after"));
  ASSERT_TRUE(after.Wait());
  ASSERT_TRUE(after.status().ok()) << after.status();
  EXPECT_TRUE(after.tensor().ContentEquals(t));
  for (PendingRecv* r : {&wrong_incarnation, &cleaned, &aborted, &after}) EXPECT_EQ(r->calls(), 1);
}

TEST_P(ComparisonProtocolTest, AbortMidFlightCompletesOnceAndTheChannelKeepsWorking) {
  StartCluster(2);
  std::vector<std::unique_ptr<PendingRecv>> recvs;
  for (int i = 0; i < 20; ++i) {
    recvs.push_back(std::make_unique<PendingRecv>(*Step(0, 3), Key(1, absl::StrCat("t", i))));
  }
  absl::SleepFor(absl::Milliseconds(100));
  Step(0, 3)->StartAbort(absl::CancelledError("step 3 cancelled by the user"));
  for (auto& r : recvs) {
    ASSERT_TRUE(r->Wait());
    EXPECT_EQ(r->status().code(), absl::StatusCode::kCancelled) << r->status();
  }
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(
        Step(1, 3)
            ->Send(Key(1, absl::StrCat("t", i)), PoolTensor(1, DataType::kFloat32, {4096}, i))
            .ok());
  }
  Tensor t = PoolTensor(1, DataType::kFloat32, {4096}, 99);
  ASSERT_TRUE(Step(1, 4)->Send(Key(1, "next"), t).ok());
  PendingRecv next(*Step(0, 4), Key(1, "next"));
  ASSERT_TRUE(next.Wait());
  ASSERT_TRUE(next.status().ok()) << next.status();
  EXPECT_TRUE(next.tensor().ContentEquals(t));
  absl::SleepFor(absl::Milliseconds(200));
  for (auto& r : recvs) EXPECT_EQ(r->calls(), 1);
}

TEST_P(ComparisonProtocolTest, TwoThousandConcurrentRecvsFromThreePeers) {
  StartCluster(4);
  constexpr int kPeers = 3;
  constexpr int kPerPeer = kUnderThreadSanitizer ? 100 : 667;
  std::vector<std::unique_ptr<PendingRecv>> recvs;
  for (int i = 0; i < kPerPeer; ++i) {
    for (int peer = 1; peer <= kPeers; ++peer) {
      recvs.push_back(std::make_unique<PendingRecv>(*Step(0, 9), Key(peer, absl::StrCat("k", i))));
    }
  }
  std::vector<std::thread> senders;
  for (int peer = 1; peer <= kPeers; ++peer) {
    senders.emplace_back([this, peer] {
      auto r = Step(peer, 9);
      for (int i = 0; i < kPerPeer; ++i) {
        // Every third tensor is above the inline limit, so gdr reads it.
        Tensor t = *Tensor::Allocate(server(peer).recv_allocator(), DataType::kInt32,
                                     TensorShape::Of({i % 3 == 0 ? 600 : 1 + i % 7}));
        for (int64_t j = 0; j < t.NumElements(); ++j) t.flat<int32_t>()[j] = peer * 1000000 + i;
        ASSERT_TRUE(r->Send(Key(peer, absl::StrCat("k", i)), t).ok());
      }
    });
  }
  for (auto& s : senders) s.join();
  for (int i = 0; i < kPerPeer; ++i) {
    for (int peer = 1; peer <= kPeers; ++peer) {
      PendingRecv& r = *recvs[kPeers * i + (peer - 1)];
      ASSERT_TRUE(r.Wait(absl::Seconds(120))) << i;
      ASSERT_TRUE(r.status().ok()) << r.status();
      Tensor t = r.tensor();
      ASSERT_EQ(t.NumElements(), i % 3 == 0 ? 600 : 1 + i % 7);
      EXPECT_EQ(t.flat<int32_t>()[t.NumElements() - 1], peer * 1000000 + i);
    }
  }
  for (auto& r : recvs) EXPECT_EQ(r->calls(), 1);
  if (!copy_mode()) {
    for (int peer = 1; peer <= kPeers; ++peer) ExpectNothingLent(peer);
  }
}

TEST_P(ComparisonProtocolTest, DataValidationChecksEveryTransfer) {
  if (!copy_mode()) GTEST_SKIP() << "gdr's data never rides the grpc+verbs meta-data";
  StartCluster(2, [](verbs::VerbsOptions& o) { o.data_validation = true; });
  for (int step = 1; step <= 3; ++step) {
    Tensor t = PoolTensor(1, DataType::kFloat32, {1000}, step);
    ASSERT_TRUE(Step(1, step)->Send(Key(1, "v"), t).ok());
    PendingRecv recv(*Step(0, step), Key(1, "v"));
    ASSERT_TRUE(recv.Wait());
    ASSERT_TRUE(recv.status().ok()) << recv.status();
    EXPECT_TRUE(recv.tensor().ContentEquals(t));
  }
  EXPECT_EQ(transport(0).stats().checksum_failures.load(), 0);
}

TEST_P(ComparisonProtocolTest, TasksOfDifferentProtocolsRefuseToConnectAndSaySo) {
  // Task 0 receives over grpc+verbs and sets up a channel to task 1, which runs this protocol.
  StartCluster(2, nullptr, {"grpc+verbs", GetParam().protocol});
  PendingRecv recv(*Step(0, 1), Key(1, "x"));
  ASSERT_TRUE(recv.Wait());
  EXPECT_EQ(recv.status().code(), absl::StatusCode::kFailedPrecondition) << recv.status();
  EXPECT_THAT(std::string(recv.status().message()),
              ::testing::AllOf(HasSubstr(GetParam().protocol), HasSubstr("--protocol")));
}

TEST_P(ComparisonProtocolTest, LentTensorsAreReleasedWhenTheirLeaseEnds) {
  if (copy_mode()) GTEST_SKIP() << "only gdr lends tensors";
  recv_timeout_ = absl::Milliseconds(300);
  StartCluster(2, [](verbs::VerbsOptions& o) { o.peer_timeout = absl::Milliseconds(200); });
  Tensor t = PoolTensor(1, DataType::kUInt8, {1 << 16}, 3);
  Notification lent;
  transport(1).Lend("/job:worker/replica:0/task:7", t,
                    [&lent](absl::StatusOr<protocol::RemoteTensorRef> ref) {
                      EXPECT_TRUE(ref.ok()) << ref.status();
                      lent.Notify();
                    });
  ASSERT_TRUE(lent.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(transport(1).NumLentTensors(), 1u);
  // Nobody reads or releases it: the lease (recv timeout + peer timeout) ends it.
  ExpectNothingLent(1);
}

INSTANTIATE_TEST_SUITE_P(
    Protocols, ComparisonProtocolTest,
    ::testing::Values(Param{"copy_loopback", "grpc+verbs-copy", "loopback", ""},
                      Param{"copy_shm", "grpc+verbs-copy", "ofi", "shm"},
                      Param{"copy_tcp", "grpc+verbs-copy", "ofi", "tcp;ofi_rxm"},
                      Param{"gdr_loopback", "grpc+gdr", "loopback", ""},
                      Param{"gdr_shm", "grpc+gdr", "ofi", "shm"},
                      Param{"gdr_tcp", "grpc+gdr", "ofi", "tcp;ofi_rxm"}),
    [](const auto& info) { return std::string(info.param.name); });

// Faults the loopback fabric injects into either side: whatever breaks, every recv ends once,
// within its deadline, with the right tensor or an error, and a later recv gets through.
class ComparisonFaultTest : public ComparisonProtocolTest {};

TEST_P(ComparisonFaultTest, InjectedFaultsEndEveryRecvOnceAndNeverWithWrongBytes) {
  recv_timeout_ = absl::Seconds(2);
  int failed = 0;
  // Failed posts and error completions everywhere; corrupted writes where content is written
  // (copy mode, with validation on: gdr reads its content, and its only writes are the
  // zero-byte releases).
  const int kinds = copy_mode() ? 3 : 2;
  for (int n = 1; n <= 6; ++n) {
    for (int faulty : {0, 1}) {
      for (int kind = 0; kind < kinds; ++kind) {
        SCOPED_TRACE(absl::StrCat("fault kind ", kind, " on operation ", n, " of task ", faulty));
        StartCluster(2, [kind](verbs::VerbsOptions& o) { o.data_validation = kind == 2; });
        fabric::loopback::Faults f;
        if (kind == 0) f.fail_post_nth = n;
        if (kind == 1) f.error_completion_nth = n;
        if (kind == 2) f.corrupt_write_nth = n;
        fabric::loopback::SetFaults(transport(faulty).domain_for_testing(), f);
        for (int step = 1; step <= 3; ++step) {
          Tensor t = PoolTensor(1, DataType::kFloat32, {4096}, step);
          EXPECT_TRUE(Step(1, step)->Send(Key(1, "f"), t).ok());
          PendingRecv recv(*Step(0, step), Key(1, "f"));
          EXPECT_TRUE(recv.Wait(recv_timeout_ + absl::Seconds(20))) << "the recv hung";
          if (recv.status().ok()) {
            EXPECT_TRUE(recv.tensor().ContentEquals(t)) << "a recv succeeded with wrong bytes";
          } else {
            ++failed;
          }
          absl::SleepFor(absl::Milliseconds(10));
          EXPECT_EQ(recv.calls(), 1);
        }
        TearDown();
      }
    }
  }
  EXPECT_GT(failed, 0) << "some injected faults failed recvs";
}

INSTANTIATE_TEST_SUITE_P(Loopback, ComparisonFaultTest,
                         ::testing::Values(Param{"copy", "grpc+verbs-copy", "loopback", ""},
                                           Param{"gdr", "grpc+gdr", "loopback", ""}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace tensorverbs
