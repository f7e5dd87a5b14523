// ProgressEngine over a loopback domain: where and when posted tasks, completions and user
// callbacks run, and what Stop leaves to the caller.
#include "src/protocol/progress_engine.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/common/executor.h"
#include "src/common/mutex.h"
#include "src/fabric/fabric.h"

namespace tensorverbs::protocol {
namespace {

using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr absl::Duration kPatience = absl::Seconds(10);

class ProgressEngineTest : public ::testing::Test {
 protected:
  ProgressEngineTest() : domain_(*fabric::OpenDomain("loopback", {})) {}

  // `callback_threads` 0: the executor runs each callback inline, where it is handed over.
  void MakeEngine(ProgressEngine::Options options = {}, int callback_threads = 1) {
    executor_ = std::make_unique<Executor>("callbacks", callback_threads);
    ProgressEngine::Hooks hooks;
    hooks.on_completion = [this](const fabric::Completion& c) {
      Log(absl::StrCat("completion ", c.context));
    };
    hooks.housekeeping = [](absl::Time) {};
    hooks.operations_in_flight = [] { return false; };
    engine_ =
        std::make_unique<ProgressEngine>(domain_.get(), executor_.get(), options, std::move(hooks));
  }

  // The engine's stall report once the loop has made no turn for `limit`, within kPatience.
  std::optional<std::string> WaitForStallReport(absl::Duration limit) {
    std::optional<std::string> report;
    for (const absl::Time give_up = absl::Now() + kPatience;
         !report.has_value() && absl::Now() < give_up;) {
      report = engine_->StallReport(limit);
      if (!report.has_value()) absl::SleepFor(absl::Milliseconds(10));
    }
    return report;
  }

  void Log(std::string entry) {
    MutexLock lock(&mu_);
    log_.push_back(std::move(entry));
  }
  std::vector<std::string> LogWhen(size_t entries) {
    MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(
        [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return log_.size() >= entries; }, kPatience);
    return log_;
  }

  std::unique_ptr<fabric::Domain> domain_;
  std::unique_ptr<Executor> executor_;
  Mutex mu_;
  std::vector<std::string> log_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<ProgressEngine> engine_;  // first to go: it uses the rest
};

TEST_F(ProgressEngineTest, AnIdleLoopTimesSomeOfItsIdleTurns) {
  // A spinning loop with nothing to do makes many idle turns, one in sixteen of them timed;
  // before its first turn there is nothing to report.
  ProgressEngine::Options options;
  options.poll_mode = PollMode::kBusy;
  MakeEngine(options);
  EXPECT_FALSE(engine_->IdleTurnCost().has_value()) << "no turn yet";
  engine_->Start();
  std::optional<ProgressEngine::TurnCost> cost;
  for (const absl::Time give_up = absl::Now() + kPatience;
       !cost.has_value() && absl::Now() < give_up;) {
    absl::SleepFor(absl::Milliseconds(5));
    cost = engine_->IdleTurnCost();
  }
  ASSERT_TRUE(cost.has_value()) << "a spinning loop timed no idle turn";
  EXPECT_GT(cost->wall, absl::ZeroDuration());
  // The thread's CPU time in a turn, less the clock's own reads (so it may round to zero on a
  // fast host); a turn is never a second.
  EXPECT_LT(cost->cpu, absl::Seconds(1));
  std::printf("an idle turn over loopback: %s wall, %s CPU\n",
              absl::FormatDuration(cost->wall).c_str(), absl::FormatDuration(cost->cpu).c_str());
  // A restart makes the loop count its timed turns from zero again. They are counted for 300 ms
  // first, so the count after the restart stays below them unless this thread is kept from
  // running as long.
  absl::SleepFor(absl::Milliseconds(300));
  const uint64_t before = engine_->IdleTurnsTimed();
  ASSERT_GE(before, 2u);
  engine_->RestartIdleTurnCost();
  uint64_t after = before;
  for (const absl::Time give_up = absl::Now() + kPatience;
       (after >= before || after == 0) && absl::Now() < give_up;) {
    after = engine_->IdleTurnsTimed();
  }
  EXPECT_LT(after, before) << "the restart was not applied";
  EXPECT_GT(after, 0u);
  EXPECT_TRUE(engine_->IdleTurnCost().has_value());
}

TEST_F(ProgressEngineTest, TasksPostedFromAnotherThreadRunOnTheLoopThreadInOrder) {
  MakeEngine();
  engine_->Start();
  constexpr int kTasks = 200;
  std::vector<int> order;
  std::vector<std::thread::id> ran_on;
  std::vector<bool> on_loop;
  Notification done;
  for (int i = 0; i < kTasks; ++i) {
    ASSERT_TRUE(engine_->Post([&, i] {
      MutexLock lock(&mu_);
      order.push_back(i);
      ran_on.push_back(std::this_thread::get_id());
      on_loop.push_back(engine_->OnLoopThread());
    }));
  }
  ASSERT_TRUE(engine_->Post([&] { done.Notify(); }));
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(kPatience));
  MutexLock lock(&mu_);
  ASSERT_EQ(order.size(), static_cast<size_t>(kTasks));
  for (int i = 0; i < kTasks; ++i) EXPECT_EQ(order[i], i);
  EXPECT_THAT(ran_on, Each(ran_on[0]));
  EXPECT_NE(ran_on[0], std::this_thread::get_id());
  EXPECT_THAT(on_loop, Each(true));
}

TEST_F(ProgressEngineTest, APostFromTheLoopThreadRunsLaterInTheSameTurn) {
  // A write to the domain's own endpoint: its completion is what the loop's next poll finds.
  std::vector<uint8_t> buffer(64);
  std::unique_ptr<fabric::MemoryRegion> region =
      *domain_->RegisterMemory(buffer.data(), buffer.size(), fabric::kAccessRemoteWrite);
  std::unique_ptr<fabric::Endpoint> endpoint = *domain_->CreateEndpoint();
  ASSERT_TRUE(endpoint->Connect(endpoint->LocalAddress()).ok());
  MakeEngine();
  engine_->Start();
  // The loop uses the endpoint and region: it ends before they go, whatever the outcome.
  absl::Cleanup stop = [this] { engine_->Stop(); };
  ASSERT_TRUE(engine_->Post([&] {
    Log("A begins");
    absl::Status s =
        endpoint->PostWrite(fabric::LocalBuffer{region.get(), buffer.data(), 8},
                            fabric::RemoteBuffer{region->PackRemoteKey(),
                                                 reinterpret_cast<uint64_t>(buffer.data() + 32), 8},
                            /*context=*/7);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_TRUE(engine_->Post([&] { Log("B"); }));
    Log("A ends");
  }));
  // B is not run inside A, and not left for the next turn either: it runs before this turn's
  // poll delivers the write's completion.
  EXPECT_THAT(LogWhen(4), ElementsAre("A begins", "A ends", "B", "completion 7"));
}

TEST_F(ProgressEngineTest, AskLoopReturnsTheLoopsAnswer) {
  MakeEngine();
  engine_->Start();
  absl::StatusOr<int> answer = engine_->AskLoop<int>([] { return 42; });
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(*answer, 42);
  absl::StatusOr<bool> on_loop = engine_->AskLoop<bool>([&] { return engine_->OnLoopThread(); });
  ASSERT_TRUE(on_loop.ok()) << on_loop.status();
  EXPECT_TRUE(*on_loop);
  absl::StatusOr<std::thread::id> loop_id =
      engine_->AskLoop<std::thread::id>([] { return std::this_thread::get_id(); });
  ASSERT_TRUE(loop_id.ok());
  EXPECT_NE(*loop_id, std::this_thread::get_id());

  engine_->Stop();
  EXPECT_EQ(engine_->AskLoop<int>([] { return 1; }).status().code(), absl::StatusCode::kCancelled);
}

// A recv delivery whose done runs `f`.
ProgressEngine::RecvDelivery Delivery(std::function<void()> f) {
  ProgressEngine::RecvDelivery d;
  d.done = [f = std::move(f)](const absl::Status&, const Tensor&, bool) { f(); };
  return d;
}

TEST_F(ProgressEngineTest, CallbacksDeliveredOnTheLoopThreadWaitForTheEndOfTheTurn) {
  // An inline executor: a callback handed over at once would run inside Deliver.
  MakeEngine({}, /*callback_threads=*/0);
  engine_->Start();
  ASSERT_TRUE(engine_->Post([&] {
    for (int i = 0; i < 3; ++i) {
      engine_->DeliverRecv(Delivery([this, i] { Log(absl::StrCat("callback ", i)); }));
    }
    Log("task ends");
  }));
  EXPECT_THAT(LogWhen(4), ElementsAre("task ends", "callback 0", "callback 1", "callback 2"));
}

TEST_F(ProgressEngineTest, DeliverHandsCallbacksToTheExecutorsThread) {
  MakeEngine({}, /*callback_threads=*/1);
  engine_->Start();
  std::thread::id loop_thread;
  std::vector<int> order;
  std::vector<std::thread::id> ran_on;
  Notification all_ran;
  ASSERT_TRUE(engine_->Post([&] {
    loop_thread = std::this_thread::get_id();
    for (int i = 0; i < 3; ++i) {
      engine_->DeliverRecv(Delivery([&, i] {
        MutexLock lock(&mu_);
        order.push_back(i);
        ran_on.push_back(std::this_thread::get_id());
        if (i == 2) all_ran.Notify();
      }));
    }
  }));
  ASSERT_TRUE(all_ran.WaitForNotificationWithTimeout(kPatience));
  {
    MutexLock lock(&mu_);
    EXPECT_THAT(order, ElementsAre(0, 1, 2));
    EXPECT_THAT(ran_on, Each(ran_on[0]));
    EXPECT_NE(ran_on[0], loop_thread) << "user code stays off the loop thread";
    EXPECT_NE(ran_on[0], std::this_thread::get_id());
  }

  // From any other thread a callback goes to the executor at once.
  Notification ran;
  std::thread::id other_thread;
  engine_->DeliverRecv(Delivery([&] {
    other_thread = std::this_thread::get_id();
    ran.Notify();
  }));
  ASSERT_TRUE(ran.WaitForNotificationWithTimeout(kPatience));
  EXPECT_EQ(other_thread, ran_on[0]);
}

TEST_F(ProgressEngineTest, RecvDeliveriesRunOnceEachInOrderAfterTheTurnOffTheLoopThread) {
  for (int threads : {0, 1}) {
    SCOPED_TRACE(threads == 0 ? "inline executor" : "one callback thread");
    MakeEngine({}, threads);
    engine_->Start();
    std::vector<std::string> got;
    std::thread::id loop_thread;
    std::vector<std::thread::id> ran_on;
    Notification all_ran;
    ASSERT_TRUE(engine_->Post([&] {
      loop_thread = std::this_thread::get_id();
      for (int i = 0; i < 3; ++i) {
        ProgressEngine::RecvDelivery d;
        d.done = [&, i](const absl::Status& s, const Tensor& t, bool is_dead) {
          MutexLock lock(&mu_);
          got.push_back(absl::StrCat(i, " ", s.ok() ? "ok" : std::string(s.message()), " ",
                                     t.IsInitialized() ? t.NumElements() : 0,
                                     is_dead ? " dead" : ""));
          ran_on.push_back(std::this_thread::get_id());
          if (i == 2) all_ran.Notify();
        };
        if (i == 1) d.status = absl::UnavailableError("gone");
        if (i == 0) d.tensor = Tensor::Make(DataType::kFloat32, TensorShape::Of({3}));
        d.is_dead = i == 2;
        engine_->DeliverRecv(std::move(d));
      }
      MutexLock lock(&mu_);
      got.push_back("turn");
    }));
    ASSERT_TRUE(all_ran.WaitForNotificationWithTimeout(kPatience));
    engine_->Stop();
    engine_.reset();
    MutexLock lock(&mu_);
    EXPECT_THAT(got, ElementsAre("turn", "0 ok 3", "1 gone 0", "2 ok 0 dead"));
    if (threads > 0) {
      EXPECT_NE(ran_on[0], loop_thread) << "user code stays off the loop thread";
    }
  }
}

TEST_F(ProgressEngineTest, StopRunsWhatWasPostedThenPostLeavesTheTaskWithTheCaller) {
  MakeEngine();
  engine_->Start();
  std::atomic<int> ran_before{0};
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(engine_->Post([&] { ++ran_before; }));
  engine_->Stop();
  EXPECT_EQ(ran_before.load(), 50);

  bool ran = false;
  ProgressEngine::Task task = [&ran] { ran = true; };
  EXPECT_FALSE(engine_->Post(task));
  ASSERT_TRUE(task != nullptr) << "the task is still the caller's";
  std::move(task)();  // so no callback is lost: the caller runs or fails it itself
  EXPECT_TRUE(ran);
  engine_->Stop();  // idempotent
}

TEST_F(ProgressEngineTest, StopBeforeStartRefusesLaterPostsToo) {
  MakeEngine();
  bool posted_early_ran = false;
  ProgressEngine::Task early = [&posted_early_ran] { posted_early_ran = true; };
  ASSERT_TRUE(engine_->Post(early));
  engine_->Stop();
  EXPECT_TRUE(posted_early_ran) << "what was posted before Stop runs, even without a loop";
  bool ran = false;
  ProgressEngine::Task task = [&ran] { ran = true; };
  EXPECT_FALSE(engine_->Post(task)) << "a task accepted now would never run";
  ASSERT_TRUE(task != nullptr);
  EXPECT_TRUE(engine_->OnOwnerThread());
  EXPECT_EQ(engine_->AskLoop<int>([] { return 1; }, absl::Seconds(1)).status().code(),
            absl::StatusCode::kCancelled);
}

TEST_F(ProgressEngineTest, OnOwnerThreadIsTheLoopThreadAndAfterStopEveryone) {
  MakeEngine();
  engine_->Start();
  EXPECT_FALSE(engine_->OnOwnerThread());
  absl::StatusOr<bool> loop_owns = engine_->AskLoop<bool>([&] { return engine_->OnOwnerThread(); });
  ASSERT_TRUE(loop_owns.ok());
  EXPECT_TRUE(*loop_owns);
  bool other_owns = true;
  std::thread([&] { other_owns = engine_->OnOwnerThread(); }).join();
  EXPECT_FALSE(other_owns);

  engine_->Stop();
  // The loop has ended: whoever tears the owner down may touch its objects.
  EXPECT_TRUE(engine_->OnOwnerThread());
  EXPECT_FALSE(engine_->OnLoopThread());
  std::thread([&] { other_owns = engine_->OnOwnerThread(); }).join();
  EXPECT_TRUE(other_owns);
}

TEST(ParsePollMode, NamesEachModeAndTheVariable) {
  EXPECT_EQ(*ParsePollMode("busy"), PollMode::kBusy);
  EXPECT_EQ(*ParsePollMode("blocking"), PollMode::kBlocking);
  EXPECT_EQ(*ParsePollMode("adaptive"), PollMode::kAdaptive);
  absl::StatusOr<PollMode> bad = ParsePollMode("sleepy");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("TENSORVERBS_POLL_MODE"));
}

struct ModeCase {
  const char* name;
  PollMode mode;
};
// Names the case in CTest's test names instead of its bytes.
void PrintTo(const ModeCase& c, std::ostream* os) { *os << c.name; }

class PollModeTest : public ProgressEngineTest, public ::testing::WithParamInterface<ModeCase> {};

TEST_P(PollModeTest, APostedTaskRunsPromptly) {
  ProgressEngine::Options options;
  options.poll_mode = GetParam().mode;
  options.poll_spin = absl::Milliseconds(1);
  // Far longer than the test: a sleeping loop that missed a Post would wait this long.
  options.housekeeping_interval = absl::Minutes(5);
  MakeEngine(options);
  engine_->Start();
  for (int round = 0; round < 5; ++round) {
    absl::SleepFor(absl::Milliseconds(10));  // idle long enough to stop spinning and sleep
    Notification ran;
    ASSERT_TRUE(engine_->Post([&] { ran.Notify(); }));
    // Patience for a loaded machine and sanitizers, far below what a missed wake-up costs.
    ASSERT_TRUE(ran.WaitForNotificationWithTimeout(kPatience)) << "round " << round;
  }
  const absl::Time stop = absl::Now();
  engine_->Stop();
  EXPECT_LT(absl::Now() - stop, kPatience) << "Stop wakes a sleeping loop";
}

INSTANTIATE_TEST_SUITE_P(Modes, PollModeTest,
                         ::testing::Values(ModeCase{"Busy", PollMode::kBusy},
                                           ModeCase{"Blocking", PollMode::kBlocking},
                                           ModeCase{"Adaptive", PollMode::kAdaptive}),
                         [](const ::testing::TestParamInfo<ModeCase>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace tensorverbs::protocol

namespace tensorverbs::protocol {
namespace {

TEST_F(ProgressEngineTest, AStuckLoopIsReportedOnceNamingWhereItIsAndAgainAfterItMoved) {
  ProgressEngine::Options options;
  options.name = "grpc+verbs over loopback";
  MakeEngine(options);
  EXPECT_EQ(engine_->StallReport(absl::Milliseconds(1)), std::nullopt) << "not started";
  engine_->Start();
  constexpr absl::Duration kLimit = absl::Milliseconds(100);
  // Outlive the loop's tasks: each episode's task may still be returning from its wait when
  // the test goes on.
  Notification releases[2], runnings[2];
  for (int episode = 0; episode < 2; ++episode) {
    Notification& release = releases[episode];
    Notification& running = runnings[episode];
    ASSERT_TRUE(engine_->Post([&release, &running] {
      running.Notify();
      release.WaitForNotification();
    }));
    ASSERT_TRUE(running.WaitForNotificationWithTimeout(kPatience));
    std::optional<std::string> report = WaitForStallReport(kLimit);
    ASSERT_TRUE(report.has_value());
    EXPECT_THAT(*report, HasSubstr("grpc+verbs over loopback"));
    EXPECT_THAT(*report, HasSubstr("no turn for"));
    EXPECT_THAT(*report, HasSubstr("a posted task"));
    absl::SleepFor(kLimit);
    EXPECT_EQ(engine_->StallReport(kLimit), std::nullopt) << "once per stall";
    release.Notify();
    // Turning again: a loop that moves (idle waits included) is never reported.
    const absl::Time until = absl::Now() + 3 * kLimit;
    while (absl::Now() < until) {
      EXPECT_EQ(engine_->StallReport(kLimit), std::nullopt);
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
  engine_->Stop();
  EXPECT_EQ(engine_->StallReport(absl::ZeroDuration()), std::nullopt) << "stopped";
}

// TurnedWithin: what a liveness probe answered off the loop relies on. An idle loop keeps
// turning (housekeeping), a loop held in a task stops, and a stopped engine never says it turns.
TEST_F(ProgressEngineTest, TurnedWithinHoldsWhileTheLoopMovesAndNotWhileItIsHeld) {
  MakeEngine(ProgressEngine::Options());
  EXPECT_TRUE(engine_->TurnedWithin(absl::Milliseconds(1))) << "not started: nothing to wedge";
  engine_->Start();
  constexpr absl::Duration kLimit = absl::Milliseconds(200);
  for (absl::Time until = absl::Now() + 3 * kLimit; absl::Now() < until;
       absl::SleepFor(absl::Milliseconds(10))) {
    EXPECT_TRUE(engine_->TurnedWithin(kLimit)) << "idle";
  }
  Notification release, running;
  ASSERT_TRUE(engine_->Post([&] {
    running.Notify();
    release.WaitForNotification();
  }));
  ASSERT_TRUE(running.WaitForNotificationWithTimeout(kPatience));
  const absl::Time deadline = absl::Now() + kPatience;
  while (engine_->TurnedWithin(kLimit) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_FALSE(engine_->TurnedWithin(kLimit)) << "held in a task";
  release.Notify();
  const absl::Time again = absl::Now() + kPatience;
  while (!engine_->TurnedWithin(kLimit) && absl::Now() < again) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(engine_->TurnedWithin(kLimit)) << "moving again";
  engine_->Stop();
  EXPECT_FALSE(engine_->TurnedWithin(absl::InfiniteDuration())) << "stopped";
}

// A user callback run inline that blocks is where a stalled loop is, whatever the turn ran
// before it: with housekeeping due every turn, the report used to name housekeeping.
TEST_F(ProgressEngineTest, AStallInACallbackRunInlineIsReportedAsTheCallback) {
  ProgressEngine::Options options;
  options.name = "grpc+verbs over loopback";
  options.housekeeping_interval = absl::ZeroDuration();  // due in every turn
  MakeEngine(options, /*callback_threads=*/0);
  engine_->Start();
  Notification release, running;
  ASSERT_TRUE(engine_->Post([&] {
    engine_->DeliverRecv(Delivery([&] {
      running.Notify();
      release.WaitForNotification();
    }));
  }));
  ASSERT_TRUE(running.WaitForNotificationWithTimeout(kPatience));
  std::optional<std::string> report = WaitForStallReport(absl::Milliseconds(100));
  release.Notify();
  ASSERT_TRUE(report.has_value());
  EXPECT_THAT(*report, HasSubstr("a recv callback run inline"));
  engine_->Stop();
}

// Inline first: the turn's callbacks run on the loop's own thread, which is not the loop for
// the callbacks themselves (what they post takes the queue), and they run once each in order.
TEST_F(ProgressEngineTest, InlineFirstRunsCallbacksOnTheLoopsThreadAsNotTheLoop) {
  ProgressEngine::Options options;
  options.inline_callback_limit = absl::Seconds(5);
  MakeEngine(options, /*callback_threads=*/1);
  engine_->Start();
  EXPECT_TRUE(engine_->RunsCallbacksInline());
  std::thread::id loop_thread;
  std::vector<std::thread::id> ran_on;
  std::vector<bool> on_loop, in_callback;
  ASSERT_TRUE(engine_->Post([&] {
    loop_thread = std::this_thread::get_id();
    for (int i = 0; i < 3; ++i) {
      engine_->DeliverRecv(Delivery([&, i] {
        Log(absl::StrCat("callback ", i));
        ran_on.push_back(std::this_thread::get_id());
        on_loop.push_back(engine_->OnLoopThread());
        in_callback.push_back(engine_->InInlineCallback());
        if (i == 1) {
          ASSERT_TRUE(engine_->Post([&] {
            Log(absl::StrCat("posted from a callback, on the loop: ", engine_->OnLoopThread()));
          }));
        }
      }));
    }
    Log("task ends");
  }));
  EXPECT_THAT(LogWhen(5), ElementsAre("task ends", "callback 0", "callback 1", "callback 2",
                                      "posted from a callback, on the loop: 1"));
  EXPECT_THAT(ran_on, Each(loop_thread));
  EXPECT_THAT(on_loop, Each(false));
  EXPECT_THAT(in_callback, Each(true));
  EXPECT_FALSE(engine_->InInlineCallback());
  EXPECT_EQ(engine_->loop_moves(), 0);
  EXPECT_TRUE(engine_->RunsCallbacksInline());
  engine_->Stop();
}

// A callback that holds the loop for the limit is left on its thread: a new thread runs the
// loop, the executor the rest of the turn's callbacks, and every later callback.
TEST_F(ProgressEngineTest, ACallbackThatHoldsTheLoopIsLeftAndTheLoopGoesOnElsewhere) {
  ProgressEngine::Options options;
  options.inline_callback_limit = absl::Milliseconds(2);
  MakeEngine(options, /*callback_threads=*/1);
  engine_->Start();
  Notification blocked, release, rest_ran;
  std::thread::id loop_thread, blocked_thread, rest_thread;
  std::atomic<int> runs[3] = {0, 0, 0};
  ASSERT_TRUE(engine_->Post([&] {
    loop_thread = std::this_thread::get_id();
    engine_->DeliverRecv(Delivery([&] {
      ++runs[0];
      blocked_thread = std::this_thread::get_id();
      blocked.Notify();
      release.WaitForNotification();
    }));
    engine_->DeliverRecv(Delivery([&] { ++runs[1]; }));
    engine_->DeliverRecv(Delivery([&] {
      ++runs[2];
      rest_thread = std::this_thread::get_id();
      rest_ran.Notify();
    }));
  }));
  ASSERT_TRUE(blocked.WaitForNotificationWithTimeout(kPatience));
  // The callbacks after the blocked one run while it still blocks, and so do posted tasks.
  ASSERT_TRUE(rest_ran.WaitForNotificationWithTimeout(kPatience));
  std::thread::id new_loop;
  absl::StatusOr<bool> on_loop = engine_->AskLoop<bool>(
      [&] {
        new_loop = std::this_thread::get_id();
        return engine_->OnLoopThread();
      },
      kPatience);
  ASSERT_TRUE(on_loop.ok()) << on_loop.status();
  EXPECT_TRUE(*on_loop);
  EXPECT_EQ(blocked_thread, loop_thread);
  EXPECT_NE(new_loop, loop_thread);
  EXPECT_NE(rest_thread, loop_thread);
  EXPECT_EQ(engine_->loop_moves(), 1);
  EXPECT_FALSE(engine_->RunsCallbacksInline());
  EXPECT_FALSE(executor_->OnOwnThread());

  // Later callbacks go to the executor, not to the new loop's thread.
  Notification later_ran;
  std::thread::id later_thread;
  ASSERT_TRUE(engine_->Post([&] {
    engine_->DeliverRecv(Delivery([&] {
      later_thread = std::this_thread::get_id();
      later_ran.Notify();
    }));
  }));
  ASSERT_TRUE(later_ran.WaitForNotificationWithTimeout(kPatience));
  EXPECT_NE(later_thread, new_loop);
  EXPECT_NE(later_thread, loop_thread);

  release.Notify();
  engine_->Stop();
  engine_.reset();
  executor_.reset();  // joins the thread left behind too
  for (auto& r : runs) EXPECT_EQ(r.load(), 1);
}

// A callback run inline that waits for the loop itself (AskLoop) would wait for good on the
// loop's own thread; the loop moves on and answers it.
TEST_F(ProgressEngineTest, ACallbackRunInlineThatWaitsForTheLoopIsAnswered) {
  ProgressEngine::Options options;
  options.inline_callback_limit = absl::Milliseconds(2);
  MakeEngine(options, /*callback_threads=*/2);
  engine_->Start();
  Notification answered;
  ASSERT_TRUE(engine_->Post([&] {
    engine_->DeliverRecv(Delivery([&] {
      absl::StatusOr<int> answer = engine_->AskLoop<int>([] { return 7; }, kPatience);
      EXPECT_TRUE(answer.ok()) << answer.status();
      if (answer.ok() && *answer == 7) answered.Notify();
    }));
  }));
  ASSERT_TRUE(answered.WaitForNotificationWithTimeout(kPatience));
  EXPECT_EQ(engine_->loop_moves(), 1);
  engine_->Stop();
}

// Stop while a callback holds the loop: the loop moves on even then, runs what was posted and
// ends; Stop returns once the callback has, as the loop's thread is joined.
TEST_F(ProgressEngineTest, StopWhileACallbackHoldsTheLoopRunsWhatWasPosted) {
  ProgressEngine::Options options;
  options.inline_callback_limit = absl::Milliseconds(50);
  MakeEngine(options, /*callback_threads=*/1);
  engine_->Start();
  Notification blocked, release;
  ASSERT_TRUE(engine_->Post([&] {
    engine_->DeliverRecv(Delivery([&] {
      blocked.Notify();
      release.WaitForNotification();
    }));
  }));
  ASSERT_TRUE(blocked.WaitForNotificationWithTimeout(kPatience));
  Notification posted_ran;
  ASSERT_TRUE(engine_->Post([&] { posted_ran.Notify(); }));
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    engine_->Stop();
    stopped = true;
  });
  ASSERT_TRUE(posted_ran.WaitForNotificationWithTimeout(kPatience))
      << "the loop did not move on while stopping";
  release.Notify();
  stopper.join();
  EXPECT_TRUE(stopped);
  EXPECT_EQ(engine_->loop_moves(), 1);
}

// A callback whose thread keeps running (it computes, or the scheduler took its core) is not
// one that blocks: the loop stays with it for many limits, and moves only if it goes on.
TEST_F(ProgressEngineTest, ACallbackThatKeepsRunningHoldsTheLoopLongerThanOneThatWaits) {
  ProgressEngine::Options options;
  options.inline_callback_limit = absl::Milliseconds(1);
  MakeEngine(options, /*callback_threads=*/1);
  engine_->Start();
  Notification short_done, long_done;
  ASSERT_TRUE(engine_->Post([&] {
    engine_->DeliverRecv(Delivery([&] {
      for (const absl::Time end = absl::Now() + absl::Milliseconds(10); absl::Now() < end;) {
      }
      short_done.Notify();
    }));
  }));
  ASSERT_TRUE(short_done.WaitForNotificationWithTimeout(kPatience));
  EXPECT_EQ(engine_->loop_moves(), 0) << "10 ms of computing moved the loop";
  EXPECT_TRUE(engine_->RunsCallbacksInline());
  // One that computes for good does move it, after a while.
  ASSERT_TRUE(engine_->Post([&] {
    engine_->DeliverRecv(Delivery([&] {
      for (const absl::Time end = absl::Now() + kPatience;
           engine_->loop_moves() == 0 && absl::Now() < end;) {
      }
      long_done.Notify();
    }));
  }));
  ASSERT_TRUE(long_done.WaitForNotificationWithTimeout(kPatience));
  EXPECT_EQ(engine_->loop_moves(), 1);
  engine_->Stop();
}

}  // namespace
}  // namespace tensorverbs::protocol
