// ProgressEngine::DriveUntil over a loopback domain: threads that wait drive progress, hand it
// over between them, and give it back, and nothing a waiter would have run is lost.
//
// Waiters spin for as long as a test lets them (Options::waiter_spin, long by default here), so
// that one that drives keeps driving until what it waits for came; the last tests pin it at
// zero, where a waiter leaves the fabric to the progress thread as soon as it is idle.
//
// The domain writes to its own endpoint; each write's completion stands for a recv's content:
// the hook delivers a quick recv whose callback notifies the Event of the write's context and
// records the thread the completion and the callback ran on. Completions are held back (a
// stalled queue) until the test lets them through, so which thread drives when they arrive is
// decided by the test, not by the scheduler.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "src/common/executor.h"
#include "src/common/mutex.h"
#include "src/fabric/fabric.h"
#include "src/fabric/loopback/loopback.h"
#include "src/protocol/progress_engine.h"
#include "tensorverbs/event.h"

namespace tensorverbs::protocol {
namespace {

constexpr absl::Duration kWaitPatience = absl::Seconds(10);

class WaiterProgressTest : public ::testing::Test {
 protected:
  WaiterProgressTest() : domain_(*fabric::OpenDomain("loopback", {})) {
    region_ = *domain_->RegisterMemory(buffer_.data(), buffer_.size(), fabric::kAccessRemoteWrite);
    endpoint_ = *domain_->CreateEndpoint();
    EXPECT_TRUE(endpoint_->Connect(endpoint_->LocalAddress()).ok());
  }
  ~WaiterProgressTest() override {
    if (engine_ != nullptr) engine_->Stop();
  }

  static ProgressEngine::Options Spinning() {
    ProgressEngine::Options options;
    options.waiter_spin = kWaitPatience;
    return options;
  }

  void MakeEngine(ProgressEngine::Options options = Spinning()) {
    executor_ = std::make_unique<Executor>("callbacks", 1);
    ProgressEngine::Hooks hooks;
    hooks.on_completion = [this](const fabric::Completion& c) {
      const uint64_t id = c.context;
      Record(id, "completion");
      ProgressEngine::RecvDelivery d;
      d.quick = quick_.load();
      d.done = [this, id](const absl::Status&, const Tensor&, bool) {
        Record(id, "callback");
        {
          MutexLock lock(&mu_);
          ++callback_runs_[id];
        }
        EventOf(id).Notify();
      };
      engine_->DeliverRecv(std::move(d));
    };
    hooks.housekeeping = [](absl::Time) {};
    hooks.operations_in_flight = [] { return false; };
    engine_ =
        std::make_unique<ProgressEngine>(domain_.get(), executor_.get(), options, std::move(hooks));
    engine_->Start();
  }

  // Holds completions back, or lets them through.
  void Stall(bool stalled) {
    fabric::loopback::Faults faults;
    faults.stalled = stalled;
    fabric::loopback::SetFaults(domain_.get(), faults);
  }

  // Posts (on the owner of progress, as the domain requires) a write whose completion is `id`'s,
  // and returns once it was posted.
  void Write(uint64_t id) {
    Notification posted;
    ASSERT_TRUE(engine_->Post([&] {
      absl::Status s = endpoint_->PostWrite(
          fabric::LocalBuffer{region_.get(), buffer_.data(), 8},
          fabric::RemoteBuffer{region_->PackRemoteKey(),
                               reinterpret_cast<uint64_t>(buffer_.data() + 64), 8},
          id);
      EXPECT_TRUE(s.ok()) << s;
      posted.Notify();
    }));
    ASSERT_TRUE(posted.WaitForNotificationWithTimeout(kWaitPatience));
  }

  Event& EventOf(uint64_t id) {
    MutexLock lock(&mu_);
    std::unique_ptr<Event>& e = events_[id];
    if (e == nullptr) e = std::make_unique<Event>();
    return *e;
  }
  void Record(uint64_t id, const char* what) {
    MutexLock lock(&mu_);
    threads_[id][what] = std::this_thread::get_id();
  }
  std::thread::id ThreadOf(uint64_t id, const char* what) {
    MutexLock lock(&mu_);
    return threads_[id][what];
  }
  // Starts a thread that waits for `id`'s event (with `timeout`), and says when it has.
  std::thread Waiter(uint64_t id, std::thread::id* self, std::atomic<int>* result,
                     absl::Duration timeout = kWaitPatience) {
    return std::thread([=, this] {
      *self = std::this_thread::get_id();
      result->store(engine_->DriveUntil(EventOf(id), absl::Now() + timeout) ? 1 : 0);
    });
  }

  std::vector<uint8_t> buffer_ = std::vector<uint8_t>(128);
  std::unique_ptr<fabric::Domain> domain_;
  std::unique_ptr<fabric::MemoryRegion> region_;
  std::unique_ptr<fabric::Endpoint> endpoint_;
  std::unique_ptr<Executor> executor_;
  std::atomic<bool> quick_{true};
  Mutex mu_;
  std::map<uint64_t, std::unique_ptr<Event>> events_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::map<std::string, std::thread::id>> threads_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, int> callback_runs_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<ProgressEngine> engine_;
};

// Waits until `condition` holds, for at most kWaitPatience.
template <typename Condition>
bool SoonEnough(Condition condition) {
  for (const absl::Time end = absl::Now() + kWaitPatience; absl::Now() < end;) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return condition();
}

TEST_F(WaiterProgressTest, TheWaitingThreadPollsItsCompletionAndRunsItsQuickCallback) {
  MakeEngine();
  Stall(true);
  Write(1);
  std::thread::id waiter;
  std::atomic<int> result{-1};
  std::thread t = Waiter(1, &waiter, &result);
  ASSERT_TRUE(SoonEnough([&] { return engine_->waiter_drives() >= 1; }));
  Stall(false);
  t.join();
  EXPECT_EQ(result.load(), 1);
  EXPECT_EQ(ThreadOf(1, "completion"), waiter) << "the progress thread polled it";
  EXPECT_EQ(ThreadOf(1, "callback"), waiter) << "the callback went to another thread";
}

TEST_F(WaiterProgressTest, AParkedWaitersCompletionRunsOnTheDriverAndWakesIt) {
  MakeEngine();
  Stall(true);
  Write(1);
  Write(2);
  std::thread::id first, second;
  std::atomic<int> first_result{-1}, second_result{-1};
  std::thread a = Waiter(1, &first, &first_result);
  ASSERT_TRUE(SoonEnough([&] { return engine_->waiter_drives() >= 1; }));
  std::thread b = Waiter(2, &second, &second_result);
  absl::SleepFor(absl::Milliseconds(20));  // the second parks behind the first
  Stall(false);
  a.join();
  b.join();
  EXPECT_EQ(first_result.load(), 1);
  EXPECT_EQ(second_result.load(), 1);
  // Both completions arrive in one poll, which one thread makes: whichever drove then.
  EXPECT_EQ(ThreadOf(1, "completion"), ThreadOf(2, "completion"));
  EXPECT_EQ(ThreadOf(2, "callback"), ThreadOf(2, "completion")) << "a quick callback stays put";
}

TEST_F(WaiterProgressTest, AWaiterThatLeavesHandsProgressToTheNextOne) {
  MakeEngine();
  Stall(true);
  Write(2);
  std::thread::id first, second;
  std::atomic<int> first_result{-1}, second_result{-1};
  std::thread a = Waiter(1, &first, &first_result);  // nothing will complete 1 but the test
  ASSERT_TRUE(SoonEnough([&] { return engine_->waiter_drives() >= 1; }));
  std::thread b = Waiter(2, &second, &second_result);
  absl::SleepFor(absl::Milliseconds(20));
  const uint64_t drives = engine_->waiter_drives();
  EventOf(1).Notify();  // the first leaves
  a.join();
  EXPECT_EQ(first_result.load(), 1);
  ASSERT_TRUE(SoonEnough([&] { return engine_->waiter_drives() > drives; }))
      << "the second waiter never took progress over";
  Stall(false);
  b.join();
  EXPECT_EQ(second_result.load(), 1);
  EXPECT_EQ(ThreadOf(2, "completion"), second);
  EXPECT_EQ(ThreadOf(2, "callback"), second);
}

TEST_F(WaiterProgressTest, AWaiterThatGivesUpLosesNothing) {
  MakeEngine();
  Stall(true);
  Write(3);
  std::thread::id waiter;
  std::atomic<int> result{-1};
  std::thread t = Waiter(3, &waiter, &result, absl::Milliseconds(50));
  t.join();
  EXPECT_EQ(result.load(), 0) << "the deadline did not end the wait";
  EXPECT_GE(engine_->waiter_drives(), 1u);
  // The completion arrives after the waiter left: the progress thread runs it, and the work the
  // engine was given meanwhile.
  Notification posted_ran;
  ASSERT_TRUE(engine_->Post([&] { posted_ran.Notify(); }));
  Stall(false);
  EXPECT_TRUE(EventOf(3).WaitUntil(absl::Now() + kWaitPatience));
  EXPECT_TRUE(posted_ran.WaitForNotificationWithTimeout(kWaitPatience));
  EXPECT_NE(ThreadOf(3, "completion"), waiter);
}

TEST_F(WaiterProgressTest, ACallbackThatIsNotQuickNeverRunsOnAWaitersThread) {
  quick_ = false;
  MakeEngine();
  Stall(true);
  Write(4);
  std::thread::id waiter;
  std::atomic<int> result{-1};
  std::thread t = Waiter(4, &waiter, &result);
  ASSERT_TRUE(SoonEnough([&] { return engine_->waiter_drives() >= 1; }));
  Stall(false);
  t.join();
  EXPECT_EQ(result.load(), 1);
  EXPECT_EQ(ThreadOf(4, "completion"), waiter);
  EXPECT_NE(ThreadOf(4, "callback"), waiter) << "user code ran on the waiter's thread";
}

TEST_F(WaiterProgressTest, ACallbackThatBlocksHoldsOnlyItsOwnThread) {
  // A blocking callback on the executor; the waiter's own recv still completes on the waiter.
  MakeEngine();
  Stall(true);
  Notification release;
  // A callback that blocks until released (an executor thread holds it).
  Notification blocked, returned;
  ASSERT_TRUE(engine_->Post([&] {
    engine_->DeliverRecv({[&](const absl::Status&, const Tensor&, bool) {
                            blocked.Notify();
                            release.WaitForNotificationWithTimeout(kWaitPatience);
                            returned.Notify();
                          },
                          absl::OkStatus(), Tensor(), false, false});
  }));
  ASSERT_TRUE(blocked.WaitForNotificationWithTimeout(kWaitPatience));
  Write(6);
  std::thread::id waiter;
  std::atomic<int> result{-1};
  std::thread t = Waiter(6, &waiter, &result);
  ASSERT_TRUE(SoonEnough([&] { return engine_->waiter_drives() >= 1; }));
  Stall(false);
  t.join();
  EXPECT_EQ(result.load(), 1);
  EXPECT_EQ(ThreadOf(6, "callback"), waiter);
  release.Notify();
  EXPECT_TRUE(returned.WaitForNotificationWithTimeout(kWaitPatience));
}

TEST_F(WaiterProgressTest, StopWhileAWaiterDrivesLeavesItWaitingAndRunsWhatWasPosted) {
  MakeEngine();
  Stall(true);
  std::thread::id waiter;
  std::atomic<int> result{-1};
  std::thread t = Waiter(7, &waiter, &result);
  ASSERT_TRUE(SoonEnough([&] { return engine_->waiter_drives() >= 1; }));
  Notification posted_ran;
  ASSERT_TRUE(engine_->Post([&] { posted_ran.Notify(); }));
  engine_->Stop();
  EXPECT_TRUE(posted_ran.HasBeenNotified()) << "Stop returned before what was posted ran";
  EXPECT_EQ(result.load(), -1) << "the waiter returned without its event";
  EventOf(7).Notify();  // as a failed recv's callback would, on the teardown's thread
  t.join();
  EXPECT_EQ(result.load(), 1);
}

TEST_F(WaiterProgressTest, WithWaiterProgressOffTheProgressThreadDoesItAll) {
  ProgressEngine::Options options = Spinning();
  options.waiters_drive = false;
  MakeEngine(options);
  Stall(true);
  Write(8);
  std::thread::id waiter;
  std::atomic<int> result{-1};
  std::thread t = Waiter(8, &waiter, &result);
  absl::SleepFor(absl::Milliseconds(20));
  Stall(false);
  t.join();
  EXPECT_EQ(result.load(), 1);
  EXPECT_EQ(engine_->waiter_drives(), 0u);
  EXPECT_NE(ThreadOf(8, "completion"), waiter);
}

TEST_F(WaiterProgressTest, AnIdleWaiterLeavesTheFabricToTheProgressThreadAndIsWokenByIt) {
  ProgressEngine::Options options;
  options.waiter_spin = absl::ZeroDuration();
  MakeEngine(options);
  Stall(true);
  Write(9);
  std::thread::id waiter;
  std::atomic<int> result{-1};
  std::thread t = Waiter(9, &waiter, &result);
  ASSERT_TRUE(SoonEnough([&] { return engine_->waiter_drives() >= 1; }));
  absl::SleepFor(absl::Milliseconds(5));  // long idle: the waiter parks, the loop sleeps for it
  Stall(false);
  t.join();
  EXPECT_EQ(result.load(), 1);
  EXPECT_NE(ThreadOf(9, "completion"), waiter);
  EXPECT_EQ(ThreadOf(9, "callback"), ThreadOf(9, "completion"))
      << "a quick callback runs where its completion was handled";
}

TEST_F(WaiterProgressTest, IdleWaitersAndThePostersAllGetTheirsExactlyOnce) {
  // As below, with waiters that park as soon as they are idle: the progress thread and the
  // waiters trade progress constantly.
  ProgressEngine::Options options;
  options.waiter_spin = absl::ZeroDuration();
  MakeEngine(options);
  constexpr int kThreads = 4;
  constexpr int kRounds = 200;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        const uint64_t id = 5000 + t * kRounds + r;
        Write(id);
        EXPECT_TRUE(engine_->DriveUntil(EventOf(id), absl::Now() + kWaitPatience)) << id;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  MutexLock lock(&mu_);
  EXPECT_EQ(callback_runs_.size(), static_cast<size_t>(kThreads * kRounds));
  for (const auto& [id, runs] : callback_runs_) EXPECT_EQ(runs, 1) << id;
}

TEST_F(WaiterProgressTest, ManyWaitersAndThePostersAllGetTheirsExactlyOnce) {
  // Threads that wait with short deadlines, come back, and post, all at once: every write's
  // callback runs once, and every waiter ends with its event.
  MakeEngine();
  constexpr int kThreads = 4;
  constexpr int kRounds = 200;
  std::atomic<int> callbacks{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        const uint64_t id = 1000 + t * kRounds + r;
        Write(id);
        while (!engine_->DriveUntil(EventOf(id), absl::Now() + absl::Microseconds(200))) {
        }
        callbacks.fetch_add(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(callbacks.load(), kThreads * kRounds);
  MutexLock lock(&mu_);
  EXPECT_EQ(callback_runs_.size(), static_cast<size_t>(kThreads * kRounds));
  for (const auto& [id, runs] : callback_runs_) EXPECT_EQ(runs, 1) << id;
}

}  // namespace
}  // namespace tensorverbs::protocol
