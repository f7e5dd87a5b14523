// The grpc+verbs protocol between servers of one process, over each fabric that runs here:
// loopback (with fault injection), libfabric shm and libfabric tcp;ofi_rxm. Task 0 receives;
// the other tasks send. Multi-process behaviour (killed and restarted peers) is in
// tests/integration.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "proto/verbs.grpc.pb.h"
#include "src/common/mutex.h"
#include "src/fabric/loopback/loopback.h"
#include "src/rendezvous/device_name.h"
#include "src/server/server.h"
#include "tests/support/fixtures.h"
#include "tests/support/inprocess_cluster.h"
#include "tests/support/pending_recv.h"
#include "src/support/process_util.h"

namespace tensorverbs {
namespace {

using ::testing::HasSubstr;

struct FabricParam {
  const char* name;
  const char* fabric;
  const char* provider;
};

class VerbsProtocolTest : public testing::ClusterTest<FabricParam> {
 protected:
  // `n` tasks in this process; `tune` adjusts every server's grpc+verbs options.
  void StartCluster(int n, std::function<void(verbs::VerbsOptions&)> tune = nullptr) {
    testing::ClusterOptions o;
    o.protocol = "grpc+verbs";
    o.fabric = GetParam().fabric;
    o.provider = GetParam().provider;
    o.recv_timeout = recv_timeout_;
    o.tune = std::move(tune);
    StartWith(n, o);
  }
};

TEST_P(VerbsProtocolTest, EveryFixtureArrivesIntactWithItsDeadness) {
  StartCluster(2);
  const bool big = std::string(GetParam().name) != "ofi_tcp";  // tcp moves 64 MiB slowly here
  std::vector<testing::Fixture> fixtures = testing::MakeFixtures(/*seed=*/7, big);
  auto sender = Step(1, 1);
  auto receiver = Step(0, 1);
  std::vector<std::unique_ptr<PendingRecv>> recvs;
  for (const testing::Fixture& f : fixtures) {
    recvs.push_back(std::make_unique<PendingRecv>(*receiver, Key(1, f.name)));
  }
  for (const testing::Fixture& f : fixtures) {
    ASSERT_TRUE(sender->Send(Key(1, f.name), f.tensor, f.is_dead).ok());
  }
  for (size_t i = 0; i < fixtures.size(); ++i) {
    const testing::Fixture& f = fixtures[i];
    ASSERT_TRUE(recvs[i]->Wait(absl::Seconds(60))) << f.name;
    ASSERT_TRUE(recvs[i]->status().ok()) << f.name << ": " << recvs[i]->status();
    EXPECT_EQ(recvs[i]->is_dead(), f.is_dead) << f.name;
    if (!f.is_dead) {
      EXPECT_TRUE(recvs[i]->tensor().ContentEquals(f.tensor))
          << f.name << ": got " << recvs[i]->tensor().DebugString();
    }
    EXPECT_EQ(recvs[i]->calls(), 1) << f.name;
  }
}

TEST_P(VerbsProtocolTest, SteadyStateIsZeroCopyAndSkipsTheMetaDataRoundTrip) {
  StartCluster(2);
  constexpr int kSteps = 10;
  for (int step = 1; step <= kSteps; ++step) {
    Tensor t = PoolTensor(1, DataType::kFloat32, {64, 1024}, step);
    ASSERT_TRUE(Step(1, step)->Send(Key(1, "weights"), t).ok());
    PendingRecv recv(*Step(0, step), Key(1, "weights"));
    ASSERT_TRUE(recv.Wait());
    ASSERT_TRUE(recv.status().ok()) << recv.status();
    EXPECT_TRUE(recv.tensor().ContentEquals(t)) << "step " << step;
    // The result is pool memory: the content landed in place.
    MemoryRegion region;
    EXPECT_TRUE(server(0).recv_allocator()->FindRegion(recv.tensor().data(), 1, &region));
    server(0).rendezvous_mgr()->Cleanup(step);
    server(1).rendezvous_mgr()->Cleanup(step);
  }
  const protocol::VerbsStats& rx = transport(0).stats();
  const protocol::VerbsStats& tx = transport(1).stats();
  // The sender counts a transfer at its local completion, which may come after the receiver's.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (tx.content_writes.load() < kSteps && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(tx.copies.load() + rx.copies.load(), 0) << "every transfer was zero copy";
  EXPECT_EQ(tx.meta_responses.load(), 1) << "only the first recv needed the meta-data";
  EXPECT_EQ(rx.meta_cache_hits.load(), kSteps - 1);
  EXPECT_EQ(tx.content_writes.load(), kSteps);
  EXPECT_EQ(tx.content_bytes.load(), int64_t{kSteps} * 64 * 1024 * 4);
  EXPECT_EQ(rx.dropped_imms.load(), 0);
  EXPECT_EQ(rx.channel_errors.load() + tx.channel_errors.load(), 0);
}

TEST_P(VerbsProtocolTest, AShapeThatChangesEveryStepTakesTheReRequestPath) {
  StartCluster(2);
  constexpr int kSteps = 8;
  for (int step = 1; step <= kSteps; ++step) {
    Tensor t = PoolTensor(1, DataType::kInt64, {step, 3 + step % 2}, step);
    ASSERT_TRUE(Step(1, step)->Send(Key(1, "activations"), t).ok());
    PendingRecv recv(*Step(0, step), Key(1, "activations"));
    ASSERT_TRUE(recv.Wait());
    ASSERT_TRUE(recv.status().ok()) << recv.status();
    EXPECT_TRUE(recv.tensor().ContentEquals(t)) << "step " << step << " got "
                                                << recv.tensor().DebugString();
  }
  // Every step after the first asked with a stale cached shape and was re-requested.
  EXPECT_EQ(transport(1).stats().meta_responses.load(), kSteps);
  EXPECT_EQ(transport(0).stats().re_requests.load(), kSteps);
  EXPECT_EQ(transport(0).stats().meta_cache_hits.load(), kSteps - 1);
}

TEST_P(VerbsProtocolTest, SenderSideErrorsReachTheReceiverWithCodeAndMessage) {
  StartCluster(2);
  auto receiver = Step(0, 5);
  // A key made for another incarnation of the sender.
  ParsedKey stale = *ParsedKey::Parse(ParsedKey::Create(
      server(1).device_name(), server(1).incarnation() ^ 1, server(0).device_name(), "x"));
  PendingRecv wrong_incarnation(*receiver, stale);
  ASSERT_TRUE(wrong_incarnation.Wait());
  EXPECT_EQ(wrong_incarnation.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(wrong_incarnation.status().message()),
              ::testing::AllOf(HasSubstr("restarted"), HasSubstr("/job:worker/replica:0/task:1")));
  // A step the sender already cleaned up.
  server(1).rendezvous_mgr()->Cleanup(6);
  PendingRecv cleaned(*Step(0, 6), Key(1, "y"));
  ASSERT_TRUE(cleaned.Wait());
  EXPECT_EQ(cleaned.status().code(), absl::StatusCode::kFailedPrecondition) << cleaned.status();
  // The sender aborts the step while the recv waits.
  PendingRecv aborted(*Step(0, 7), Key(1, "z"));
  absl::SleepFor(absl::Milliseconds(100));
  Step(1, 7)->StartAbort(absl::InternalError("the producer op failed"));
  ASSERT_TRUE(aborted.Wait());
  EXPECT_EQ(aborted.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(aborted.status().message()), HasSubstr("the producer op failed"));
  EXPECT_GE(transport(1).stats().errors_sent.load(), 3);
  // The channel survived all of it.
  Tensor t = PoolTensor(1, DataType::kInt32, {4}, 1);
  ASSERT_TRUE(Step(1, 8)->Send(Key(1, "after"), t).ok());
  PendingRecv after(*Step(0, 8), Key(1, "after"));
  ASSERT_TRUE(after.Wait());
  ASSERT_TRUE(after.status().ok()) << after.status();
  EXPECT_EQ(transport(0).stats().channel_errors.load(), 0);
  for (PendingRecv* r : {&wrong_incarnation, &cleaned, &aborted, &after}) EXPECT_EQ(r->calls(), 1);
}

TEST_P(VerbsProtocolTest, AbortMidFlightCompletesOnceAndLateContentLandsHarmlessly) {
  StartCluster(2);
  std::vector<std::unique_ptr<PendingRecv>> recvs;
  for (int i = 0; i < 20; ++i) {
    recvs.push_back(std::make_unique<PendingRecv>(*Step(0, 3), Key(1, absl::StrCat("t", i))));
  }
  absl::SleepFor(absl::Milliseconds(100));  // the requests reach the sender
  Step(0, 3)->StartAbort(absl::CancelledError("step 3 cancelled by the user"));
  for (auto& r : recvs) {
    ASSERT_TRUE(r->Wait());
    EXPECT_EQ(r->status().code(), absl::StatusCode::kCancelled);
  }
  // The sender produces after all: the content goes to memory the aborted requests still own.
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(Step(1, 3)->Send(Key(1, absl::StrCat("t", i)), PoolTensor(1, DataType::kFloat32,
                                                                           {1024}, i)).ok());
  }
  // The channel keeps working and nothing ran twice.
  Tensor t = PoolTensor(1, DataType::kFloat32, {1024}, 99);
  ASSERT_TRUE(Step(1, 4)->Send(Key(1, "next"), t).ok());
  PendingRecv next(*Step(0, 4), Key(1, "next"));
  ASSERT_TRUE(next.Wait());
  ASSERT_TRUE(next.status().ok()) << next.status();
  EXPECT_TRUE(next.tensor().ContentEquals(t));
  absl::SleepFor(absl::Milliseconds(200));
  for (auto& r : recvs) EXPECT_EQ(r->calls(), 1);
  EXPECT_EQ(transport(0).stats().channel_errors.load(), 0);
}

TEST_P(VerbsProtocolTest, AnUnregistrableDestinationGoesThroughARegisteredProxy) {
  StartCluster(2);
  Tensor t = PoolTensor(1, DataType::kFloat64, {333}, 5);
  for (int step = 1; step <= 2; ++step) {
    ASSERT_TRUE(Step(1, step)->Send(Key(1, "w"), t).ok());
    RecvArgs args;
    args.allocator = CpuAllocator();  // heap memory the fabric never registered
    PendingRecv recv(*Step(0, step), Key(1, "w"), args);
    ASSERT_TRUE(recv.Wait());
    ASSERT_TRUE(recv.status().ok()) << recv.status();
    EXPECT_TRUE(recv.tensor().ContentEquals(t));
    EXPECT_EQ(recv.tensor().allocator(), CpuAllocator());
  }
  EXPECT_EQ(transport(0).stats().copies.load(), 2) << "one proxy copy per recv";
  EXPECT_EQ(transport(1).stats().copies.load(), 0);
}

TEST_P(VerbsProtocolTest, PerTransferAndCopyRegistrationStrategies) {
  for (const char* strategy : {"per-transfer", "copy"}) {
    SCOPED_TRACE(strategy);
    StartCluster(2, [strategy](verbs::VerbsOptions& o) { o.registration = strategy; });
    for (int step = 1; step <= 3; ++step) {
      Tensor t = PoolTensor(1, DataType::kUInt16, {1000}, step);
      ASSERT_TRUE(Step(1, step)->Send(Key(1, "g"), t).ok());
      PendingRecv recv(*Step(0, step), Key(1, "g"));
      ASSERT_TRUE(recv.Wait());
      ASSERT_TRUE(recv.status().ok()) << recv.status();
      EXPECT_TRUE(recv.tensor().ContentEquals(t));
    }
    const int64_t copies = transport(0).stats().copies.load() + transport(1).stats().copies.load();
    const int64_t registrations = transport(0).stats().transient_registrations.load() +
                                  transport(1).stats().transient_registrations.load();
    if (std::string(strategy) == "copy") {
      EXPECT_EQ(copies, 6) << "a copy in and a copy out per transfer";
      EXPECT_EQ(registrations, 0);
    } else {
      EXPECT_EQ(copies, 0);
      EXPECT_EQ(registrations, 6) << "source and destination pinned per transfer";
    }
    TearDown();
  }
}

TEST_P(VerbsProtocolTest, KeysAtTheNameLimitWorkAndLongerOnesFailClearly) {
  StartCluster(2);
  // Size the edge name so that the whole key is exactly the limit.
  const size_t edge = protocol::kMaxNameLength - (Key(1, "a").full_key.size() - 1);
  const std::string at_limit(edge, 'a');
  ParsedKey key = Key(1, at_limit);
  ASSERT_EQ(key.full_key.size(), protocol::kMaxNameLength);
  Tensor t = PoolTensor(1, DataType::kInt8, {10}, 3);
  ASSERT_TRUE(Step(1, 1)->Send(key, t).ok());
  PendingRecv ok(*Step(0, 1), key);
  ASSERT_TRUE(ok.Wait());
  ASSERT_TRUE(ok.status().ok()) << ok.status();
  EXPECT_TRUE(ok.tensor().ContentEquals(t));

  PendingRecv too_long(*Step(0, 1), Key(1, at_limit + "b"));
  ASSERT_TRUE(too_long.Wait());
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(too_long.status().message()), HasSubstr("2048"));
}

TEST_P(VerbsProtocolTest, TenThousandConcurrentRecvsFromThreePeers) {
  StartCluster(4);
  constexpr int kPeers = 3;
  constexpr int kPerPeer = 3334;
  std::vector<std::unique_ptr<PendingRecv>> recvs;
  recvs.reserve(kPeers * kPerPeer);
  auto receiver = Step(0, 9);
  for (int i = 0; i < kPerPeer; ++i) {
    for (int peer = 1; peer <= kPeers; ++peer) {
      recvs.push_back(std::make_unique<PendingRecv>(*receiver, Key(peer, absl::StrCat("k", i))));
    }
  }
  std::vector<std::thread> senders;
  for (int peer = 1; peer <= kPeers; ++peer) {
    senders.emplace_back([this, peer] {
      auto r = Step(peer, 9);
      for (int i = 0; i < kPerPeer; ++i) {
        Tensor t = Tensor::Make(DataType::kInt32, TensorShape::Of({1 + i % 7}));
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
      ASSERT_EQ(t.NumElements(), 1 + i % 7);
      EXPECT_EQ(t.flat<int32_t>()[0], peer * 1000000 + i);
    }
  }
  for (auto& r : recvs) EXPECT_EQ(r->calls(), 1);
  EXPECT_EQ(transport(0).stats().channel_errors.load(), 0);
}

TEST_P(VerbsProtocolTest, OneMessageSlotAndEveryPollModeWork) {
  const std::vector<std::pair<const char*, int>> configs = {
      {"busy", 32}, {"blocking", 32}, {"adaptive", 32}, {"adaptive", 1}};
  for (const auto& [mode, batch] : configs) {
    SCOPED_TRACE(absl::StrCat(mode, ", batch ", batch));
    StartCluster(2, [mode = mode, batch = batch](verbs::VerbsOptions& o) {
      o.message_slots = 1;
      o.message_batch = batch;
      o.poll_mode = mode;
    });
    std::vector<std::unique_ptr<PendingRecv>> recvs;
    for (int i = 0; i < 200; ++i) {
      recvs.push_back(std::make_unique<PendingRecv>(*Step(0, 1), Key(1, absl::StrCat("s", i))));
    }
    for (int i = 0; i < 200; ++i) {
      ASSERT_TRUE(Step(1, 1)->Send(Key(1, absl::StrCat("s", i)),
                                   PoolTensor(1, DataType::kFloat32, {16}, i)).ok());
    }
    for (int i = 0; i < 200; ++i) {
      ASSERT_TRUE(recvs[i]->Wait());
      ASSERT_TRUE(recvs[i]->status().ok()) << recvs[i]->status();
      EXPECT_TRUE(recvs[i]->tensor().ContentEquals(PoolTensor(1, DataType::kFloat32, {16}, i)));
    }
    // 200 REQUESTs and 200 RE_REQUESTs (the meta-data was not cached) behind one slot.
    const protocol::VerbsStats& rx = transport(0).stats();
    EXPECT_EQ(rx.control_messages.load(), rx.requests.load() + rx.re_requests.load());
    EXPECT_EQ(rx.control_messages.load(), 400);
    if (batch == 1) {
      EXPECT_EQ(rx.control_slots.load(), 400) << "the seed's buffer: one message per write";
    } else {
      EXPECT_LT(rx.control_slots.load(), 200) << "messages queued behind the slot went batched";
    }
    recvs.clear();  // the tensors go back to the pools before the servers do
    TearDown();
  }
}

TEST_P(VerbsProtocolTest, APeerOfAnotherWireVersionIsRefusedAndTold) {
  StartCluster(1);
  const std::string address = *server(0).cluster().TaskAddress("worker", 0);
  auto stub = proto::VerbsService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  for (uint32_t version : {0u, 1u, uint32_t{protocol::kWireVersion} + 1}) {
    SCOPED_TRACE(version);
    proto::ConnectRequest request;
    request.set_task_name("/job:worker/replica:0/task:9");
    request.set_incarnation(7);
    request.set_fabric(transport(0).domain_for_testing()->capabilities().family);
    request.set_protocol("grpc+verbs");
    request.set_channel_id(1);
    request.mutable_end()->set_endpoint_address("unused");
    request.mutable_end()->set_rx_addr(4096);
    request.mutable_end()->set_rx_key("unused");
    request.mutable_end()->set_rx_slots(8);
    request.mutable_end()->set_wire_version(version);
    proto::ConnectResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    grpc::Status status = stub->Connect(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(status.error_message(),
                ::testing::AllOf(HasSubstr("task:9 speaks grpc+verbs wire version"),
                                 HasSubstr(absl::StrCat("speaks ", protocol::kWireVersion)),
                                 HasSubstr("same tensorverbs release")));
    if (version == 0) {
      EXPECT_THAT(status.error_message(), HasSubstr("1 or older"));
    }
  }
}

TEST_P(VerbsProtocolTest, DataValidationVerifiesEveryTransfer) {
  StartCluster(2, [](verbs::VerbsOptions& o) { o.data_validation = true; });
  for (int step = 1; step <= 3; ++step) {
    Tensor t = PoolTensor(1, DataType::kFloat32, {1000}, step);
    ASSERT_TRUE(Step(1, step)->Send(Key(1, "v"), t).ok());
    PendingRecv recv(*Step(0, step), Key(1, "v"));
    ASSERT_TRUE(recv.Wait());
    ASSERT_TRUE(recv.status().ok()) << recv.status();
    EXPECT_TRUE(recv.tensor().ContentEquals(t));
  }
  EXPECT_EQ(transport(1).stats().meta_responses.load(), 3) << "the checksum rides the meta-data";
  EXPECT_EQ(transport(0).stats().checksum_failures.load(), 0);
}

TEST_P(VerbsProtocolTest, A256MiBTensorAndAnEmptyOneInPlace) {
  if (std::string(GetParam().name) != "ofi_shm") {
    GTEST_SKIP() << "256 MiB runs once, over shm (the other fabrics move the same code path)";
  }
  StartCluster(2);
  Tensor big = PoolTensor(1, DataType::kUInt8, {int64_t{256} << 20}, 11);
  Tensor empty = PoolTensor(1, DataType::kFloat32, {0, 16}, 0);
  ASSERT_TRUE(Step(1, 1)->Send(Key(1, "big"), big).ok());
  ASSERT_TRUE(Step(1, 1)->Send(Key(1, "empty"), empty).ok());
  PendingRecv got_big(*Step(0, 1), Key(1, "big"));
  PendingRecv got_empty(*Step(0, 1), Key(1, "empty"));
  ASSERT_TRUE(got_big.Wait(absl::Seconds(120)));
  ASSERT_TRUE(got_empty.Wait());
  ASSERT_TRUE(got_big.status().ok()) << got_big.status();
  ASSERT_TRUE(got_empty.status().ok()) << got_empty.status();
  EXPECT_TRUE(got_big.tensor().ContentEquals(big));
  EXPECT_EQ(got_empty.tensor().shape(), empty.shape());
  EXPECT_EQ(transport(0).stats().copies.load() + transport(1).stats().copies.load(), 0);
}

TEST_P(VerbsProtocolTest, WaitForPeersSetsUpEveryChannel) {
  StartCluster(3);
  for (int t = 0; t < 3; ++t) {
    absl::Status s = server(t).WaitForPeers(absl::Seconds(20));
    ASSERT_TRUE(s.ok()) << s;
  }
  // Each task owns a channel to each peer and accepted one from each.
  for (int t = 0; t < 3; ++t) EXPECT_EQ(transport(t).NumReadyChannels(), 4u) << t;
}

INSTANTIATE_TEST_SUITE_P(Fabrics, VerbsProtocolTest,
                         ::testing::Values(FabricParam{"loopback", "loopback", ""},
                                           FabricParam{"ofi_shm", "ofi", "shm"},
                                           FabricParam{"ofi_tcp", "ofi", "tcp;ofi_rxm"}),
                         [](const auto& info) { return std::string(info.param.name); });

// Faults the loopback fabric injects into the sender's or the receiver's operations. Whatever
// breaks, every recv ends exactly once, within its deadline, with either the right tensor or
// an error: never with wrong bytes, never with a crash or a hang.
class VerbsFaultTest : public VerbsProtocolTest {
 protected:
  struct Outcome {
    int ok = 0;
    int failed = 0;
    std::vector<absl::Status> errors;
  };

  // Runs three recvs (the first asks for the meta-data, the others hit the cache) with `faults`
  // on task `faulty`'s domain.
  Outcome Run(int faulty, const fabric::loopback::Faults& faults, bool validation = false) {
    Outcome out;
    StartCluster(2, [validation](verbs::VerbsOptions& o) {
      o.data_validation = validation;
      o.message_slots = 2;
    });
    if (HasFatalFailure()) return out;
    fabric::loopback::SetFaults(transport(faulty).domain_for_testing(), faults);
    for (int step = 1; step <= 3; ++step) {
      Tensor t = PoolTensor(1, DataType::kFloat32, {4096}, step);
      EXPECT_TRUE(Step(1, step)->Send(Key(1, "f"), t).ok());
      PendingRecv recv(*Step(0, step), Key(1, "f"));
      EXPECT_TRUE(recv.Wait(recv_timeout_ + absl::Seconds(20))) << "the recv hung";
      if (recv.status().ok()) {
        EXPECT_TRUE(recv.tensor().ContentEquals(t)) << "a recv succeeded with wrong bytes";
        ++out.ok;
      } else {
        ++out.failed;
        out.errors.push_back(recv.status());
      }
      absl::SleepFor(absl::Milliseconds(20));
      EXPECT_EQ(recv.calls(), 1);
    }
    TearDown();
    return out;
  }
};

TEST_P(VerbsFaultTest, DuplicatedImmediatesAreDroppedOrCloseTheChannel) {
  recv_timeout_ = absl::Seconds(2);
  int dropped = 0;
  for (int n = 1; n <= 8; ++n) {
    for (int faulty : {0, 1}) {
      SCOPED_TRACE(absl::StrCat("duplicate immediate ", n, " of task ", faulty));
      fabric::loopback::Faults f;
      f.duplicate_imm_nth = n;
      Outcome o = Run(faulty, f);
      EXPECT_EQ(o.ok + o.failed, 3);
      for (const absl::Status& e : o.errors) {
        EXPECT_THAT(e.code(), ::testing::AnyOf(absl::StatusCode::kUnavailable,
                                               absl::StatusCode::kDataLoss,
                                               absl::StatusCode::kDeadlineExceeded))
            << e;
      }
      dropped += o.errors.empty();
    }
  }
  EXPECT_GT(dropped, 0) << "some duplicates (of content immediates) are harmless";
}

TEST_P(VerbsFaultTest, CorruptedWritesAreCaughtByTheCodecOrTheChecksum) {
  recv_timeout_ = absl::Seconds(2);
  int checksum_failures = 0;
  for (int n = 1; n <= 8; ++n) {
    for (int faulty : {0, 1}) {
      SCOPED_TRACE(absl::StrCat("corrupt write ", n, " of task ", faulty));
      fabric::loopback::Faults f;
      f.corrupt_write_nth = n;
      Outcome o = Run(faulty, f, /*validation=*/true);
      EXPECT_EQ(o.ok + o.failed, 3);
      for (const absl::Status& e : o.errors) {
        checksum_failures += absl::StrContains(e.message(), "checksum mismatch");
      }
    }
  }
  EXPECT_GT(checksum_failures, 0) << "a corrupted content write fails its recv with DataLoss";
}

TEST_P(VerbsFaultTest, LostImmediatesFailPendingRecvsAtTheirDeadline) {
  recv_timeout_ = absl::Seconds(1);
  for (int n = 1; n <= 6; ++n) {
    SCOPED_TRACE(absl::StrCat("drop immediate ", n));
    fabric::loopback::Faults f;
    f.drop_imm_nth = n;
    Outcome o = Run(1, f);
    EXPECT_EQ(o.ok + o.failed, 3);
  }
}

TEST_P(VerbsFaultTest, FailedPostsAndErrorCompletionsCloseTheChannelAndItReconnects) {
  recv_timeout_ = absl::Seconds(5);
  for (int n = 1; n <= 6; ++n) {
    for (int faulty : {0, 1}) {
      SCOPED_TRACE(absl::StrCat("operation ", n, " of task ", faulty));
      fabric::loopback::Faults post;
      post.fail_post_nth = n;
      Outcome a = Run(faulty, post);
      EXPECT_GE(a.ok, 1) << "a new channel serves the recvs after the broken one";
      fabric::loopback::Faults completion;
      completion.error_completion_nth = n;
      Outcome b = Run(faulty, completion);
      EXPECT_GE(b.ok, 1);
      for (const absl::Status& e : b.errors) {
        EXPECT_THAT(std::string(e.message()), HasSubstr("task:")) << "errors name the peer";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Loopback, VerbsFaultTest,
                         ::testing::Values(FabricParam{"loopback", "loopback", ""}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace tensorverbs
