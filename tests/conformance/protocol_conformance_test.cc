// The protocol conformance suite's core (protocol_fixture.h): every fixture arrives intact, copies
// and meta-data round trips are what each design says, limits and bounds hold, sender-side
// errors and aborts end each recv once, and the counters count what moved.
#include "src/protocol/memory_mgr.h"
#include "src/tensor/adopted_memory.h"
#include "tests/conformance/protocol_fixture.h"

namespace tensorverbs::protocol_conformance {
namespace {

TEST_P(ProtocolTest, EveryFixtureArrivesIntactWithItsDeadness) {
  StartCluster(2);
  // tcp;ofi_rxm moves 64 MiB slowly here.
  const bool big =
      GetParam().fabric != &kTcp && (!kUnderThreadSanitizer || design().big_fixture_under_tsan);
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
    ASSERT_TRUE(recvs[i]->Wait(absl::Seconds(90))) << f.name;
    ASSERT_TRUE(recvs[i]->status().ok()) << f.name << ": " << recvs[i]->status();
    EXPECT_EQ(recvs[i]->is_dead(), f.is_dead) << f.name;
    if (!f.is_dead) {
      EXPECT_TRUE(recvs[i]->tensor().ContentEquals(f.tensor))
          << f.name << ": got " << recvs[i]->tensor().DebugString();
    }
    EXPECT_EQ(recvs[i]->calls(), 1) << f.name;
  }
  // The receiving task counted every recv and its bytes (what `tensorverbs demo` reports).
  int64_t bytes = 0;
  for (const auto& r : recvs) bytes += static_cast<int64_t>(r->tensor().TotalBytes());
  EXPECT_EQ(server(0).stats().tensors.load(), static_cast<int64_t>(fixtures.size()));
  EXPECT_EQ(server(0).stats().bytes.load(), bytes);
  EXPECT_EQ(server(0).stats().errors.load(), 0);
  ExpectNothingLent(1);
}

TEST_P(ProtocolTest, SteadyStateCopiesAndMetaDataRoundTripsAreWhatTheDesignSays) {
  StartCluster(2, NoPush);
  constexpr int kSteps = 10;
  // 256 KiB: above grpc+gdr's inline limit, and small enough for its reads over shm, which
  // take seconds per MiB under TSan.
  const std::vector<int64_t> dims = {64, 1024};
  std::vector<Tensor> sent;
  for (int step = 1; step <= kSteps; ++step) {
    Tensor t = PoolTensor(1, DataType::kFloat32, dims, step);
    Tensor got;
    ASSERT_NO_FATAL_FAILURE(SendAndRecv(step, "weights", t, &got));
    // The result is pool memory: the content landed (or was copied) where tensors live.
    MemoryRegion region;
    EXPECT_TRUE(server(0).recv_allocator()->FindRegion(got.data(), 1, &region)) << step;
    sent.push_back(t);
    server(0).rendezvous_mgr()->Cleanup(step);
    server(1).rendezvous_mgr()->Cleanup(step);
  }
  const VerbsStats& rx = verbs_stats(0);
  const VerbsStats& tx = verbs_stats(1);
  // A sender counts a transfer at its local completion, which may come after the receiver's.
  const int64_t transfers = design().on_verbs_transport ? kSteps : 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (tx.content_writes.load() < transfers && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ExpectCopies(design().pool_to_pool, kSteps, CopyCounts());
  ExpectMetaDataRoundTrips(sent, MetaDataCounts());
  EXPECT_EQ(tx.content_writes.load(), transfers);
  const int64_t tensor_bytes = int64_t{kSteps} * sent[0].TotalBytes();
  const int64_t moved = tx.content_bytes.load() + rx.content_bytes.load();
  if (design().frames_content) {
    EXPECT_GT(moved, tensor_bytes);
  } else {
    EXPECT_EQ(moved, design().on_verbs_transport ? tensor_bytes : 0);
  }
  EXPECT_EQ(rx.dropped_imms.load() + tx.dropped_imms.load(), 0);
  EXPECT_EQ(rx.channel_errors.load() + tx.channel_errors.load(), 0);
  ExpectNothingLent(1);
  // A small tensor: over grpc+gdr it goes inline in the RecvTensor response, as over grpc.
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(99, "small", PoolTensor(1, DataType::kInt32, {4}, 9)));
}

TEST_P(ProtocolTest, ChangingShapesTakeTheMetaDataRoundTripsTheDesignSays) {
  StartCluster(2, NoPush);
  int64_t step = 0;
  {
    SCOPED_TRACE("a shape that changes every step, in size or only in its dims");
    const MetaDataCounts before = CountMetaData();
    std::vector<Tensor> sent;
    for (int i = 1; i <= 8; ++i) {
      sent.push_back(PoolTensor(1, DataType::kInt64, {i, 3 + i % 2}, i));
      ASSERT_NO_FATAL_FAILURE(SendAndRecv(++step, "activations", sent.back()));
    }
    ExpectMetaDataRoundTrips(sent, before);
  }
  {
    SCOPED_TRACE("a tensor that grows, stays, shrinks, empties and comes back");
    const MetaDataCounts before = CountMetaData();
    std::vector<Tensor> sent;
    for (int64_t size : {100, 1000, 500, 5000, 5000, 10, 0, 0, 7}) {
      sent.push_back(PoolTensor(1, DataType::kInt64, {size}, static_cast<uint32_t>(size)));
      ASSERT_NO_FATAL_FAILURE(SendAndRecv(++step, "act", sent.back()));
    }
    ExpectMetaDataRoundTrips(sent, before);
  }
  ExpectNothingLent(1);
}

TEST_P(ProtocolTest, UnregisteredDestinationsAndSourcesGoThroughRegisteredCopies) {
  StartCluster(2);
  RecvArgs to_heap;
  to_heap.allocator = CpuAllocator();  // heap memory the fabric never registered
  // The heap source goes first, as in the suites this one replaced. After pool transfers TSan
  // often reports grpc+gdr's staging copy on the sender and the receiver's loopback read of it
  // as a race: the only order between them runs through gRPC's uninstrumented threads.
  CopyCounts before = CountCopies();
  Tensor heap = Tensor::Make(DataType::kFloat64, TensorShape::Of({4096}));  // not pool memory
  testing::FillPattern(heap, 5);
  Tensor got;
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(1, "h", heap, &got, to_heap));
  EXPECT_EQ(got.allocator(), CpuAllocator());
  ExpectCopies(design().heap_to_heap, 1, before);

  before = CountCopies();
  Tensor pooled = PoolTensor(1, DataType::kFloat64, {333}, 5);
  for (int step = 2; step <= 3; ++step) {
    ASSERT_NO_FATAL_FAILURE(SendAndRecv(step, "w", pooled, &got, to_heap));
    EXPECT_EQ(got.allocator(), CpuAllocator());
  }
  ExpectCopies(design().pool_to_heap, 2, before);
  ExpectNothingLent(1);
}

// Host memory a task adopted from its owner (Task::AdoptHostMemory; the torch backend's sends):
// from kRegisterSourcesFrom bytes grpc+verbs writes from it directly, registered for that write
// alone, and the owner gets it back once, after the peer has it.
TEST_P(ProtocolTest, LargeSourcesOutsideThePoolAreWrittenFromWhereTheyAre) {
  StartCluster(2);
  std::vector<float> owned(protocol::kRegisterSourcesFrom / sizeof(float) * 4);
  std::atomic<int> released{0};
  absl::StatusOr<Tensor> adopted =
      AdoptMemory(MemoryPlacement::Host(), owned.data(), DataType::kFloat32,
                  TensorShape::Of({static_cast<int64_t>(owned.size())}),
                  [&released] { released.fetch_add(1); });
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  testing::FillPattern(*adopted, 9);
  const Tensor expected = *adopted->Clone(CpuAllocator());
  const int64_t registrations = verbs_stats(1).transient_registrations.load();
  const CopyCounts before = CountCopies();
  Tensor got;
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(1, "adopted", *adopted, &got));
  EXPECT_TRUE(got.ContentEquals(expected));
  ExpectCopies(design().large_heap_to_pool, 1, before);
  if (design().protocol == std::string("grpc+verbs")) {
    EXPECT_EQ(verbs_stats(1).transient_registrations.load() - registrations, 1);
  }
  adopted->Clear();
  for (int i = 0; i < 500 && released.load() == 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(released.load(), 1) << "the sender let go of the adopted memory once";
  ExpectNothingLent(1);
}

// Memory of the caller's to land in (RecvArgs::into, the torch backend's recvs): grpc+verbs lands
// a tensor of its dtype and shape there where the fabric can write it (every fabric here but the
// same-host one, which reaches only memory it shares), and the caller gets it back once, after
// the recv's result let go. Elsewhere, and for a tensor that does not match, it stays untouched.
TEST_P(ProtocolTest, ARecvIntoTheCallersMemoryLandsThereWhereTheFabricCanWriteIt) {
  StartCluster(2);
  const bool in_place =
      design().protocol == std::string("grpc+verbs") && GetParam().fabric != &kShmem;
  const int64_t n = static_cast<int64_t>(protocol::kRegisterSourcesFrom / sizeof(float) * 4);
  const TensorShape shape = TensorShape::Of({n});
  // Without and with the expected meta-data: the destination named by RE_REQUEST, then by
  // REQUEST itself; and a tensor of another dtype, which lands in the pool.
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    std::vector<float> owned(n, -1.0f);
    std::atomic<int> released{0};
    absl::StatusOr<Tensor> into =
        AdoptMemory(MemoryPlacement::Host(), owned.data(), DataType::kFloat32, shape,
                    [&released] { released.fetch_add(1); });
    ASSERT_TRUE(into.ok()) << into.status();
    RecvArgs args;
    args.into = *std::move(into);
    if (round == 1) {
      args.expected_dtype = DataType::kFloat32;
      args.expected_shape = shape;
    }
    const bool matches = round < 2;
    const Tensor sent =
        PoolTensor(1, matches ? DataType::kFloat32 : DataType::kInt32, {n}, 10 + round);
    const int64_t before = verbs_stats(0).in_place_recvs.load();
    Tensor got;
    ASSERT_NO_FATAL_FAILURE(SendAndRecv(round + 1, absl::StrCat("into", round), sent, &got, args));
    args.into.Clear();
    const bool landed_there = in_place && matches;
    EXPECT_EQ(got.data() == owned.data(), landed_there);
    EXPECT_EQ(verbs_stats(0).in_place_recvs.load() - before, landed_there ? 1 : 0);
    if (landed_there) {
      EXPECT_EQ(std::memcmp(owned.data(), sent.data(), sent.TotalBytes()), 0);
      EXPECT_EQ(released.load(), 0) << "the result still shares the caller's memory";
    } else {
      EXPECT_EQ(owned[0], -1.0f);
      EXPECT_EQ(owned[n - 1], -1.0f);
    }
    got.Clear();
    for (int i = 0; i < 500 && released.load() == 0; ++i) absl::SleepFor(absl::Milliseconds(10));
    EXPECT_EQ(released.load(), 1) << "the task let go of the caller's memory once";
  }
  ExpectNothingLent(1);
}

// A recv into the caller's memory that fails while its destination is out (an aborted step)
// keeps that memory until the sender has answered: the late content lands there, before the
// caller gets it back, and never after.
TEST_P(ProtocolTest, AnAbortedRecvIntoTheCallersMemoryGivesItBackOnlyAfterTheLateContent) {
  StartCluster(2);
  const bool in_place =
      design().protocol == std::string("grpc+verbs") && GetParam().fabric != &kShmem;
  const int64_t n = static_cast<int64_t>(protocol::kRegisterSourcesFrom / sizeof(float) * 4);
  std::vector<float> owned(n, -1.0f);
  std::atomic<int> released{0};
  std::atomic<bool> content_at_release{false};
  const Tensor sent = PoolTensor(1, DataType::kFloat32, {n}, 77);
  absl::StatusOr<Tensor> into = AdoptMemory(
      MemoryPlacement::Host(), owned.data(), DataType::kFloat32, TensorShape::Of({n}), [&] {
        content_at_release.store(std::memcmp(owned.data(), sent.data(), sent.TotalBytes()) == 0);
        released.fetch_add(1);
      });
  ASSERT_TRUE(into.ok()) << into.status();
  RecvArgs args;
  args.into = *std::move(into);
  args.expected_dtype = DataType::kFloat32;  // the destination goes out with REQUEST
  args.expected_shape = TensorShape::Of({n});
  const int64_t requests = verbs_stats(0).requests.load();
  auto recv = std::make_unique<PendingRecv>(*Step(0, 3), Key(1, "late"), args);
  args.into.Clear();
  if (design().requests_over_channel) {
    // REQUEST, naming the destination, has gone: from here the record keeps it until the
    // sender answers. (An abort before would end the recv with nothing named.)
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (verbs_stats(0).requests.load() == requests && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    ASSERT_GT(verbs_stats(0).requests.load(), requests) << "the REQUEST never went";
  }
  absl::SleepFor(absl::Milliseconds(100));  // the request reaches the sender
  Step(0, 3)->StartAbort(absl::CancelledError("step 3 cancelled by the user"));
  ASSERT_TRUE(recv->Wait());
  EXPECT_EQ(recv->status().code(), absl::StatusCode::kCancelled) << recv->status();
  if (in_place) {
    EXPECT_EQ(released.load(), 0) << "the destination is still out";
  }
  ASSERT_TRUE(Step(1, 3)->Send(Key(1, "late"), sent).ok());
  for (int i = 0; i < 500 && released.load() == 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(released.load(), 1);
  if (in_place) {
    EXPECT_TRUE(content_at_release.load()) << "the late content landed first";
  }
  // The channel keeps working and the recv ended once.
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(4, "next", PoolTensor(1, DataType::kFloat32, {4096}, 99)));
  EXPECT_EQ(recv->calls(), 1);
  EXPECT_EQ(verbs_stats(0).channel_errors.load(), 0);
  ExpectNothingLent(1);
}

// A receiver that accepts tensors of at most 64 KiB: a larger one fails its recv, naming the
// key and the variable, before anything is allocated for it; smaller ones keep arriving, step
// after step (pushed requests and cached meta-data included).
TEST_P(ProtocolTest, ATensorAboveTheReceiversLimitFailsItsRecvAndOthersStillArrive) {
  max_tensor_bytes_ = 64 << 10;
  StartCluster(2);
  for (int64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    const Tensor big = PoolTensor(1, DataType::kUInt8, {128 << 10}, 5);
    const Tensor small = PoolTensor(1, DataType::kFloat32, {1024}, 6);
    ASSERT_TRUE(Step(1, step)->Send(Key(1, "big"), big).ok());
    ASSERT_TRUE(Step(1, step)->Send(Key(1, "small"), small).ok());
    PendingRecv refused(*Step(0, step), Key(1, "big"));
    PendingRecv fine(*Step(0, step), Key(1, "small"));
    ASSERT_TRUE(refused.Wait());
    ASSERT_TRUE(fine.Wait());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("TENSORVERBS_MAX_TENSOR_MB"));
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("big"));
    ASSERT_TRUE(fine.status().ok()) << fine.status();
    EXPECT_TRUE(fine.tensor().ContentEquals(small));
    server(0).rendezvous_mgr()->Cleanup(step);
    server(1).rendezvous_mgr()->Cleanup(step);
  }
  // A refused tensor that was lent is released at once, not when its lease ends.
  ExpectNothingLent(1);
  // The refusal is not remembered as the name's meta-data: once the tensor fits, it arrives.
  const Tensor fits = PoolTensor(1, DataType::kUInt8, {1024}, 7);
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(4, "big", fits));
  ExpectNothingLent(1);
  // Strings cost a string object each however short their encoding: 4096 empty ones are a few
  // KiB on the wire and 128 KiB of objects, above the limit.
  const Tensor names = Tensor::Make(DataType::kString, TensorShape::Of({4096}));
  ASSERT_TRUE(Step(1, 5)->Send(Key(1, "names"), names).ok());
  PendingRecv strings(*Step(0, 5), Key(1, "names"));
  ASSERT_TRUE(strings.Wait());
  EXPECT_EQ(strings.status().code(), absl::StatusCode::kResourceExhausted) << strings.status();
  EXPECT_THAT(std::string(strings.status().message()), HasSubstr("names"));
}

// A receiver may ask for steps its sender has not started; how many such steps one task holds
// is bounded (TENSORVERBS_MAX_PEER_STEPS), requests beyond fail at once, and the steps within
// the bound still deliver when the sender gets to them.
TEST_P(ProtocolTest, StepsStartedByPeersAreBoundedAndTheOnesWithinTheBoundDeliver) {
  max_peer_steps_ = 3;
  StartCluster(2, NoPush);  // a pushed request would start the next step too
  ASSERT_TRUE(server(0).WaitForPeers(absl::Seconds(30)).ok());
  std::vector<std::unique_ptr<PendingRecv>> recvs;
  for (int64_t step = 1; step <= 5; ++step) {
    recvs.push_back(std::make_unique<PendingRecv>(*Step(0, step), Key(1, "ahead")));
    if (step <= 3) {
      // The sender holds each request before the next is made, so the first three are the
      // ones it took (their order across steps is otherwise not promised).
      const absl::Time deadline = absl::Now() + absl::Seconds(10);
      while (server(1).rendezvous_mgr()->NumPeerSteps() < static_cast<size_t>(step) &&
             absl::Now() < deadline) {
        absl::SleepFor(absl::Milliseconds(2));
      }
      ASSERT_EQ(server(1).rendezvous_mgr()->NumPeerSteps(), static_cast<size_t>(step));
    }
  }
  for (int i : {3, 4}) {
    ASSERT_TRUE(recvs[i]->Wait()) << "step " << i + 1;
    EXPECT_EQ(recvs[i]->status().code(), absl::StatusCode::kResourceExhausted)
        << recvs[i]->status();
    EXPECT_THAT(std::string(recvs[i]->status().message()),
                HasSubstr("TENSORVERBS_MAX_PEER_STEPS=3"));
  }
  for (int64_t step = 1; step <= 3; ++step) {
    ASSERT_TRUE(Step(1, step)->Send(Key(1, "ahead"), PoolTensor(1, DataType::kInt32, {8}, 9)).ok());
    ASSERT_TRUE(recvs[step - 1]->Wait()) << "step " << step;
    ASSERT_TRUE(recvs[step - 1]->status().ok()) << recvs[step - 1]->status();
  }
  EXPECT_EQ(server(1).rendezvous_mgr()->NumPeerSteps(), 0u);
}

// What anyone who reaches a task's port can send: a request larger than any real one is
// refused by gRPC before a service parses it, and a key that is not UTF-8 is an ordinary bad
// key (proto3 `string` fields would fail the parse and log an error per request instead).
TEST_P(ProtocolTest, OversizedAndNonUtf8RequestsAreRefusedCleanly) {
  StartCluster(1);
  const std::string address = *server(0).cluster().TaskAddress("worker", 0);
  auto stub = proto::WorkerService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  auto recv_tensor = [&stub](const std::string& key) {
    proto::RecvTensorRequest request;
    request.set_step_id(1);
    request.set_rendezvous_key(key);
    proto::RecvTensorResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    return stub->RecvTensor(&context, request, &response);
  };
  grpc::Status huge = recv_tensor(std::string(64 << 10, 'k'));
  EXPECT_EQ(huge.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << huge.error_message();
  grpc::Status not_utf8 = recv_tensor(std::string("\xff\xfe;\xc0\x80;key", 9));
  EXPECT_FALSE(not_utf8.ok());
  EXPECT_NE(not_utf8.error_code(), grpc::StatusCode::INTERNAL) << not_utf8.error_message();
  EXPECT_NE(not_utf8.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << "answered, not hung";
  // The server still serves.
  proto::GetStatusResponse status_response;
  grpc::ClientContext context;
  EXPECT_TRUE(stub->GetStatus(&context, proto::GetStatusRequest(), &status_response).ok());
}

TEST_P(ProtocolTest, SenderSideErrorsReachTheReceiverWithCodeAndMessage) {
  StartCluster(2);
  // A key made for another incarnation of the sender.
  ParsedKey stale = *ParsedKey::Parse(ParsedKey::Create(
      server(1).device_name(), server(1).incarnation() ^ 1, server(0).device_name(), "x"));
  PendingRecv wrong_incarnation(*Step(0, 5), stale);
  ASSERT_TRUE(wrong_incarnation.Wait());
  EXPECT_EQ(wrong_incarnation.status().code(), absl::StatusCode::kAborted)
      << wrong_incarnation.status();
  EXPECT_THAT(std::string(wrong_incarnation.status().message()),
              AllOf(HasSubstr("probably restarted"), HasSubstr("/job:worker/replica:0/task:1")));
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
  EXPECT_EQ(aborted.status().code(), absl::StatusCode::kInternal) << aborted.status();
  EXPECT_THAT(std::string(aborted.status().message()), HasSubstr("the producer op failed"));
  // Over the channel each went back as an ERROR_STATUS; otherwise as the call's status.
  if (design().requests_over_channel) {
    EXPECT_GE(verbs_stats(1).errors_sent.load(), 3);
  } else {
    EXPECT_EQ(verbs_stats(1).errors_sent.load(), 0);
  }
  // The channel (and the gRPC path) survived all of it.
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(8, "after", PoolTensor(1, DataType::kFloat32, {4096}, 1)));
  EXPECT_EQ(verbs_stats(0).channel_errors.load(), 0);
  for (PendingRecv* r : {&wrong_incarnation, &cleaned, &aborted}) EXPECT_EQ(r->calls(), 1);
  EXPECT_EQ(server(0).stats().errors.load(), 3) << "each failed recv is counted once";
  EXPECT_EQ(server(0).stats().tensors.load(), 1);
}

TEST_P(ProtocolTest, AbortMidFlightCompletesOnceAndLateContentLandsHarmlessly) {
  StartCluster(2);
  std::vector<std::unique_ptr<PendingRecv>> recvs;
  for (int i = 0; i < 20; ++i) {
    recvs.push_back(std::make_unique<PendingRecv>(*Step(0, 3), Key(1, absl::StrCat("t", i))));
  }
  absl::SleepFor(absl::Milliseconds(100));  // the requests reach the sender
  Step(0, 3)->StartAbort(absl::CancelledError("step 3 cancelled by the user"));
  for (auto& r : recvs) {
    ASSERT_TRUE(r->Wait());
    EXPECT_EQ(r->status().code(), absl::StatusCode::kCancelled) << r->status();
  }
  // The sender produces after all: the content goes to memory the aborted requests still own.
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(
        Step(1, 3)
            ->Send(Key(1, absl::StrCat("t", i)), PoolTensor(1, DataType::kFloat32, {4096}, i))
            .ok());
  }
  // The channel keeps working and nothing ran twice.
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(4, "next", PoolTensor(1, DataType::kFloat32, {4096}, 99)));
  absl::SleepFor(absl::Milliseconds(200));
  for (auto& r : recvs) EXPECT_EQ(r->calls(), 1);
  EXPECT_EQ(verbs_stats(0).channel_errors.load(), 0);
  ExpectNothingLent(1);
}

TEST_P(ProtocolTest, ManyConcurrentRecvsFromThreePeers) {
  StartCluster(4);
  constexpr int kPeers = 3;
  const int per_peer = kUnderThreadSanitizer ? design().concurrent_recvs_per_peer_under_tsan
                                             : design().concurrent_recvs_per_peer;
  // Every third tensor is pool memory above grpc+gdr's inline limit (which gdr reads); the
  // others are small heap tensors (which grpc+verbs stages).
  auto elements = [](int i) -> int64_t { return i % 3 == 0 ? 600 : 1 + i % 7; };
  std::vector<std::unique_ptr<PendingRecv>> recvs;
  recvs.reserve(kPeers * per_peer);
  auto receiver = Step(0, 9);
  for (int i = 0; i < per_peer; ++i) {
    for (int peer = 1; peer <= kPeers; ++peer) {
      recvs.push_back(std::make_unique<PendingRecv>(*receiver, Key(peer, absl::StrCat("k", i))));
    }
  }
  std::vector<std::thread> senders;
  for (int peer = 1; peer <= kPeers; ++peer) {
    senders.emplace_back([this, peer, per_peer, elements] {
      auto r = Step(peer, 9);
      for (int i = 0; i < per_peer; ++i) {
        const TensorShape shape = TensorShape::Of({elements(i)});
        Tensor t = i % 3 == 0
                       ? *Tensor::Allocate(server(peer).recv_allocator(), DataType::kInt32, shape)
                       : Tensor::Make(DataType::kInt32, shape);
        for (int64_t j = 0; j < t.NumElements(); ++j) t.flat<int32_t>()[j] = peer * 1000000 + i;
        ASSERT_TRUE(r->Send(Key(peer, absl::StrCat("k", i)), t).ok());
      }
    });
  }
  for (auto& s : senders) s.join();
  for (int i = 0; i < per_peer; ++i) {
    for (int peer = 1; peer <= kPeers; ++peer) {
      PendingRecv& r = *recvs[kPeers * i + (peer - 1)];
      ASSERT_TRUE(r.Wait(absl::Seconds(120))) << i;
      ASSERT_TRUE(r.status().ok()) << r.status();
      Tensor t = r.tensor();
      ASSERT_EQ(t.NumElements(), elements(i));
      for (int64_t j = 0; j < t.NumElements(); ++j) {
        ASSERT_EQ(t.flat<int32_t>()[j], peer * 1000000 + i) << "element " << j;
      }
    }
  }
  for (auto& r : recvs) EXPECT_EQ(r->calls(), 1);
  EXPECT_EQ(verbs_stats(0).channel_errors.load(), 0);
  for (int peer = 1; peer <= kPeers; ++peer) ExpectNothingLent(peer);
}

// A peer asking for more tensors at once than TENSORVERBS_MAX_RESPONSES gets ResourceExhausted
// for the excess at once; the requests within the bound are served. Over grpc+verbs and its copy
// mode the bound is the channel's responses; over grpc and grpc+gdr the RecvTensor calls held
// for that receiver.
TEST_P(ProtocolTest, RequestsBeyondTheResponseBoundFailAtOnce) {
  StartCluster(2, [](ServerOptions& o) {
    o.transfer.max_responses = 2;
    o.verbs.channel.push = false;
  });
  ASSERT_TRUE(server(0).WaitForPeers(absl::Seconds(30)).ok());
  std::vector<std::unique_ptr<PendingRecv>> recvs;
  for (int i = 0; i < 5; ++i) {
    recvs.push_back(std::make_unique<PendingRecv>(*Step(0, 1), Key(1, absl::StrCat("k", i))));
  }
  // The refused recvs end while the sender holds the others; on a loaded machine the refusals
  // take a while, so wait for them rather than give each a fixed time.
  auto ended = [&recvs] {
    int n = 0;
    for (auto& recv : recvs) n += recv->calls() > 0;
    return n;
  };
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (ended() < 3 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  absl::SleepFor(absl::Milliseconds(300));  // a fourth ending would be a bound not kept
  int exhausted = 0;
  for (auto& recv : recvs) {
    if (recv->calls() == 0) continue;  // held by the sender
    EXPECT_EQ(recv->status().code(), absl::StatusCode::kResourceExhausted) << recv->status();
    EXPECT_THAT(std::string(recv->status().message()), HasSubstr("TENSORVERBS_MAX_RESPONSES=2"));
    ++exhausted;
  }
  EXPECT_EQ(exhausted, 3);
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(Step(1, 1)
                    ->Send(Key(1, absl::StrCat("k", i)), PoolTensor(1, DataType::kInt8, {4}, i))
                    .ok());
  }
  int delivered = 0;
  for (auto& recv : recvs) {
    ASSERT_TRUE(recv->Wait());
    delivered += recv->status().ok();
  }
  EXPECT_EQ(delivered, 2);
}

// What `tensorverbs stats` and metrics files show: the receiver counts the tensors and bytes it
// received and the recv that failed; over the verbs protocols each task shows its channel (the
// receiver's from its peer, the sender's to it) with the same tensors and bytes; and the
// GetStats RPC answers what CollectStats sees.
TEST_P(ProtocolTest, StatsCountEachTasksAndEachChannelsTensorsAndBytes) {
  recv_timeout_ = absl::Seconds(30);
  StartCluster(2);
  ASSERT_TRUE(server(0).WaitForPeers(absl::Seconds(30)).ok());
  if (absl::string_view(design().protocol) == "grpc+gdr") {
    // grpc+gdr answers tensors this small inline over gRPC and sets up no channel for them; its
    // channel is set up here so that the stats have one to show.
    ASSERT_TRUE(server(0).SetUpChannels(absl::Seconds(30)).ok());
  }
  constexpr int kTensors = 4;
  for (int i = 0; i < kTensors; ++i) {
    ASSERT_NO_FATAL_FAILURE(
        SendAndRecv(1, absl::StrCat("s", i), PoolTensor(1, DataType::kFloat32, {256}, i)));
  }
  {
    PendingRecv cancelled(*Step(0, 2), Key(1, "never"));
    server(0).rendezvous_mgr()->Cleanup(2);
    ASSERT_TRUE(cancelled.Wait());
    ASSERT_FALSE(cancelled.status().ok());
  }
  const int64_t bytes = kTensors * 256 * 4;
  // Compared as strings: a const char* compared with a literal compares addresses.
  const absl::string_view protocol = design().protocol;
  proto::GetStatsResponse receiver = server(0).CollectStats();
  EXPECT_EQ(receiver.task_name(), "/job:worker/replica:0/task:0");
  EXPECT_EQ(receiver.protocol(), design().protocol);
  EXPECT_EQ(receiver.counters().at("tensors_received"), kTensors);
  EXPECT_EQ(receiver.counters().at("bytes_received"), bytes);
  EXPECT_EQ(receiver.counters().at("recv_errors"), 1);
  EXPECT_GT(receiver.counters().at("pool_bytes"), 0);
  if (design().on_verbs_transport) {
    EXPECT_FALSE(receiver.fabric().empty());
    const proto::ChannelStats* from_peer = nullptr;
    for (const proto::ChannelStats& c : receiver.channels()) {
      if (c.receives() && c.peer_task() == "/job:worker/replica:0/task:1") from_peer = &c;
    }
    ASSERT_NE(from_peer, nullptr) << receiver.DebugString();
    EXPECT_EQ(from_peer->state(), "ready");
    // The pool memory the tensors were written into is registered (grpc+gdr sends tensors this
    // small inline in its response).
    if (protocol != "grpc+gdr") {
      EXPECT_GE(receiver.counters().at("registered_regions"), 1);
      EXPECT_GE(receiver.counters().at("registered_bytes"), bytes);
    }
    if (from_peer->counters().contains("registrations") && protocol == "grpc+verbs") {
      // Per-channel keys: the peer wrote through registrations made for it alone.
      EXPECT_GE(from_peer->counters().at("registrations"), 1);
      EXPECT_GE(receiver.counters().at("channel_registrations"),
                from_peer->counters().at("registrations"));
    }
    if (protocol != "grpc+gdr") {  // gdr's tensors arrive by reads, outside channels
      EXPECT_EQ(from_peer->counters().at("tensors_received"), kTensors);
      EXPECT_EQ(from_peer->counters().at("bytes_received"), bytes);
      EXPECT_GE(from_peer->counters().at("requests"), kTensors);
      // The sender counts a write when its own completion arrives, which over tcp;ofi_rxm can
      // come after the receiver already has the bytes.
      proto::GetStatsResponse sender = server(1).CollectStats();
      for (const absl::Time deadline = absl::Now() + absl::Seconds(10);
           sender.counters().at("tensors_sent") < kTensors && absl::Now() < deadline;
           sender = server(1).CollectStats()) {
        absl::SleepFor(absl::Milliseconds(5));
      }
      const proto::ChannelStats* to_peer = nullptr;
      for (const proto::ChannelStats& c : sender.channels()) {
        if (!c.receives() && c.peer_task() == "/job:worker/replica:0/task:0") to_peer = &c;
      }
      ASSERT_NE(to_peer, nullptr) << sender.DebugString();
      EXPECT_EQ(to_peer->counters().at("tensors_sent"), kTensors);
      // Copy mode writes each payload with its header.
      EXPECT_GE(to_peer->counters().at("bytes_sent"), bytes);
      if (protocol == "grpc+verbs") {
        EXPECT_EQ(to_peer->counters().at("bytes_sent"), bytes);
      }
      EXPECT_EQ(sender.counters().at("tensors_sent"), kTensors);
    }
  } else {
    EXPECT_EQ(receiver.channels_size(), 0);
  }
  // The RPC answers the same.
  auto stub = proto::WorkerService::NewStub(grpc::CreateChannel(
      *server(0).cluster().TaskAddress("worker", 0), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  proto::GetStatsResponse answered;
  ASSERT_TRUE(stub->GetStats(&context, proto::GetStatsRequest(), &answered).ok());
  EXPECT_EQ(answered.counters().at("tensors_received"), kTensors);
  EXPECT_EQ(answered.channels_size(), receiver.channels_size());

  // Every counter reported, the task's and its channels', is one the catalog names (and so
  // one `tensorverbs stats` explains), and the task's are the list the server makes.
  for (const auto& [name, value] : receiver.counters()) {
    EXPECT_NE(FindCounter(name), nullptr) << name;
  }
  for (const proto::ChannelStats& c : receiver.channels()) {
    for (const auto& [name, value] : c.counters()) {
      EXPECT_NE(FindCounter(absl::StartsWith(name, "recv_errors_") ? "recv_errors_by_code" : name),
                nullptr)
          << name;
    }
  }
  for (const auto& [name, value] : server(0).Counters()) {
    EXPECT_TRUE(receiver.counters().contains(name)) << name;
  }
}

// A recv waiting longer than TENSORVERBS_SLOW_RECV_MS logs one warning naming its key, step and
// peer, however long it goes on waiting, and still completes when the tensor comes.
TEST_P(ProtocolTest, ARecvWaitingPastTheSlowThresholdIsNamedInOneWarning) {
  recv_timeout_ = absl::Seconds(30);
  StartCluster(2, [](ServerOptions& o) { o.transfer.slow_recv_warning = absl::Milliseconds(200); });
  ASSERT_TRUE(server(0).WaitForPeers(absl::Seconds(30)).ok());
  const ParsedKey key = Key(1, "late");
  ::testing::internal::CaptureStderr();
  PendingRecv late(*Step(0, 5), key);
  absl::SleepFor(absl::Milliseconds(1500));  // several housekeeping and watch periods
  ASSERT_TRUE(Step(1, 5)->Send(key, PoolTensor(1, DataType::kInt32, {16}, 5)).ok());
  const bool arrived = late.Wait(absl::Seconds(30));
  const std::string logged = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(arrived);
  EXPECT_TRUE(late.status().ok()) << late.status();
  const std::string warning =
      absl::StrCat("recv of '", key.full_key, "' in step 5 from task /job:worker/replica:0/task:1");
  size_t count = 0;
  for (size_t at = logged.find(warning); at != std::string::npos;
       at = logged.find(warning, at + 1)) {
    ++count;
  }
  EXPECT_EQ(count, 1u) << logged;
  EXPECT_THAT(logged, HasSubstr("TENSORVERBS_SLOW_RECV_MS=200"));
}

INSTANTIATE_TEST_SUITE_P(Protocols, ProtocolTest, ::testing::ValuesIn(EveryProtocol()), ParamName);

}  // namespace
}  // namespace tensorverbs::protocol_conformance
