// The protocol layer's channel table, push-ahead bookkeeping and landed store, on their own:
// channels found by id, endpoint and task, closed ones dropped (and why accepted ones closed,
// remembered), a task's older accepted channels closed when it sets up a new one; the push
// budget and its conditions; landed tensors kept per (peer, key, step).
#include "src/protocol/channel_table.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>

#include "absl/time/clock.h"
#include "src/protocol/push_ahead.h"
#include "tests/unit/protocol/channel_harness.h"

namespace tensorverbs::protocol::channel_testing {
namespace {

// Channels of one task (`side_`) in a table of the test's own, not connected to anyone.
class ChannelTableTest : public ::testing::Test {
 protected:
  Channel* AddChannel(Channel::Role role, const std::string& peer, uint64_t peer_channel_id = 0) {
    auto c = std::make_unique<Channel>(&side_.env, role, table_.NextId(), peer);
    c->set_peer_channel_id(peer_channel_id);
    EXPECT_TRUE(c->Init().ok());
    return table_.Add(std::move(c));
  }

  Side side_{kOwnerTaskIndex, kOwnerIncarnation};
  ChannelTable table_{[this] { return side_.OnOwnerThread(); }};
  const std::string peer_ = TaskName(kJob, 1);
};

TEST_F(ChannelTableTest, ChannelsAreFoundByIdByTaskAndByTheOwnersChannelId) {
  Channel* owner = AddChannel(Channel::Role::kOwner, peer_);
  Channel* accepted = AddChannel(Channel::Role::kAcceptor, peer_, /*peer_channel_id=*/7);
  EXPECT_NE(owner->id(), accepted->id());
  EXPECT_EQ(table_.Find(owner->id()), owner);
  EXPECT_EQ(table_.Find(accepted->id()), accepted);
  EXPECT_EQ(table_.Find(999), nullptr);
  EXPECT_EQ(table_.OwnerFor(peer_), owner) << "the owner channel receives from the peer";
  EXPECT_EQ(table_.OwnerFor(TaskName(kJob, 2)), nullptr);
  EXPECT_EQ(table_.AcceptedFrom(peer_, 7), accepted);
  EXPECT_EQ(table_.AcceptedFrom(peer_, 8), nullptr);
  EXPECT_EQ(table_.NumReady(), 0u) << "neither is connected";
  EXPECT_EQ(table_.Snapshot().size(), 2u);
}

TEST_F(ChannelTableTest, AClosedOwnerChannelIsNoLongerTheTasksAndIsDroppedAtHousekeeping) {
  Channel* owner = AddChannel(Channel::Role::kOwner, peer_);
  const uint64_t id = owner->id();
  owner->Close(absl::UnavailableError("link down"));
  EXPECT_EQ(table_.OwnerFor(peer_), nullptr) << "a closed channel receives nothing";
  EXPECT_EQ(table_.Find(id), owner) << "still there until housekeeping";
  table_.Housekeeping(absl::Now(), nullptr);
  EXPECT_EQ(table_.Find(id), nullptr);
}

TEST_F(ChannelTableTest, APinnedClosedChannelStaysFoundByIdButNotByTask) {
  Channel* owner = AddChannel(Channel::Role::kOwner, peer_);
  const uint64_t id = owner->id();
  owner->Close(absl::UnavailableError("link down"));
  table_.Housekeeping(absl::Now(), [id](uint64_t pinned) { return pinned == id; });
  EXPECT_EQ(table_.Find(id), owner) << "a set-up call still names it";
  EXPECT_EQ(table_.OwnerFor(peer_), nullptr);
  table_.Housekeeping(absl::Now(), nullptr);
  EXPECT_EQ(table_.Find(id), nullptr);
}

TEST_F(ChannelTableTest, WhyADroppedAcceptedChannelClosedIsRemembered) {
  Channel* accepted = AddChannel(Channel::Role::kAcceptor, peer_, /*peer_channel_id=*/7);
  EXPECT_EQ(table_.WhyAcceptedClosed(peer_, 7), nullptr);
  accepted->Close(absl::DataLossError("bad slot"));
  table_.Housekeeping(absl::Now(), nullptr);
  EXPECT_EQ(table_.AcceptedFrom(peer_, 7), nullptr);
  const absl::Status* why = table_.WhyAcceptedClosed(peer_, 7);
  ASSERT_NE(why, nullptr);
  EXPECT_EQ(why->code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(why->message()), HasSubstr("bad slot"));
}

TEST_F(ChannelTableTest, ANewChannelFromATaskClosesItsOlderAcceptedOnesByWhy) {
  Channel* older = AddChannel(Channel::Role::kAcceptor, peer_, 1);
  Channel* kept = AddChannel(Channel::Role::kAcceptor, peer_, 2);
  Channel* other_task = AddChannel(Channel::Role::kAcceptor, TaskName(kJob, 2), 1);
  Channel* owner = AddChannel(Channel::Role::kOwner, peer_);
  // Not connected, so their peer incarnation is 0: a new incarnation means a restart.
  table_.CloseAcceptedFrom(peer_, /*incarnation=*/0, kept);
  EXPECT_EQ(older->state(), Channel::State::kClosed);
  EXPECT_EQ(older->close_status().code(), absl::StatusCode::kCancelled) << older->close_status();
  EXPECT_THAT(std::string(older->close_status().message()), HasSubstr("replaced the channel"));
  EXPECT_NE(kept->state(), Channel::State::kClosed);
  EXPECT_NE(other_task->state(), Channel::State::kClosed);
  EXPECT_NE(owner->state(), Channel::State::kClosed) << "only accepted channels";
  table_.CloseAcceptedFrom(peer_, /*incarnation=*/42, nullptr);
  EXPECT_EQ(kept->close_status().code(), absl::StatusCode::kAborted) << kept->close_status();
  EXPECT_THAT(std::string(kept->close_status().message()), HasSubstr("restarted"));
}

TEST_F(ChannelTableTest, CloseAllClosesEveryChannelAndClearDropsThem) {
  Channel* a = AddChannel(Channel::Role::kOwner, peer_);
  Channel* b = AddChannel(Channel::Role::kAcceptor, peer_, 3);
  const uint64_t ida = a->id(), idb = b->id();
  table_.CloseAll(absl::CancelledError("shutting down"));
  EXPECT_EQ(a->state(), Channel::State::kClosed);
  EXPECT_EQ(b->state(), Channel::State::kClosed);
  table_.Clear();
  EXPECT_EQ(table_.Find(ida), nullptr);
  EXPECT_EQ(table_.Find(idb), nullptr);
  EXPECT_EQ(table_.OwnerFor(peer_), nullptr);
}

class PushAheadTest : public ::testing::Test {
 protected:
  KeyRef Key(const std::string& name) {
    return MakeKeyRef(*ParsedKey::Parse(
        ParsedKey::Create(CpuDeviceName(kJob, kAcceptorTaskIndex), kAcceptorIncarnation,
                          CpuDeviceName(kJob, kOwnerTaskIndex), name)));
  }
  void Cache(const KeyRef& key, uint64_t elements) {
    TensorMetaData meta;
    meta.dtype = DataType::kFloat32;
    meta.shape = TensorShape::Of({static_cast<int64_t>(elements)});
    meta.tensor_bytes = elements * 4;
    side_.memory.CacheMeta(key->key.full_key, meta);
  }

  Side side_{kOwnerTaskIndex, kOwnerIncarnation};
};

TEST_F(PushAheadTest, APushNeedsACachedSmallTensorNoRecvInFlightAndRoomInTheBudget) {
  PushAhead push({.max_requests = 2, .max_bytes = 4096});
  const KeyRef a = Key("a"), b = Key("b"), c = Key("c"), big = Key("big"), unknown = Key("u");
  for (const KeyRef& k : {a, b, c}) Cache(k, 256);  // 1 KiB each
  Cache(big, 1 << 20);                              // 4 MiB: beyond what is pushed
  PushAhead::KeyState* sa = push.StateOf(a);
  ASSERT_NE(sa, nullptr);
  EXPECT_EQ(push.Plan(*sa, a, nullptr, side_.memory), std::optional<uint64_t>(1024));
  EXPECT_EQ(push.Plan(*push.StateOf(unknown), unknown, nullptr, side_.memory), std::nullopt)
      << "no cached meta-data: the destination's size is unknown";
  EXPECT_EQ(push.Plan(*push.StateOf(big), big, nullptr, side_.memory), std::nullopt);
  sa->active = 1;
  EXPECT_EQ(push.Plan(*sa, a, nullptr, side_.memory), std::nullopt) << "a recv of it is in flight";
  sa->active = 0;
  push.Made(sa, /*index=*/5, 1024);
  EXPECT_EQ(sa->pushed, 5u);
  EXPECT_EQ(push.Plan(*sa, a, nullptr, side_.memory), std::nullopt) << "already pushed";
  PushAhead::KeyState* sb = push.StateOf(b);
  push.Made(sb, 6, 1024);
  EXPECT_EQ(push.Plan(*push.StateOf(c), c, nullptr, side_.memory), std::nullopt)
      << "two requests is the budget";
  push.Unmade(a, 5, 1024);
  EXPECT_EQ(sa->pushed, PushAhead::kNoPush);
  EXPECT_EQ(push.Plan(*push.StateOf(c), c, nullptr, side_.memory), std::optional<uint64_t>(1024))
      << "an adopted or finished push gives its place back";
}

TEST_F(PushAheadTest, TheByteBudgetBoundsTheDestinations) {
  PushAhead push({.max_requests = 100, .max_bytes = 1536});
  const KeyRef a = Key("a"), b = Key("b");
  Cache(a, 256);
  Cache(b, 256);
  push.Made(push.StateOf(a), 1, 1024);
  EXPECT_EQ(push.Plan(*push.StateOf(b), b, nullptr, side_.memory), std::nullopt)
      << "1 KiB more would pass 1.5 KiB";
}

TEST(LandedStoreTest, ATensorIsTakenOnceByItsOwnRecvAndDroppedWithItsStepOrItsTime) {
  LandedStore store;
  const absl::Time now = absl::Now();
  Tensor t = *Tensor::Allocate(CpuAllocator(), DataType::kFloat32, TensorShape::Of({4}));
  store.Keep("/job:w/task:1", "k", 3, t, now + absl::Seconds(10));
  store.Keep("/job:w/task:1", "k", 4, t, now + absl::Seconds(10));
  store.Keep("/job:w/task:2", "k", 5, t, now + absl::Seconds(1));
  EXPECT_EQ(store.Take("/job:w/task:2", "k", 3), std::nullopt) << "another peer's";
  EXPECT_EQ(store.Take("/job:w/task:1", "other", 3), std::nullopt) << "another key's";
  std::optional<Tensor> got = store.Take("/job:w/task:1", "k", 3);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->data(), t.data()) << "the landed tensor itself, no copy";
  EXPECT_EQ(store.Take("/job:w/task:1", "k", 3), std::nullopt) << "taken once";
  store.DropStep(4);
  EXPECT_EQ(store.Take("/job:w/task:1", "k", 4), std::nullopt) << "its step ended";
  store.Expire(now + absl::Seconds(2));
  EXPECT_TRUE(store.empty()) << "past its time";
}

}  // namespace
}  // namespace tensorverbs::protocol::channel_testing
