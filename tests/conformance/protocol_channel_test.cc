// The protocol conformance suite (protocol_fixture.h), grpc+verbs-family channels: data
// validation, wire versions and Connect's checks, key limits, registration strategies, message
// slots and poll modes, huge tensors, mixed protocols, and lent tensors' leases.
#include "src/fabric/fabric.h"
#include "tests/conformance/protocol_fixture.h"

namespace tensorverbs::protocol_conformance {
namespace {

// Designs whose requests are grpc+verbs control messages, which carry the checksum.
class ChannelRequestTest : public ProtocolTest {};

TEST_P(ChannelRequestTest, DataValidationVerifiesEveryTransfer) {
  StartCluster(2, [](ServerOptions& o) { o.verbs.channel.data_validation = true; });
  for (int step = 1; step <= 3; ++step) {
    ASSERT_NO_FATAL_FAILURE(
        SendAndRecv(step, "v", PoolTensor(1, DataType::kFloat32, {1000}, step)));
  }
  EXPECT_EQ(transport(1).stats().meta_responses.load(), 3) << "the checksum rides the meta-data";
  EXPECT_EQ(transport(0).stats().checksum_failures.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(Protocols, ChannelRequestTest,
                         ::testing::ValuesIn(Combine(With(&ProtocolDesign::requests_over_channel),
                                                     kEveryFabric)),
                         ParamName);

// grpc+verbs alone: its registration strategies and message slots; and, once per fabric rather
// than once per design, what the other designs do by the same code: the key limit of a
// control message, the wire-version check of channel set-up, and wait-for-peers.
class ZeroCopyTest : public ProtocolTest {};

TEST_P(ZeroCopyTest, APeerOfAnotherWireVersionIsRefusedAndTold) {
  StartCluster(2);
  const std::string address = *server(0).cluster().TaskAddress("worker", 0);
  auto stub = proto::VerbsService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  for (uint32_t version : {0u, 1u, kVerbsWireVersion + 1}) {
    SCOPED_TRACE(version);
    proto::ConnectRequest request;
    request.set_task_name("/job:worker/replica:0/task:1");
    request.set_incarnation(7);
    request.set_fabric(transport(0).domain_for_testing()->capabilities().family);
    request.set_protocol(design().protocol);
    request.set_host(fabric::ThisHostIdentity());  // a peer on this host, as the real ones
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
    EXPECT_THAT(status.error_message(), AllOf(HasSubstr("task:1 speaks grpc+verbs wire version"),
                                              HasSubstr(absl::StrCat("speaks ", kVerbsWireVersion)),
                                              HasSubstr("same tensorverbs release")));
    if (version == 0) {
      EXPECT_THAT(status.error_message(), HasSubstr("1 or older"));
    }
  }
}

// Connect as an outsider would send it: a made-up task is refused before anything is set up,
// and a request claiming to be a real task whose channel end is junk leaves that task's
// channel working. (A well-formed end from an impostor is authentication's to refuse.)
TEST_P(ZeroCopyTest, ConnectChecksTheCallerAndItsEndBeforeTouchingAnyChannel) {
  StartCluster(2);
  // Task 0 receives from task 1 over the channel task 1 accepted.
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(1, "w", PoolTensor(1, DataType::kFloat32, {256}, 1)));
  const std::string address = *server(1).cluster().TaskAddress("worker", 1);
  auto stub = proto::VerbsService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  auto connect = [&](const std::string& task, const std::string& endpoint) {
    proto::ConnectRequest request;
    request.set_task_name(task);
    request.set_incarnation(server(0).incarnation());
    request.set_fabric(transport(1).domain_for_testing()->capabilities().family);
    request.set_protocol(design().protocol);
    request.set_host(fabric::ThisHostIdentity());  // a peer on this host, as the real ones
    request.set_channel_id(77);
    request.mutable_end()->set_endpoint_address(endpoint);
    request.mutable_end()->set_rx_addr(4096);
    request.mutable_end()->set_rx_key("junk");
    request.mutable_end()->set_rx_slots(8);
    request.mutable_end()->set_wire_version(kVerbsWireVersion);
    proto::ConnectResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    return stub->Connect(&context, request, &response);
  };
  const size_t channels = transport(1).NumReadyChannels();
  for (const char* stranger : {"/job:evil/replica:0/task:0", "/job:worker/replica:0/task:7",
                               "/job:worker/replica:0/task:1", "\xff\xfe"}) {
    grpc::Status s = connect(stranger, std::string(100, 'x'));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << stranger;
    EXPECT_THAT(s.error_message(), HasSubstr("cluster spec"));
  }
  grpc::Status junk = connect("/job:worker/replica:0/task:0", std::string(40, 'x'));
  EXPECT_EQ(junk.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << junk.error_message();
  EXPECT_THAT(junk.error_message(), HasSubstr("channel end is unusable"));
  EXPECT_EQ(transport(1).NumReadyChannels(), channels) << "no channel was added or closed";
  // The real channel still carries tensors.
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(2, "w", PoolTensor(1, DataType::kFloat32, {256}, 2)));
}

TEST_P(ZeroCopyTest, KeysAtTheNameLimitWorkAndLongerOnesFailClearly) {
  StartCluster(2);
  // Size the edge name so that the whole key is exactly the limit.
  const size_t edge = kMaxKeyBytes - (Key(1, "a").full_key.size() - 1);
  const std::string at_limit(edge, 'a');
  ParsedKey key = Key(1, at_limit);
  ASSERT_EQ(key.full_key.size(), kMaxKeyBytes);
  Tensor t = PoolTensor(1, DataType::kInt8, {10}, 3);
  ASSERT_TRUE(Step(1, 1)->Send(key, t).ok());
  PendingRecv ok(*Step(0, 1), key);
  ASSERT_TRUE(ok.Wait());
  ASSERT_TRUE(ok.status().ok()) << ok.status();
  EXPECT_TRUE(ok.tensor().ContentEquals(t));

  // One byte more is refused where the key is made, so no Send can take a key that a protocol
  // cannot carry.
  absl::StatusOr<ParsedKey> too_long = ParsedKey::Parse(ParsedKey::Create(
      server(1).device_name(), server(1).incarnation(), server(0).device_name(), at_limit + "b"));
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(too_long.status().message()), HasSubstr("2048"));
}

TEST_P(ZeroCopyTest, WaitForPeersSetsUpNoChannelAndAPairsFirstTensorSetsUpItsOwn) {
  StartCluster(3);
  for (int t = 0; t < 3; ++t) {
    absl::Status s = server(t).WaitForPeers(absl::Seconds(20));
    ASSERT_TRUE(s.ok()) << s;
  }
  for (int t = 0; t < 3; ++t) EXPECT_EQ(transport(t).NumReadyChannels(), 0u) << t;
  // Task 0 receives from task 1: task 0's channel to 1, which task 1 accepts, and nothing else.
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(1, "first", PoolTensor(1, DataType::kFloat32, {64}, 4)));
  EXPECT_EQ(transport(0).NumReadyChannels(), 1u);
  EXPECT_EQ(transport(1).NumReadyChannels(), 1u);
  EXPECT_EQ(transport(2).NumReadyChannels(), 0u) << "a task nobody exchanged with has none";
}

TEST_P(ZeroCopyTest, SetUpChannelsSetsUpEveryChannel) {
  StartCluster(3);
  for (int t = 0; t < 3; ++t) {
    ASSERT_TRUE(server(t).WaitForPeers(absl::Seconds(20)).ok());
    absl::Status s = server(t).SetUpChannels(absl::Seconds(20));
    ASSERT_TRUE(s.ok()) << s;
  }
  // Each task owns a channel to each peer and accepted one from each.
  for (int t = 0; t < 3; ++t) EXPECT_EQ(transport(t).NumReadyChannels(), 4u) << t;
}

TEST_P(ZeroCopyTest, PerTransferAndCopyRegistrationStrategies) {
  for (const char* strategy : {"per-transfer", "copy"}) {
    SCOPED_TRACE(strategy);
    StartCluster(2, [strategy](ServerOptions& o) {
      o.verbs.channel.registration = *protocol::ParseRegistration(strategy);
      NoPush(o);
    });
    for (int step = 1; step <= 3; ++step) {
      ASSERT_NO_FATAL_FAILURE(
          SendAndRecv(step, "g", PoolTensor(1, DataType::kUInt16, {1000}, step)));
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

TEST_P(ZeroCopyTest, OneMessageSlotAndEveryPollModeWork) {
  const std::vector<std::pair<const char*, int>> configs = {
      {"busy", 32}, {"blocking", 32}, {"adaptive", 32}, {"adaptive", 1}};
  for (const auto& [mode, batch] : configs) {
    SCOPED_TRACE(absl::StrCat(mode, ", batch ", batch));
    StartCluster(2, [mode = mode, batch = batch](ServerOptions& o) {
      o.verbs.channel.message_slots = 1;
      o.verbs.channel.message_batch = batch;
      o.verbs.poll_mode = mode;
      NoPush(o);
    });
    std::vector<std::unique_ptr<PendingRecv>> recvs;
    for (int i = 0; i < 200; ++i) {
      recvs.push_back(std::make_unique<PendingRecv>(*Step(0, 1), Key(1, absl::StrCat("s", i))));
    }
    for (int i = 0; i < 200; ++i) {
      ASSERT_TRUE(
          Step(1, 1)
              ->Send(Key(1, absl::StrCat("s", i)), PoolTensor(1, DataType::kFloat32, {16}, i))
              .ok());
    }
    for (int i = 0; i < 200; ++i) {
      ASSERT_TRUE(recvs[i]->Wait());
      ASSERT_TRUE(recvs[i]->status().ok()) << recvs[i]->status();
      EXPECT_TRUE(recvs[i]->tensor().ContentEquals(PoolTensor(1, DataType::kFloat32, {16}, i)));
    }
    // 200 REQUESTs and 200 RE_REQUESTs (the meta-data was not cached) behind one slot.
    const VerbsStats& rx = transport(0).stats();
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

INSTANTIATE_TEST_SUITE_P(Protocols, ZeroCopyTest,
                         ::testing::ValuesIn(Combine({&kGrpcVerbs}, kEveryFabric)), ParamName);

// TENSORVERBS_CHANNEL_IDLE_MS, for every design of the transport and every fabric.
class IdleChannelTest : public ProtocolTest {
 protected:
  // Waits (up to 20 s) until task `t` holds `n` ready channels.
  bool ReadyChannelsBecome(int t, size_t n) {
    for (absl::Time until = absl::Now() + absl::Seconds(20); absl::Now() < until;
         absl::SleepFor(absl::Milliseconds(20))) {
      if (transport(t).NumReadyChannels() == n) return true;
    }
    return false;
  }
};

// A channel with nothing pending and nothing moving for the idle time is given back by both
// ends: its owner closes it, its acceptor once a probe finds the owner's end gone. The next
// tensor sets up a new one and arrives intact, and tensors that come at about the idle time,
// where a give-back and a new recv meet, all arrive, once each. (A channel holding requests
// made ahead, TENSORVERBS_PUSH, is not idle: its sender may be writing one; push is off here.)
TEST_P(IdleChannelTest, AnIdleChannelIsGivenBackAndTheNextTensorSetsUpANewOne) {
  StartCluster(2, [](ServerOptions& o) {
    o.verbs.channel.push = false;
    o.verbs.channel.idle_close = absl::Milliseconds(300);
    o.transfer.peer_timeout = absl::Seconds(4);  // the acceptor asks every second
  });
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(1, "a", PoolTensor(1, DataType::kFloat32, {4096}, 1)));
  EXPECT_EQ(transport(0).NumReadyChannels(), 1u);
  EXPECT_EQ(transport(1).NumReadyChannels(), 1u);
  EXPECT_TRUE(ReadyChannelsBecome(0, 0)) << "the owner kept its idle channel";
  EXPECT_TRUE(ReadyChannelsBecome(1, 0)) << "the acceptor kept a channel its owner gave back";
  EXPECT_EQ(transport(0).stats().channel_errors.load(), 0) << "a give-back is no error";
  EXPECT_EQ(transport(1).stats().channel_errors.load(), 0);

  ASSERT_NO_FATAL_FAILURE(SendAndRecv(2, "b", PoolTensor(1, DataType::kFloat32, {4096}, 2)));
  EXPECT_EQ(transport(0).NumReadyChannels(), 1u) << "set up again";
  for (int i = 0; i < 8; ++i) {
    absl::SleepFor(absl::Milliseconds(200 + 30 * i));  // 200 to 410 ms: either side of 300
    ASSERT_NO_FATAL_FAILURE(
        SendAndRecv(3 + i, "c", PoolTensor(1, DataType::kFloat32, {4096}, 3 + i)));
  }
}

// Zero keeps channels for the task's life.
TEST_P(IdleChannelTest, ZeroKeepsChannels) {
  StartCluster(2, [](ServerOptions& o) {
    o.verbs.channel.idle_close = absl::ZeroDuration();
    o.transfer.peer_timeout = absl::Seconds(4);
  });
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(1, "a", PoolTensor(1, DataType::kFloat32, {4096}, 1)));
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_EQ(transport(0).NumReadyChannels(), 1u);
  EXPECT_EQ(transport(1).NumReadyChannels(), 1u);
}

INSTANTIATE_TEST_SUITE_P(Protocols, IdleChannelTest,
                         ::testing::ValuesIn(Combine(kVerbsFamily, kEveryFabric)), ParamName);

// 256 MiB runs over the two same-host fabrics: the others and the other designs move it by the
// same code path as the 64 MiB fixture, which runs everywhere.
class HugeTensorTest : public ProtocolTest {};

TEST_P(HugeTensorTest, A256MiBTensorAndAnEmptyOneInPlace) {
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
  ExpectCopies(design().pool_to_pool, 2, CopyCounts());
}

INSTANTIATE_TEST_SUITE_P(Protocols, HugeTensorTest,
                         ::testing::ValuesIn(Combine({&kGrpcVerbs}, {&kShmem, &kShm})), ParamName);

// Designs other than grpc+verbs on its transport: a task of another protocol must not connect.
class MixedProtocolTest : public ProtocolTest {};

TEST_P(MixedProtocolTest, TasksOfDifferentProtocolsRefuseToConnectAndSaySo) {
  // Task 0 receives over grpc+verbs and sets up a channel to task 1, which runs this protocol.
  StartCluster(2, nullptr, {"grpc+verbs", design().protocol});
  PendingRecv recv(*Step(0, 1), Key(1, "x"));
  ASSERT_TRUE(recv.Wait());
  EXPECT_EQ(recv.status().code(), absl::StatusCode::kFailedPrecondition) << recv.status();
  EXPECT_THAT(std::string(recv.status().message()),
              AllOf(HasSubstr(design().protocol), HasSubstr("--protocol")));
}

INSTANTIATE_TEST_SUITE_P(Protocols, MixedProtocolTest,
                         ::testing::ValuesIn(Combine({&kGrpcVerbsCopy, &kGrpcGdr}, kEveryFabric)),
                         ParamName);

// Designs that lend tensors to their readers.
class LendingTest : public ProtocolTest {};

TEST_P(LendingTest, LentTensorsAreReleasedWhenTheirLeaseEnds) {
  recv_timeout_ = absl::Milliseconds(300);
  StartCluster(2, [](ServerOptions& o) { o.transfer.peer_timeout = absl::Milliseconds(200); });
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

// A step aborted while its requests wait at the sender, which sends right after: the sends race
// the abort's way to the sender, so the sender may lend tensors for requests whose recvs have
// already ended. Only the answers name those leases, so the receiver takes them and releases
// each unread; none is left to its lease's end.
TEST_P(LendingTest, TensorsSentJustAfterTheReceiverAbortedAreReleased) {
  StartCluster(2);
  constexpr int kKeys = 200;
  std::vector<std::unique_ptr<PendingRecv>> recvs;
  for (int i = 0; i < kKeys; ++i) {
    recvs.push_back(std::make_unique<PendingRecv>(*Step(0, 3), Key(1, absl::StrCat("t", i))));
  }
  absl::SleepFor(absl::Milliseconds(200));  // the requests reach the sender
  Step(0, 3)->StartAbort(absl::CancelledError("step 3 cancelled by the user"));
  for (int i = 0; i < kKeys; ++i) {
    ASSERT_TRUE(
        Step(1, 3)
            ->Send(Key(1, absl::StrCat("t", i)), PoolTensor(1, DataType::kFloat32, {4096}, i))
            .ok());
  }
  for (auto& r : recvs) {
    ASSERT_TRUE(r->Wait());
    EXPECT_EQ(r->status().code(), absl::StatusCode::kCancelled) << r->status();
  }
  ExpectNothingLent(1);
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(4, "next", PoolTensor(1, DataType::kFloat32, {4096}, 99)));
  for (auto& r : recvs) EXPECT_EQ(r->calls(), 1);
}

INSTANTIATE_TEST_SUITE_P(Protocols, LendingTest,
                         ::testing::ValuesIn(Combine(With(&ProtocolDesign::lends_tensors),
                                                     kEveryFabric)),
                         ParamName);

}  // namespace
}  // namespace tensorverbs::protocol_conformance
