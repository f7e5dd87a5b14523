// PeerChannels: how a task finds and makes its channels, accepts its peers' and starts recvs,
// with no transport: two tasks over in-process loopback domains, whose ChannelHost::Connect
// keeps each request for the test to carry to the other task's Accept and back. Each task's
// progress engine is started and stopped at once, so the test's thread owns the channels (as the
// thread that tears a transport down does).
#include "src/protocol/peer_channels.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "src/common/executor.h"
#include "src/fabric/fabric.h"
#include "src/protocol/local_tensor_inbox.h"
#include "src/protocol/message.h"
#include "src/protocol/push_ahead.h"
#include "src/rendezvous/rendezvous_mgr.h"
#include "src/tensor/allocator.h"
#include "tensorverbs/device_name.h"
#include "tensorverbs/parsed_key.h"
#include "tensorverbs/tensor.h"
#include "tests/unit/protocol/channel_harness.h"

namespace tensorverbs::protocol {
namespace {

using ::testing::HasSubstr;

const std::string& OwnerName() {
  static const std::string* name = new std::string(TaskName("worker", 0));
  return *name;
}
const std::string& AcceptorName() {
  static const std::string* name = new std::string(TaskName("worker", 1));
  return *name;
}

// One task: its fabric context, table, engine and PeerChannels, and the ChannelHost they use.
struct PeerTask : public ChannelHost {
  struct Call {
    std::string task;
    std::string address;
    proto::ConnectRequest request;
    ConnectAnswered answered;
  };

  PeerTask(const std::string& name, uint64_t incarnation)
      : pool(name + " pool",
             PoolAllocator::Options{.region_bytes = size_t{2} << 20, .pretouch = false}) {
    worker.job = "worker";
    worker.task_name = name;
    worker.incarnation = incarnation;
    worker.recv_allocator = &pool;
    worker.callback_executor = &executor;
    worker.stats = &transfer_stats;
    ChannelEnv shared;
    shared.worker = &worker;
    shared.stats = &stats;
    shared.host = this;
    shared.channels = &table;
    shared.options.push = false;
    std::unique_ptr<fabric::Domain> domain = *fabric::OpenDomain("loopback", {});
    auto memory =
        std::make_unique<RdmaMemoryMgr>(domain.get(), &pool, RemoteAccessFor(VerbsMode::kZeroCopy));
    fabrics.Add(FabricContext::Reach::kAnyPeer, std::move(domain), std::move(memory), shared);
    local_tensors = std::make_unique<LocalTensorInbox>(&fabrics.primary().env);
    fabrics.primary().env.local_tensors = local_tensors.get();
    ProgressEngine::Hooks hooks;
    hooks.on_completion = [this](const fabric::Completion& c) { table.Dispatch(c); };
    hooks.housekeeping = [](absl::Time) {};
    hooks.operations_in_flight = [] { return false; };
    engine = std::make_unique<ProgressEngine>(fabrics.polled(), &executor,
                                              ProgressEngine::Options{}, std::move(hooks));
    engine->Start();
    engine->Stop();  // from here on the test's thread owns the channels
    PeerChannels::Options options;
    options.task_addresses = {{OwnerName(), "owner:1"}, {AcceptorName(), "acceptor:2"}};
    channels = std::make_unique<PeerChannels>(std::move(options), &fabrics, &table, engine.get());
    fabrics.primary().env.landed = channels->landed();
  }
  ~PeerTask() override {
    table.CloseAll(absl::CancelledError("test over"));
    RunPosted();
    table.Clear();
  }

  // What the channels posted, run as the loop would at the end of its turn: never inside the
  // call that posted it (a channel's close posts the reap of its records).
  void RunPosted() {
    while (!posted.empty()) {
      absl::AnyInvocable<void()&&> task = std::move(posted.front());
      posted.erase(posted.begin());
      std::move(task)();
    }
  }

  // ChannelHost.
  void Post(absl::AnyInvocable<void() &&> task) override { posted.push_back(std::move(task)); }
  void Deliver(ProgressEngine::RecvDelivery d) override {
    std::move(d.done)(d.status, d.tensor, d.is_dead);
  }
  void Quarantine(std::vector<Tensor> memory, absl::Time until) override {}
  void ReleaseLent(const std::string& task, uint32_t tensor_key) override {}
  bool OnOwnerThread() const override { return true; }
  void Connect(const std::string& task, const std::string& address,
               const proto::ConnectRequest& request, ConnectAnswered answered) override {
    calls.push_back({task, address, request, std::move(answered)});
  }

  // Carries the oldest call to `peer`'s Accept and its answer back. The Accept's own status.
  absl::Status Answer(PeerTask& peer) {
    EXPECT_FALSE(calls.empty());
    if (calls.empty()) return absl::InternalError("no call");
    Call call = std::move(calls.front());
    calls.erase(calls.begin());
    proto::ConnectResponse response;
    absl::Status accepted = peer.channels->Accept(call.request, &response);
    if (accepted.ok()) {
      std::move(call.answered)(std::move(response));
    } else {
      std::move(call.answered)(accepted);
    }
    return accepted;
  }

  PoolAllocator pool;
  Executor executor{"callbacks", 0};
  TransferStats transfer_stats;
  WorkerEnv worker;
  VerbsStats stats;
  ChannelTable table;
  FabricContexts fabrics;
  std::unique_ptr<LocalTensorInbox> local_tensors;
  std::unique_ptr<ProgressEngine> engine;
  std::unique_ptr<PeerChannels> channels;
  std::vector<Call> calls;
  std::vector<absl::AnyInvocable<void() &&>> posted;
};

class PeerChannelsTest : public ::testing::Test {
 protected:
  // A recv of `tensor` from the acceptor in step 1; its outcome lands in `*status`, and
  // `*calls` counts its callbacks.
  RecvStart Recv(const std::string& tensor, absl::Status* status, int* calls,
                 const std::string& src_job = "worker", int src_task = 1) {
    RecvStart r;
    r.rendezvous = std::make_shared<channel_testing::LocalOnlyRendezvous>(&owner_.worker, 1);
    r.key = MakeKeyRef(*ParsedKey::Parse(ParsedKey::Create(CpuDeviceName(src_job, src_task), 0x2222,
                                                           CpuDeviceName("worker", 0), tensor)));
    r.allocator = &owner_.pool;
    r.deadline = absl::InfiniteFuture();
    r.done = [status, calls](const absl::Status& s, const Tensor&, bool) {
      *status = s;
      ++*calls;
    };
    return r;
  }

  PeerTask owner_{OwnerName(), 0x1111};
  PeerTask acceptor_{AcceptorName(), 0x2222};
};

TEST_F(PeerChannelsTest, AChannelIsMadeOnFirstUseAndReadyOnceItsPeerAnswers) {
  absl::StatusOr<Channel*> channel = owner_.channels->OwnerChannel(AcceptorName());
  ASSERT_TRUE(channel.ok()) << channel.status();
  EXPECT_EQ((*channel)->state(), Channel::State::kConnecting);
  EXPECT_TRUE(owner_.channels->SettingUp((*channel)->id()));
  ASSERT_EQ(owner_.calls.size(), 1u);
  const proto::ConnectRequest& request = owner_.calls[0].request;
  EXPECT_EQ(owner_.calls[0].task, AcceptorName());
  EXPECT_EQ(owner_.calls[0].address, "acceptor:2");
  EXPECT_EQ(request.task_name(), OwnerName());
  EXPECT_EQ(request.incarnation(), 0x1111u);
  EXPECT_EQ(request.fabric(), "loopback");
  EXPECT_EQ(request.protocol(), "grpc+verbs");
  EXPECT_EQ(request.channel_id(), (*channel)->id());
  EXPECT_EQ(request.end().wire_version(), kWireVersion);
  // Asked again before the answer: the same channel, and no second call.
  EXPECT_EQ(*owner_.channels->OwnerChannel(AcceptorName()), *channel);
  EXPECT_EQ(owner_.calls.size(), 1u);

  ASSERT_TRUE(owner_.Answer(acceptor_).ok());
  EXPECT_EQ((*channel)->state(), Channel::State::kReady);
  EXPECT_EQ((*channel)->peer_incarnation(), 0x2222u);
  EXPECT_FALSE(owner_.channels->SettingUp((*channel)->id()));
  EXPECT_FALSE(owner_.channels->PeerWritesDevice(AcceptorName()));
  EXPECT_EQ(acceptor_.table.NumReady(), 1u);
  EXPECT_EQ(owner_.table.NumReady(), 1u);
}

TEST_F(PeerChannelsTest, ATaskOutsideTheClusterHasNoChannelAndItsRecvFailsNamingTheKey) {
  absl::StatusOr<Channel*> channel = owner_.channels->OwnerChannel("/job:ps/replica:0/task:9");
  EXPECT_EQ(channel.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(channel.status().message(), HasSubstr("not in the cluster spec"));

  absl::Status status = absl::UnknownError("not run");
  int calls = 0;
  RecvStart r = Recv("from_a_stranger", &status, &calls, "ps", 9);
  const std::string key = r.key->key.full_key;
  owner_.channels->StartRecv(std::move(r));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr(key));
  EXPECT_TRUE(owner_.calls.empty());
}

TEST_F(PeerChannelsTest, AFailedCallClosesTheChannelNamingThePeerAndItsAddress) {
  absl::StatusOr<Channel*> channel = owner_.channels->OwnerChannel(AcceptorName());
  ASSERT_TRUE(channel.ok());
  const uint64_t id = (*channel)->id();
  std::move(owner_.calls[0].answered)(absl::DeadlineExceededError("no server"));
  Channel* closed = owner_.table.Find(id);
  ASSERT_NE(closed, nullptr);
  EXPECT_EQ(closed->state(), Channel::State::kClosed);
  // A peer that never answered is unavailable, not a deadline of the caller's.
  EXPECT_EQ(closed->close_status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(closed->close_status().message(), HasSubstr(AcceptorName()));
  EXPECT_THAT(closed->close_status().message(), HasSubstr("acceptor:2"));
  EXPECT_THAT(closed->close_status().message(), HasSubstr("no server"));
}

TEST_F(PeerChannelsTest, AcceptRefusesWhatDoesNotMatchAndLeavesNothingBehind) {
  ASSERT_TRUE(owner_.channels->OwnerChannel(AcceptorName()).ok());
  const proto::ConnectRequest good = owner_.calls[0].request;
  proto::ConnectResponse response;

  proto::ConnectRequest stranger = good;
  stranger.set_task_name("/job:ps/replica:0/task:9");
  absl::Status s = acceptor_.channels->Accept(stranger, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), HasSubstr("not a peer"));

  proto::ConnectRequest other_protocol = good;
  other_protocol.set_protocol("grpc+gdr");
  s = acceptor_.channels->Accept(other_protocol, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("grpc+gdr"));
  EXPECT_THAT(s.message(), HasSubstr("--protocol"));

  proto::ConnectRequest other_fabric = good;
  other_fabric.set_fabric("ofi/tcp;ofi_rxm");
  s = acceptor_.channels->Accept(other_fabric, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("TENSORVERBS_FABRIC"));

  proto::ConnectRequest old_wire = good;
  old_wire.mutable_end()->set_wire_version(0);
  s = acceptor_.channels->Accept(old_wire, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("1 or older"));

  proto::ConnectRequest restarted = good;
  restarted.set_expected_incarnation(0x9999);
  s = acceptor_.channels->Accept(restarted, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(s.message(), HasSubstr("restarted"));

  EXPECT_EQ(acceptor_.table.NumReady(), 0u);
  // And the real request still goes through.
  EXPECT_TRUE(owner_.Answer(acceptor_).ok());
  EXPECT_EQ(acceptor_.table.NumReady(), 1u);
}

TEST_F(PeerChannelsTest, TheAcceptorAnswersProbesOfItsChannelsAndOfOnesItNeverHad) {
  ASSERT_TRUE(owner_.channels->OwnerChannel(AcceptorName()).ok());
  const uint64_t owner_id = owner_.calls[0].request.channel_id();
  ASSERT_TRUE(owner_.Answer(acceptor_).ok());

  proto::CheckChannelRequest probe;
  probe.set_task_name(OwnerName());
  probe.set_channel_id(owner_id);
  proto::CheckChannelResponse answer;
  acceptor_.channels->CheckChannel(probe, &answer);
  EXPECT_TRUE(answer.open());
  EXPECT_EQ(answer.incarnation(), 0x2222u);

  probe.set_channel_id(owner_id + 100);
  answer.Clear();
  acceptor_.channels->CheckChannel(probe, &answer);
  EXPECT_FALSE(answer.open());
  EXPECT_THAT(answer.reason(), HasSubstr("no such channel"));
}

TEST_F(PeerChannelsTest, ARecvTakesATensorThatLandedAheadWithoutAChannel) {
  Tensor tensor = *Tensor::Allocate(&owner_.pool, DataType::kFloat32, TensorShape::Of({2}));
  tensor.flat<float>()[0] = 1.5f;
  tensor.flat<float>()[1] = 2.5f;
  absl::Status status = absl::UnknownError("not run");
  int calls = 0;
  RecvStart r = Recv("landed", &status, &calls);
  owner_.channels->landed()->Keep(AcceptorName(), r.key->key.full_key, 1, tensor,
                                  absl::Now() + absl::Minutes(1));
  owner_.channels->StartRecv(std::move(r));
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_TRUE(owner_.calls.empty());  // no channel was made for it
  EXPECT_EQ(owner_.table.NumReady(), 0u);
}

TEST_F(PeerChannelsTest, AnAbortedStepDropsWhatLandedForIt) {
  Tensor tensor = *Tensor::Allocate(&owner_.pool, DataType::kFloat32, TensorShape::Of({1}));
  owner_.channels->landed()->Keep(AcceptorName(), "k", 1, tensor, absl::Now() + absl::Minutes(1));
  owner_.channels->landed()->Keep(AcceptorName(), "k", 2, tensor, absl::Now() + absl::Minutes(1));
  owner_.channels->AbortStep(1, absl::CancelledError("step 1 was cleaned up"));
  EXPECT_FALSE(owner_.channels->landed()->Take(AcceptorName(), "k", 1).has_value());
  EXPECT_TRUE(owner_.channels->landed()->Take(AcceptorName(), "k", 2).has_value());
}

TEST_F(PeerChannelsTest, ARecvOfAnAbortedStepFailsAtOnceWithTheStepsStatus) {
  absl::Status status = absl::UnknownError("not run");
  int calls = 0;
  RecvStart r = Recv("aborted", &status, &calls);
  r.rendezvous->StartAbort(absl::AbortedError("step 1 was aborted by the test"));
  owner_.channels->StartRecv(std::move(r));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(owner_.calls.empty());
}

TEST_F(PeerChannelsTest, ARecvWithAnExpectedShapeCachesItsMetaDataForTheChannelsFabric) {
  absl::Status status = absl::UnknownError("not run");
  int calls = 0;
  RecvStart r = Recv("expected", &status, &calls);
  r.expected_dtype = DataType::kFloat32;
  r.expected_shape = TensorShape::Of({4, 4});
  const std::string key = r.key->key.full_key;
  owner_.channels->StartRecv(std::move(r));
  const TensorMetaData* cached = owner_.fabrics.primary().memory->CachedMeta(key);
  ASSERT_NE(cached, nullptr);
  EXPECT_EQ(cached->dtype, DataType::kFloat32);
  EXPECT_EQ(cached->tensor_bytes, 64u);
  // The recv waits on the channel being set up, and ends once when the channel does.
  EXPECT_EQ(owner_.calls.size(), 1u);
  EXPECT_EQ(calls, 0);
  owner_.table.CloseAll(absl::CancelledError("the test closes its channels"));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled);
}

// A message is judged lost only from an idle poll of the peer that came well after it was
// owed: a busy peer (no idle poll since, or one too early) keeps its channel, and so does a
// peer that decoded it (its ACK is late, not the message).
TEST(MessageLostTest, OnlyAnIdlePollWellAfterTheMessageWasOwedSaysItWasLost) {
  const absl::Time since = absl::FromUnixSeconds(1000);
  const Channel::AwaitedAck awaited{/*slots=*/5, since};
  const absl::Duration margin = absl::Seconds(5);
  const absl::Time sent = since + absl::Seconds(8);
  // The peer polled idle 1 s before it answered a probe sent 8 s after: lost.
  EXPECT_TRUE(PeerChannels::MessageLost(awaited, 4, absl::Seconds(1), sent, margin));
  // It decoded the slot: the ACK is what is missing, and it may be on its way.
  EXPECT_FALSE(PeerChannels::MessageLost(awaited, 5, absl::Seconds(1), sent, margin));
  EXPECT_FALSE(PeerChannels::MessageLost(awaited, 9, absl::Seconds(1), sent, margin));
  // Its last idle poll was 4 s before the answer: within the margin of the write.
  EXPECT_FALSE(PeerChannels::MessageLost(awaited, 4, absl::Seconds(4), sent, margin));
  // Never idle (a loop that has not caught up since it started): not lost.
  EXPECT_FALSE(PeerChannels::MessageLost(awaited, 4, std::nullopt, sent, margin));
  // A probe sent before the margin passed cannot say.
  EXPECT_FALSE(PeerChannels::MessageLost(awaited, 4, absl::ZeroDuration(), since + margin, margin));
}

}  // namespace
}  // namespace tensorverbs::protocol
