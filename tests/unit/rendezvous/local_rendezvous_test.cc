#include "src/rendezvous/local_rendezvous.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace tensorverbs {
namespace {

ParsedKey Key(const std::string& name) {
  return *ParsedKey::Parse(ParsedKey::Create("/job:a/replica:0/task:0/device:CPU:0", 1,
                                             "/job:a/replica:0/task:0/device:CPU:0", name));
}

Tensor Scalar(float v) {
  Tensor t = Tensor::Make(DataType::kFloat32, TensorShape());
  t.flat<float>()[0] = v;
  return t;
}

// Records each call and fails the test if a callback runs twice.
struct Recorder {
  std::atomic<int> calls{0};
  absl::Status status;
  Tensor tensor;
  bool is_dead = false;
  RecvDoneCallback Callback() {
    return [this](const absl::Status& s, const Tensor& t, bool dead) {
      EXPECT_EQ(calls.fetch_add(1), 0) << "callback ran twice";
      status = s;
      tensor = t;
      is_dead = dead;
    };
  }
};

TEST(LocalRendezvous, SendThenRecv) {
  LocalRendezvous r;
  ASSERT_TRUE(r.Send(Key("x"), Scalar(3), false).ok());
  EXPECT_EQ(r.NumPendingSends(), 1u);
  Recorder rec;
  EXPECT_EQ(r.RecvAsync(Key("x"), rec.Callback()), 0u);
  EXPECT_EQ(rec.calls, 1);
  EXPECT_TRUE(rec.status.ok());
  EXPECT_EQ(rec.tensor.flat<float>()[0], 3);
  EXPECT_EQ(r.NumPendingSends(), 0u);
}

TEST(LocalRendezvous, RecvThenSendAndDeadness) {
  LocalRendezvous r;
  Recorder rec;
  EXPECT_NE(r.RecvAsync(Key("x"), rec.Callback()), 0u);
  EXPECT_EQ(rec.calls, 0);
  EXPECT_EQ(r.NumWaiters(), 1u);
  ASSERT_TRUE(r.Send(Key("x"), Tensor(), /*is_dead=*/true).ok());
  EXPECT_EQ(rec.calls, 1);
  EXPECT_TRUE(rec.status.ok());
  EXPECT_TRUE(rec.is_dead);
  EXPECT_EQ(r.NumWaiters(), 0u);
}

TEST(LocalRendezvous, KeysAreIndependentAndReusableAfterConsumption) {
  LocalRendezvous r;
  Recorder a, b;
  r.RecvAsync(Key("a"), a.Callback());
  ASSERT_TRUE(r.Send(Key("b"), Scalar(2), false).ok());
  EXPECT_EQ(a.calls, 0);
  r.RecvAsync(Key("b"), b.Callback());
  EXPECT_EQ(b.tensor.flat<float>()[0], 2);
  ASSERT_TRUE(r.Send(Key("b"), Scalar(5), false).ok()) << "consumed key may be sent again";
  ASSERT_TRUE(r.Send(Key("a"), Scalar(1), false).ok());
  EXPECT_EQ(a.tensor.flat<float>()[0], 1);
}

TEST(LocalRendezvous, DuplicateSendAndDuplicateRecvAreErrors) {
  LocalRendezvous r;
  ASSERT_TRUE(r.Send(Key("x"), Scalar(1), false).ok());
  absl::Status dup = r.Send(Key("x"), Scalar(2), false);
  EXPECT_EQ(dup.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_NE(dup.message().find("duplicate send"), absl::string_view::npos);
  Recorder first, second;
  r.RecvAsync(Key("y"), first.Callback());
  r.RecvAsync(Key("y"), second.Callback());
  EXPECT_EQ(second.calls, 1);
  EXPECT_EQ(second.status.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(first.calls, 0) << "the first waiter is untouched";
  ASSERT_TRUE(r.Send(Key("y"), Scalar(4), false).ok());
  EXPECT_EQ(first.calls, 1);
}

TEST(LocalRendezvous, AbortFailsEveryPendingRecvOnceAndLaterCalls) {
  LocalRendezvous r;
  std::vector<std::unique_ptr<Recorder>> recs;
  for (int i = 0; i < 10; ++i) {
    recs.push_back(std::make_unique<Recorder>());
    r.RecvAsync(Key("k" + std::to_string(i)), recs.back()->Callback());
  }
  ASSERT_TRUE(r.Send(Key("unconsumed"), Scalar(1), false).ok());
  r.StartAbort(absl::AbortedError("stop"));
  r.StartAbort(absl::InternalError("second abort is ignored"));
  for (auto& rec : recs) {
    EXPECT_EQ(rec->calls, 1);
    EXPECT_EQ(rec->status.code(), absl::StatusCode::kAborted);
    EXPECT_EQ(rec->status.message(), "stop");
  }
  EXPECT_EQ(r.Send(Key("z"), Scalar(1), false).code(), absl::StatusCode::kAborted);
  Recorder late;
  r.RecvAsync(Key("unconsumed"), late.Callback());
  EXPECT_EQ(late.status.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted);
}

TEST(LocalRendezvous, CancelRecv) {
  LocalRendezvous r;
  Recorder rec;
  uint64_t token = r.RecvAsync(Key("x"), rec.Callback());
  EXPECT_TRUE(r.CancelRecv(token, absl::CancelledError("caller went away")));
  EXPECT_EQ(rec.status.code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(r.CancelRecv(token, absl::CancelledError("again")));
  ASSERT_TRUE(r.Send(Key("x"), Scalar(1), false).ok());
  EXPECT_EQ(rec.calls, 1);
  EXPECT_EQ(r.NumPendingSends(), 1u);
}

// Keys interned in a table, given as ParsedKeys or as the table's references (as the protocols'
// server side does), match each other by name; so do keys from a table that started over, or
// from none, and a cancelled waiter is found by its token.
TEST(LocalRendezvous, InternedAndPlainKeysMatchByName) {
  KeyTable keys(/*max_keys=*/2);
  LocalRendezvous r(&keys);
  Recorder by_ref, by_parsed, plain, cancelled;
  r.RecvAsync(keys.Intern(Key("a")), by_ref.Callback());
  ASSERT_TRUE(r.Send(Key("a"), Scalar(1), false).ok());
  EXPECT_EQ(by_ref.calls.load(), 1);
  EXPECT_EQ(by_ref.tensor.flat<float>()[0], 1);

  ASSERT_TRUE(r.Send(keys.Intern(Key("b")), Scalar(2), false).ok());
  for (const char* other : {"c", "d", "e"}) keys.Intern(Key(other));  // the table starts over
  EXPECT_EQ(r.Send(Key("b"), Scalar(3), false).code(), absl::StatusCode::kAlreadyExists);
  r.RecvAsync(Key("b"), by_parsed.Callback());
  EXPECT_EQ(by_parsed.tensor.flat<float>()[0], 2);

  ASSERT_TRUE(r.Send(MakeKeyRef(Key("f")), Scalar(4), false).ok());
  r.RecvAsync(Key("f"), plain.Callback());
  EXPECT_EQ(plain.tensor.flat<float>()[0], 4);

  const uint64_t token = r.RecvAsync(keys.Intern(Key("g")), cancelled.Callback());
  ASSERT_NE(token, 0u);
  EXPECT_TRUE(r.CancelRecv(token, absl::CancelledError("gone")));
  EXPECT_EQ(cancelled.status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(r.NumWaiters(), 0u);
  EXPECT_EQ(r.NumPendingSends(), 0u);
}

TEST(LocalRendezvous, CallbacksRunWithoutTheLockHeld) {
  LocalRendezvous r;
  Recorder inner;
  // A callback that re-enters the rendezvous would deadlock if the lock were held.
  r.RecvAsync(Key("outer"), [&](const absl::Status&, const Tensor&, bool) {
    EXPECT_TRUE(r.Send(Key("inner"), Scalar(9), false).ok());
    r.RecvAsync(Key("inner"), inner.Callback());
  });
  ASSERT_TRUE(r.Send(Key("outer"), Scalar(1), false).ok());
  EXPECT_EQ(inner.calls, 1);
}

TEST(LocalRendezvous, ConcurrentSendersAndReceiversMatchExactlyOnce) {
  LocalRendezvous r;
  constexpr int kKeys = 2000;
  std::vector<std::unique_ptr<Recorder>> recs(kKeys);
  for (auto& rec : recs) rec = std::make_unique<Recorder>();
  std::thread sender([&] {
    for (int i = 0; i < kKeys; ++i) {
      ASSERT_TRUE(r.Send(Key("k" + std::to_string(i)), Scalar(static_cast<float>(i)), false).ok());
    }
  });
  std::thread receiver([&] {
    for (int i = kKeys - 1; i >= 0; --i) r.RecvAsync(Key("k" + std::to_string(i)), recs[i]->Callback());
  });
  sender.join();
  receiver.join();
  for (int i = 0; i < kKeys; ++i) {
    ASSERT_EQ(recs[i]->calls, 1);
    EXPECT_EQ(recs[i]->tensor.flat<float>()[0], static_cast<float>(i));
  }
  EXPECT_EQ(r.NumPendingSends(), 0u);
  EXPECT_EQ(r.NumWaiters(), 0u);
}

TEST(LocalRendezvous, DestructionFailsWaiters) {
  Recorder rec;
  {
    LocalRendezvous r;
    r.RecvAsync(Key("x"), rec.Callback());
  }
  EXPECT_EQ(rec.calls, 1);
  EXPECT_EQ(rec.status.code(), absl::StatusCode::kCancelled);
}

}  // namespace
}  // namespace tensorverbs
