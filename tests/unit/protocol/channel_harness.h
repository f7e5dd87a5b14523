// The harness of the grpc+verbs channel's unit tests: an owner and an acceptor channel over two
// in-process loopback domains, with the test playing both progress threads (Side::Turn runs one
// turn of one side's loop: posted tasks, completions, then the user callbacks, inline). No
// Server and no gRPC, so every message, counter and close reason is the channel's own.
//
// Everything runs on the test's thread; ChannelEnv::on_owner_thread holds it to that.
#ifndef TENSORVERBS_TESTS_UNIT_PROTOCOL_CHANNEL_HARNESS_H_
#define TENSORVERBS_TESTS_UNIT_PROTOCOL_CHANNEL_HARNESS_H_

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <ostream>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/common/executor.h"
#include "src/common/state_table.h"
#include "src/fabric/fabric.h"
#include "src/fabric/loopback/loopback.h"
#include "src/protocol/channel.h"
#include "src/protocol/channel_env.h"
#include "src/protocol/channel_table.h"
#include "src/protocol/local_tensor_inbox.h"
#include "src/protocol/memory_mgr.h"
#include "src/protocol/message.h"
#include "src/protocol/push_ahead.h"
#include "src/rendezvous/remote_rendezvous.h"
#include "src/rendezvous/rendezvous_mgr.h"
#include "src/tensor/allocator.h"
#include "tensorverbs/device_name.h"
#include "tensorverbs/parsed_key.h"
#include "tensorverbs/tensor.h"
#include "tests/support/state_rows.h"

namespace tensorverbs::protocol::channel_testing {

using ::tensorverbs::testing::ExpectEveryRowWalked;
using ::tensorverbs::testing::RowsTaken;
using ::tensorverbs::testing::RowWalk;
using ::tensorverbs::testing::Walk;

using ::testing::HasSubstr;

inline constexpr char kJob[] = "worker";
inline constexpr int kOwnerTaskIndex = 0;
inline constexpr int kAcceptorTaskIndex = 1;
inline constexpr uint64_t kOwnerIncarnation = 0x0123456789abcdef;
inline constexpr uint64_t kAcceptorIncarnation = 0x00000000feedbeef;
inline constexpr uint64_t kOwnerChannelId = 1;
inline constexpr uint64_t kAcceptorChannelId = 2;

// The acceptor's per-step rendezvous. Its task only sends in these tests, so a remote recv
// through it is a test bug, not something to serve.
class LocalOnlyRendezvous final : public RemoteRendezvous {
 public:
  using RemoteRendezvous::RemoteRendezvous;

 protected:
  void RecvFromRemoteAsync(const ParsedKey& key, const RecvArgs& args,
                           RecvDoneCallback done) override {
    ADD_FAILURE() << "unexpected remote recv of " << key.full_key;
    std::move(done)(absl::UnimplementedError("local-only rendezvous"), Tensor(), false);
  }
};

// What one recv's callback saw. `calls` is how the tests prove "exactly once".
struct RecvOutcome {
  int calls = 0;
  absl::Status status;
  Tensor tensor;
  bool is_dead = false;
};

// One task's end of the channel: its fabric domain, pool, memory manager, worker, and what a
// VerbsTransport would supply (the ChannelHost, the channel table, the landed store), with the
// progress loop's queues kept here so the test decides when they run. Members are in
// dependency order: the channel table (and with it the channel) goes first, the domain last.
struct Side : public ChannelHost {
  Side(int task_index, uint64_t incarnation)
      : domain(*fabric::OpenDomain("loopback", {})),
        // Small and not pre-touched: a test needs a few MiB, not the server's 64.
        pool(absl::StrCat("pool", task_index),
             PoolAllocator::Options{.region_bytes = size_t{4} << 20, .pretouch = false}),
        // Every strategy tested here takes remote writes only, as the transport registers them.
        memory(domain.get(), &pool, RemoteAccessFor(VerbsMode::kZeroCopy)),
        owner_thread(std::this_thread::get_id()) {
    worker.job = kJob;
    worker.task = task_index;
    worker.task_name = TaskName(kJob, task_index);
    worker.incarnation = incarnation;
    worker.recv_allocator = &pool;
    worker.callback_executor = &executor;
    worker.stats = &transfer_stats;

    env.worker = &worker;
    env.memory = &memory;
    env.domain = domain.get();
    env.stats = &stats;
    env.host = this;
    env.channels = &table;
    env.landed = &landed;
    env.local_tensors = &local_tensors;
    // The plain walk: no request made ahead (the push tests turn it on), no recv deadline and
    // no slow-recv warning unless a test sets them.
    env.options.push = false;
    env.transfer.recv_timeout = absl::InfiniteDuration();
    env.transfer.slow_recv_warning = absl::ZeroDuration();
  }

  // ChannelHost.
  // From any thread, as the transport's: a GPU copier's thread posts staged parts.
  void Post(absl::AnyInvocable<void() &&> task) override {
    std::lock_guard<std::mutex> lock(posted_mu);
    posted.push_back(std::move(task));
  }
  void Deliver(ProgressEngine::RecvDelivery d) override {
    callbacks.push_back(
        [d = std::move(d)]() mutable { std::move(d.done)(d.status, d.tensor, d.is_dead); });
  }
  void Quarantine(std::vector<Tensor> memory, absl::Time until) override {
    quarantined.push_back({std::move(memory), until});
  }
  void ReleaseLent(const std::string& task, uint32_t tensor_key) override {
    if (on_release_lent) on_release_lent(task, tensor_key);
  }
  // The test thread plays both progress threads; anything else touching a channel is a bug
  // the DCHECKs of a sanitizer build report.
  bool OnOwnerThread() const override { return std::this_thread::get_id() == owner_thread; }
  // The harness connects its channels itself (Pair); nothing here makes one through a peer.
  void Connect(const std::string& task, const std::string& address,
               const proto::ConnectRequest& request, ConnectAnswered answered) override {
    ADD_FAILURE() << "unexpected Connect to " << task;
  }

  // Tasks the channel posted (ACKs, local tensors that became ready), and what they post in
  // turn. True if any ran.
  bool RunPosted() {
    bool ran = false;
    for (;;) {
      absl::AnyInvocable<void() &&> task;
      {
        std::lock_guard<std::mutex> lock(posted_mu);
        if (posted.empty()) return ran;
        task = std::move(posted.front());
        posted.pop_front();
      }
      std::move(task)();
      ran = true;
    }
  }

  // The turn's user callbacks go to the executor together, as ProgressEngine hands them over.
  bool RunCallbacks() {
    if (callbacks.empty()) return false;
    executor.ScheduleAll(&callbacks);
    return true;
  }

  // A further lane (ChannelEnv::lanes): a loopback domain of its own, with its own
  // registrations of the pool, as VerbsTransport opens one per rail. Before the channel exists.
  void AddLane() {
    lane_domain = *fabric::OpenDomain("loopback", {});
    lane_memory = std::make_unique<RdmaMemoryMgr>(lane_domain.get(), &pool,
                                                  RemoteAccessFor(VerbsMode::kZeroCopy));
    env.lanes.push_back({lane_domain.get(), lane_memory.get(), "loopback lane"});
  }

  // One turn of this side's progress loop. True if anything happened.
  bool Turn() {
    bool active = RunPosted();
    active |= PollInto(domain.get(), endpoint);
    if (lane_domain != nullptr) active |= PollInto(lane_domain.get(), lane_endpoint);
    active |= RunPosted();
    active |= RunCallbacks();
    return active;
  }

  // Hands what `polled` completed to the channel, by the endpoint it had when it connected
  // (`routed`), as the transport's table does: a channel that closed earlier in this batch
  // still gets (and ignores) the rest.
  bool PollInto(fabric::Domain* polled, const fabric::Endpoint* routed) {
    fabric::Completion completions[64];
    absl::StatusOr<size_t> n = polled->Poll(absl::MakeSpan(completions));
    EXPECT_TRUE(n.ok()) << n.status();
    for (size_t i = 0; n.ok() && i < *n; ++i) {
      if (channel != nullptr && completions[i].endpoint == routed) {
        channel->OnCompletion(completions[i]);
      } else {
        ++unrouted;
      }
    }
    return n.ok() && *n > 0;
  }

  struct Quarantined {
    std::vector<Tensor> memory;
    absl::Time until;
  };

  std::unique_ptr<fabric::Domain> domain;
  PoolAllocator pool;
  RdmaMemoryMgr memory;
  std::unique_ptr<fabric::Domain> lane_domain;  // AddLane
  std::unique_ptr<RdmaMemoryMgr> lane_memory;
  Executor executor{"callbacks", 0};  // callbacks run inline, on the test thread
  TransferStats transfer_stats;
  WorkerEnv worker;
  VerbsStats stats;
  const std::thread::id owner_thread;
  std::mutex posted_mu;
  std::deque<absl::AnyInvocable<void() &&>> posted;  // guarded by posted_mu
  std::vector<Executor::Task> callbacks;
  std::vector<Quarantined> quarantined;
  int unrouted = 0;
  fabric::Endpoint* endpoint = nullptr;           // the channel's, once connected
  fabric::Endpoint* lane_endpoint = nullptr;      // its lane 1's, once connected
  std::unique_ptr<RendezvousMgr> rendezvous_mgr;  // acceptor only
  // grpc+gdr tests: what ReleaseLent reports to.
  std::function<void(const std::string& task, uint32_t tensor_key)> on_release_lent;
  LandedStore landed;
  ChannelEnv env;
  LocalTensorInbox local_tensors{&env};
  ChannelTable table{[this] { return OnOwnerThread(); }};
  Channel* channel = nullptr;  // in `table`
};

// Two tasks' ends of one channel. Each test runs with the state tables' tap installed
// (RowsTaken): a test can ask which rows it took, and TearDown fails on a move that is no row.
class ChannelTest : public ::testing::Test {
 protected:
  // Lets a derived fixture choose the mode and registration strategy before the channels exist.
  virtual void Configure(ChannelEnv* env) {}
  // False: the test connects the channels itself (ConnectChannels).
  virtual bool ConnectOnSetUp() const { return true; }

  void SetUp() override {
    RowsTaken::Clear();
    SetTransitionTap(&RowsTaken::Tap);
    acceptor_.rendezvous_mgr = std::make_unique<RendezvousMgr>([this](int64_t step_id) {
      return std::make_shared<LocalOnlyRendezvous>(&acceptor_.worker, step_id);
    });
    acceptor_.env.rendezvous_mgr = acceptor_.rendezvous_mgr.get();
    Configure(&owner_.env);
    Configure(&acceptor_.env);
    auto owner = std::make_unique<Channel>(&owner_.env, Channel::Role::kOwner, kOwnerChannelId,
                                           acceptor_.worker.task_name);
    auto acceptor = std::make_unique<Channel>(&acceptor_.env, Channel::Role::kAcceptor,
                                              kAcceptorChannelId, owner_.worker.task_name);
    acceptor->set_peer_channel_id(kOwnerChannelId);
    ASSERT_TRUE(owner->Init().ok());
    ASSERT_TRUE(acceptor->Init().ok());
    owner_.channel = owner_.table.Add(std::move(owner));
    acceptor_.channel = acceptor_.table.Add(std::move(acceptor));
    if (ConnectOnSetUp()) {
      ASSERT_NO_FATAL_FAILURE(ConnectChannels());
    }
  }

  void ConnectChannels() {
    // What VerbsService.Connect exchanges: each end's endpoint and message-buffer description.
    Channel& o = *owner_.channel;
    Channel& a = *acceptor_.channel;
    absl::Status s =
        a.Connect(o.endpoint()->LocalAddress(), o.message_buffer()->rx_addr(),
                  o.message_buffer()->rx_key(), o.message_buffer()->rx_slots(), kOwnerIncarnation);
    ASSERT_TRUE(s.ok()) << s;
    s = o.Connect(a.endpoint()->LocalAddress(), a.message_buffer()->rx_addr(),
                  a.message_buffer()->rx_key(), a.message_buffer()->rx_slots(),
                  kAcceptorIncarnation);
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_EQ(o.state(), Channel::State::kReady);
    ASSERT_EQ(a.state(), Channel::State::kReady);
    owner_.endpoint = o.endpoint();
    acceptor_.endpoint = a.endpoint();
    if (owner_.lane_domain == nullptr || acceptor_.lane_domain == nullptr) return;
    // What ChannelEnd.lanes carries: each end's further lanes, connected in order.
    std::vector<std::string> owner_lanes, acceptor_lanes;
    for (fabric::Endpoint* ep : o.FurtherLaneEndpoints()) owner_lanes.push_back(ep->LocalAddress());
    for (fabric::Endpoint* ep : a.FurtherLaneEndpoints()) {
      acceptor_lanes.push_back(ep->LocalAddress());
    }
    ASSERT_TRUE(a.ConnectLanes(owner_lanes).ok());
    ASSERT_TRUE(o.ConnectLanes(acceptor_lanes).ok());
    ASSERT_EQ(o.lanes(), 2u);
    ASSERT_EQ(a.lanes(), 2u);
    owner_.lane_endpoint = o.lane_endpoint(1);
    acceptor_.lane_endpoint = a.lane_endpoint(1);
    // And each end's probe word, then the owner's probe, whose echo makes lane 1 carry stripes.
    auto probes = [](Channel& c) {
      std::vector<Channel::LaneProbe> out;
      absl::StatusOr<Channel::LaneProbe> p = c.LaneProbeTarget(1);
      EXPECT_TRUE(p.ok()) << p.status();
      out.push_back(p.ok() ? *p : Channel::LaneProbe());
      return out;
    };
    a.SetPeerLaneProbes(probes(o));
    o.SetPeerLaneProbes(probes(a));
    o.ProbeLanes();
    if (wait_for_probes_) {
      ASSERT_TRUE(Pump([&] { return o.striping_lanes() == 2; })) << "lane 1's probe came back";
    }
  }
  // Whether ConnectChannels waits for lane 1's probe to come back.
  bool wait_for_probes_ = true;

  void TearDown() override {
    // Completions for a channel's endpoint always reach that channel.
    EXPECT_EQ(owner_.unrouted, 0);
    EXPECT_EQ(acceptor_.unrouted, 0);
    EXPECT_THAT(RowsTaken::Refused(), ::testing::IsEmpty())
        << "moves that are no row of these state tables";
  }
  ~ChannelTest() override { SetTransitionTap(nullptr); }

  // One turn of both progress loops. True if anything happened.
  bool Turn() {
    const bool owner = owner_.Turn();
    const bool acceptor = acceptor_.Turn();
    return owner || acceptor;
  }

  // Turns the loops, one side at a time, until `until` holds: it is checked after each side's
  // turn, so a test can stop between a message being sent and the peer acting on it.
  ::testing::AssertionResult Pump(const std::function<bool()>& until,
                                  absl::Duration timeout = absl::Seconds(10)) {
    const absl::Time deadline = absl::Now() + timeout;
    for (Side* side = &owner_; !until(); side = side == &owner_ ? &acceptor_ : &owner_) {
      if (absl::Now() > deadline) {
        return ::testing::AssertionFailure() << "not reached within " << timeout;
      }
      side->Turn();
    }
    return ::testing::AssertionSuccess();
  }

  // Turns both loops until neither has anything left to do, so that "nothing more happened"
  // can be asserted.
  void Settle() {
    for (int idle = 0, turns = 0; idle < 3 && turns < 10000; ++turns) {
      idle = Turn() ? 0 : idle + 1;
    }
  }

  // A key the acceptor's task sends and the owner's task receives; `src_task` and
  // `incarnation` name a different sender for the error cases.
  static ParsedKey Key(const std::string& name, int src_task = kAcceptorTaskIndex,
                       uint64_t incarnation = kAcceptorIncarnation) {
    return *ParsedKey::Parse(ParsedKey::Create(CpuDeviceName(kJob, src_task), incarnation,
                                               CpuDeviceName(kJob, kOwnerTaskIndex), name));
  }

  // A control message of `type` for `key` in step 1 under request `index`, for tests that
  // write what a misbehaving peer would.
  static Message Control(MessageType type, const ParsedKey& key, uint32_t index) {
    Message m;
    m.type = type;
    m.name = key.full_key;
    m.step_id = 1;
    m.request_index = index;
    return m;
  }
  static Tensor Floats(Allocator* allocator, int64_t n, float scale) {
    Tensor t = *Tensor::Allocate(allocator, DataType::kFloat32, TensorShape::Of({n}));
    for (int64_t i = 0; i < n; ++i) t.flat<float>()[i] = scale * static_cast<float>(i);
    return t;
  }

  std::shared_ptr<RecvOutcome> StartRecv(int64_t step_id, const ParsedKey& key,
                                         absl::Time deadline = absl::InfiniteFuture(),
                                         Allocator* allocator = nullptr,
                                         RecvLanding landing = RecvLanding()) {
    auto outcome = std::make_shared<RecvOutcome>();
    owner_.channel->receiving()->StartRecv(
        step_id, keys_.Intern(key), allocator != nullptr ? allocator : &owner_.pool,
        std::move(landing), deadline,
        [outcome](const absl::Status& s, const Tensor& t, bool is_dead) {
          ++outcome->calls;
          outcome->status = s;
          outcome->tensor = t;
          outcome->is_dead = is_dead;
        });
    return outcome;
  }

  void Send(int64_t step_id, const ParsedKey& key, const Tensor& value, bool is_dead = false) {
    absl::StatusOr<std::shared_ptr<RemoteRendezvous>> r = acceptor_.rendezvous_mgr->Find(step_id);
    ASSERT_TRUE(r.ok()) << r.status();
    absl::Status s = (*r)->Send(key, value, is_dead);
    ASSERT_TRUE(s.ok()) << s;
  }

  // Sends `value` and receives it in `step_id`, returning what arrived once both sides are
  // done (the sender counts a content write at its local completion, after the receiver may
  // already have the tensor).
  std::shared_ptr<RecvOutcome> Transfer(int64_t step_id, const ParsedKey& key,
                                        const Tensor& value) {
    Send(step_id, key, value);
    std::shared_ptr<RecvOutcome> out = StartRecv(step_id, key);
    EXPECT_TRUE(Pump([&] { return out->calls > 0; }));
    Settle();
    return out;
  }

  static int64_t Get(const std::atomic<int64_t>& counter) { return counter.load(); }

  // A protocol violation closes the receiving side's channel with DataLoss naming it.
  static void ExpectClosedWithDataLoss(const Side& side, const std::string& reason) {
    ASSERT_EQ(side.channel->state(), Channel::State::kClosed);
    EXPECT_EQ(side.channel->close_status().code(), absl::StatusCode::kDataLoss)
        << side.channel->close_status();
    EXPECT_THAT(std::string(side.channel->close_status().message()), HasSubstr(reason));
    EXPECT_EQ(Get(side.stats.channel_errors), 1);
  }

  KeyTable keys_;  // as the transport does: every recv of a key shares one copy
  Side owner_{kOwnerTaskIndex, kOwnerIncarnation};
  Side acceptor_{kAcceptorTaskIndex, kAcceptorIncarnation};
};

}  // namespace tensorverbs::protocol::channel_testing

#endif  // TENSORVERBS_TESTS_UNIT_PROTOCOL_CHANNEL_HARNESS_H_
