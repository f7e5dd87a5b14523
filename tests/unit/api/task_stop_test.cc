// Task::Stop's and ~Task's bound (TENSORVERBS_STOP_TIMEOUT_MS). Built three times, as the
// settings are the process's: with TV_INLINE_CALLBACKS (TENSORVERBS_CALLBACK_THREADS=0), a recv
// callback that blocks holds the progress thread and so the shutdown, as a fabric call that never
// returns would; with TV_EXECUTOR_CALLBACKS (TENSORVERBS_INLINE_CALLBACK_US=0), it blocks one of
// the executor's threads, which the destructor joins; with neither (the default), it starts on
// the progress thread, which the loop leaves after the inline limit and the executor then joins
// as one of its own. Either way Stop or the destructor gives up after the timeout and says what
// is stuck; once the callback returns, the rest finishes in the background with nothing freed
// under it.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "tensorverbs/allocator.h"
#include "tensorverbs/placement.h"
#include "tensorverbs/task.h"

namespace tensorverbs {
namespace {

using ::testing::HasSubstr;

// Before anything reads the settings (they are read once per process).
#if defined(TV_INLINE_CALLBACKS)
constexpr bool kInline = true;
constexpr bool kInlineFirst = false;
#define TASK_STOP_TEST TaskStopInlineTest
#elif defined(TV_EXECUTOR_CALLBACKS)
constexpr bool kInline = false;
constexpr bool kInlineFirst = false;
#define TASK_STOP_TEST TaskStopExecutorTest
#else
constexpr bool kInline = false;
constexpr bool kInlineFirst = true;
#define TASK_STOP_TEST TaskStopInlineFirstTest
#endif
const bool kSettings = [] {
  if (kInline) setenv("TENSORVERBS_CALLBACK_THREADS", "0", 1);
  if (!kInline && !kInlineFirst) setenv("TENSORVERBS_INLINE_CALLBACK_US", "0", 1);
  setenv("TENSORVERBS_STOP_TIMEOUT_MS", "500", 1);
  return true;
}();

// Whether a listening socket can take `port` on 127.0.0.1 now (a live task's gRPC server holds
// it).
bool PortIsFree(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool bound = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return bound;
}

int Occurrences(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// This process's threads named `name`: a task's progress thread (tv-progress, one per
// grpc+verbs task until its shutdown has finished) and callback threads (tv-callbacks, until
// the task is destroyed).
int ThreadsNamed(const std::string& name) {
  int n = 0;
  std::error_code ec;
  for (const auto& t : std::filesystem::directory_iterator("/proc/self/task", ec)) {
    std::ifstream comm(t.path() / "comm");
    std::string line;
    if (std::getline(comm, line) && line == name) ++n;
  }
  return n;
}
int ProgressThreads() { return ThreadsNamed("tv-progress"); }

std::string ThreadName() {
  char name[16] = {};
  pthread_getname_np(pthread_self(), name, sizeof(name));
  return name;
}

// Waits up to `limit` for this process's threads named `name` to number `n`. Returns whether
// they do. The reaper of parked tasks (tv-reaper) runs only while a task is parked, so one of it
// means a task is parked and none that the parked tasks went.
bool ThreadsComeTo(const std::string& name, int n, absl::Duration limit = absl::Seconds(10)) {
  for (const absl::Time deadline = absl::Now() + limit;
       ThreadsNamed(name) != n && absl::Now() < deadline;) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  return ThreadsNamed(name) == n;
}

class TASK_STOP_TEST : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kSettings);
    absl::StatusOr<std::vector<int>> ports = PickFreePorts(2);
    ASSERT_TRUE(ports.ok()) << ports.status();
    ports_ = *ports;
    ClusterSpec cluster =
        *ClusterSpec::Parse(absl::StrCat("worker=127.0.0.1:", ports_[0], ",127.0.0.1:", ports_[1]));
    for (int i = 0; i < 2; ++i) {
      TaskOptions o;
      o.cluster = cluster;
      o.job = "worker";
      o.task = i;
      o.protocol = "grpc+verbs";
      absl::StatusOr<std::unique_ptr<Task>> t = Task::Start(o);
      ASSERT_TRUE(t.ok()) << t.status();
      tasks_[i] = *std::move(t);
    }
    for (auto& t : tasks_) ASSERT_TRUE(t->WaitForPeers(absl::Seconds(30)).ok());
  }

  std::vector<int> ports_;
  std::unique_ptr<Task> tasks_[2];
};

TEST_F(TASK_STOP_TEST, AStopWithNothingStuckHasFinishedWhenItReturns) {
  ASSERT_EQ(ProgressThreads(), 2);
  tasks_[1]->Stop();
  tasks_[1].reset();
  // The task is gone when the destructor returns, not some time later on Stop's thread.
  EXPECT_EQ(ProgressThreads(), 1);
  tasks_[0].reset();
  EXPECT_EQ(ProgressThreads(), 0);
}

TEST_F(TASK_STOP_TEST, ACallbackThatBlocksTheLoopHoldsStopOnlyUntilTheTimeout) {
  if (!kInline) GTEST_SKIP() << "callbacks run on the executor in this build";
  std::unique_ptr<Step> s0 = *tasks_[0]->BeginStep(1);
  std::unique_ptr<Step> s1 = *tasks_[1]->BeginStep(1);
  absl::Notification entered, release, returned;
  s1->RecvAsync("worker:0", "x", [&](absl::StatusOr<Tensor> t) {
    EXPECT_TRUE(t.ok()) << t.status();
    entered.Notify();
    release.WaitForNotification();  // on task 1's progress thread: its loop makes no turn
    returned.Notify();
  });
  Tensor x = *tasks_[0]->Empty(DataType::kFloat32, TensorShape::Of({4}));
  ASSERT_TRUE(s0->Send("worker:1", "x", x).ok());
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(absl::Seconds(30)));

  s1.reset();
  testing::internal::CaptureStderr();
  tasks_[1]->Stop();  // without the bound, this waits for the loop for good
  tasks_[1].reset();  // and so would the destructor
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_FALSE(returned.HasBeenNotified()) << "Stop returned only once the callback did";
  EXPECT_THAT(log, HasSubstr("task /job:worker/replica:0/task:1: Stop gave up after 500ms"));
  EXPECT_THAT(log, HasSubstr("Stop is closing the grpc+verbs channels"));
  EXPECT_THAT(log, HasSubstr("the progress thread is in "));
  EXPECT_EQ(Occurrences(log, "Stop gave up"), 1) << "once, not again by the destructor";
  EXPECT_FALSE(PortIsFree(ports_[1])) << "the abandoned task still serves until its Stop ends";
  EXPECT_EQ(ProgressThreads(), 2);

  // The callback returns: the shutdown finishes in the background and the task goes.
  release.Notify();
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (ProgressThreads() > 1 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(ProgressThreads(), 1) << "the task never finished stopping";
  EXPECT_TRUE(returned.HasBeenNotified());
  // Task 0 goes as usual.
  s0.reset();
  tasks_[0].reset();
  EXPECT_EQ(ProgressThreads(), 0);
}

TEST_F(TASK_STOP_TEST, ACallbackThatNeverReturnsHoldsTheDestructorOnlyUntilTheTimeout) {
  if (kInline) GTEST_SKIP() << "callbacks run inline in this build";
  const int callback_threads = ThreadsNamed("tv-callbacks");  // both tasks'
  ASSERT_GT(callback_threads, 0);
  std::unique_ptr<Step> s0 = *tasks_[0]->BeginStep(1);
  std::unique_ptr<Step> s1 = *tasks_[1]->BeginStep(1);
  absl::Notification entered, release, returned;
  // Into memory of no pool of the task's, so that nothing makes the task park instead.
  RecvOptions heap;
  heap.allocator = CpuAllocator();
  s1->RecvAsync("worker:0", "x", heap, [&](absl::StatusOr<Tensor> t) {
    EXPECT_TRUE(t.ok()) << t.status();
    entered.Notify();
    release.WaitForNotification();  // on one of task 1's callback threads
    returned.Notify();
  });
  ASSERT_TRUE(
      s0->Send("worker:1", "x", *tasks_[0]->Empty(DataType::kFloat32, TensorShape::Of({4}))).ok());
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(absl::Seconds(30)));

  s1.reset();
  testing::internal::CaptureStderr();
  tasks_[1]->Stop();  // Stop does not wait for callbacks
  const std::string stop_log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(Occurrences(stop_log, "gave up"), 0) << stop_log;
  testing::internal::CaptureStderr();
  tasks_[1].reset();  // the destructor joins the callback threads: without the bound, for good
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_FALSE(returned.HasBeenNotified()) << "the destructor returned only once the callback did";
  EXPECT_THAT(log, HasSubstr("task /job:worker/replica:0/task:1: destroying it gave up after "
                             "500ms (TENSORVERBS_STOP_TIMEOUT_MS)"));
  EXPECT_THAT(log, HasSubstr("a recv callback has not returned"));

  release.Notify();
  ThreadsComeTo("tv-callbacks", callback_threads / 2, absl::Seconds(30));
  EXPECT_EQ(ThreadsNamed("tv-callbacks"), callback_threads / 2) << "the task never went";
  EXPECT_TRUE(returned.HasBeenNotified());
  s0.reset();
  tasks_[0].reset();
  EXPECT_EQ(ThreadsNamed("tv-callbacks"), 0);
}

// By default a recv callback runs on the progress thread; one that blocks there holds every
// transfer of the task only until the inline limit (1 ms), once: the loop moves to a new thread,
// the task's other recvs go on, and later callbacks run on the callback threads.
TEST_F(TASK_STOP_TEST, ACallbackThatBlocksTheProgressThreadIsLeftThereAndOtherRecvsGoOn) {
  if (!kInlineFirst) GTEST_SKIP() << "callbacks start inline only by default";
  std::unique_ptr<Step> s0 = *tasks_[0]->BeginStep(1);
  std::unique_ptr<Step> s1 = *tasks_[1]->BeginStep(1);
  absl::Notification release, returned;
  // Promises, not absl::Notification: TSan sees their hand-off of the thread names (Debian's
  // abseil is not built for TSan).
  std::promise<std::string> entered;
  std::future<std::string> blocked_on = entered.get_future();
  testing::internal::CaptureStderr();
  s1->RecvAsync("worker:0", "x", [&](absl::StatusOr<Tensor> t) {
    EXPECT_TRUE(t.ok()) << t.status();
    entered.set_value(ThreadName());
    release.WaitForNotification();
    returned.Notify();
  });
  ASSERT_TRUE(
      s0->Send("worker:1", "x", *tasks_[0]->Empty(DataType::kFloat32, TensorShape::Of({4}))).ok());
  ASSERT_EQ(blocked_on.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_EQ(blocked_on.get(), "tv-progress") << "the callback did not run on the progress thread";

  // With the callback still blocked, task 1 receives more, on a loop that moved on.
  for (int i = 0; i < 3; ++i) {
    const std::string key = absl::StrCat("y", i);
    Tensor y = *tasks_[0]->Empty(DataType::kInt32, TensorShape::Of({1}));
    y.flat<int32_t>()[0] = i;
    ASSERT_TRUE(s0->Send("worker:1", key, y).ok());
    std::promise<std::string> got;
    std::future<std::string> ran_on = got.get_future();
    s1->RecvAsync("worker:0", key, [&](absl::StatusOr<Tensor> t) {
      ASSERT_TRUE(t.ok()) << t.status();
      EXPECT_EQ(t->flat<int32_t>()[0], i);
      got.set_value(ThreadName());
    });
    ASSERT_EQ(ran_on.wait_for(std::chrono::seconds(30)), std::future_status::ready) << key;
    EXPECT_EQ(ran_on.get(), "tv-callbacks") << key << ": callbacks go to the callback threads now";
  }
  EXPECT_FALSE(returned.HasBeenNotified());
  EXPECT_EQ(ProgressThreads(), 2) << "the thread left behind is named as a callback thread";
  release.Notify();
  ASSERT_TRUE(returned.WaitForNotificationWithTimeout(absl::Seconds(30)));
  s1.reset();
  s0.reset();
  tasks_[1].reset();
  tasks_[0].reset();
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(Occurrences(log, "the loop moved to a new thread"), 1) << log;
  EXPECT_EQ(Occurrences(log, "gave up"), 0) << log;
  EXPECT_EQ(ProgressThreads(), 0);
  EXPECT_EQ(ThreadsNamed("tv-callbacks"), 0);
}

// A callback that stops and destroys its own task (the last reference) cannot wait for the
// shutdown, which waits for it: Stop and the destructor return at once, and the task goes once
// the callback has ended. (The destructor used to join the callback's own thread.)
TEST_F(TASK_STOP_TEST, ATaskStoppedAndDestroyedInItsOwnCallbackGoesOnceTheCallbackEnds) {
  std::unique_ptr<Step> s0 = *tasks_[0]->BeginStep(1);
  std::unique_ptr<Step> s1 = *tasks_[1]->BeginStep(1);
  absl::Notification returned;
  testing::internal::CaptureStderr();
  // The step, and with it the last reference to the task, goes in the callback too.
  Step* step = s1.release();
  RecvOptions heap;  // into no pool of the task's: nothing makes it park instead of going
  heap.allocator = CpuAllocator();
  step->RecvAsync("worker:0", "x", heap, [&, step](absl::StatusOr<Tensor> t) {
    EXPECT_TRUE(t.ok()) << t.status();
    tasks_[1]->Stop();
    tasks_[1].reset();
    delete step;
    returned.Notify();
  });
  ASSERT_TRUE(
      s0->Send("worker:1", "x", *tasks_[0]->Empty(DataType::kFloat32, TensorShape::Of({4}))).ok());
  ASSERT_TRUE(returned.WaitForNotificationWithTimeout(absl::Seconds(30)));
  // Task 1 goes on a thread of its own once the callback has returned, or, when memory of its
  // pool was still in use then, is parked and freed once that memory is.
  s0.reset();
  tasks_[0].reset();
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while ((ProgressThreads() > 0 || ThreadsNamed("tv-callbacks") > 0) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(ProgressThreads(), 0) << "a task never went";
  EXPECT_EQ(ThreadsNamed("tv-callbacks"), 0) << "a task never went";
  EXPECT_EQ(Occurrences(log, "gave up"), 0) << log;
}

// A Step can outlive its Task. Whichever holds the last reference, the task's pool stays while a
// tensor of it lives, and goes once the tensor has, with no other task starting or going.
TEST_F(TASK_STOP_TEST, AStepThatOutlivesItsTaskKeepsThePoolUnderATensorStillHeld) {
  std::unique_ptr<Step> s1 = *tasks_[1]->BeginStep(1);
  Tensor held = *tasks_[1]->Empty(DataType::kUInt8, TensorShape::Of({1 << 20}));
  auto* bytes = held.flat<uint8_t>();
  for (int i = 0; i < (1 << 20); ++i) bytes[i] = static_cast<uint8_t>(i * 7);
  tasks_[1].reset();  // the step still holds the task
  EXPECT_EQ(ProgressThreads(), 1) << "the task stopped when its Task went";
  s1.reset();  // the last reference, with `held` in the task's pool
  int wrong = 0;
  for (int i = 0; i < (1 << 20); ++i) wrong += bytes[i] != static_cast<uint8_t>(i * 7);
  EXPECT_EQ(wrong, 0);
  const int callback_threads = ThreadsNamed("tv-callbacks");  // both tasks'
  EXPECT_TRUE(ThreadsComeTo("tv-reaper", 1)) << "task 1 was not parked";
  held = Tensor();
  EXPECT_TRUE(ThreadsComeTo("tv-reaper", 0)) << "the parked task never went";
  // Threads that handed the task on (its stop's, its deleter's) were started from its callback
  // threads and carry their name until they end.
  EXPECT_TRUE(ThreadsComeTo("tv-callbacks", callback_threads / 2)) << "task 1 never went";
  tasks_[0].reset();
  EXPECT_EQ(ThreadsNamed("tv-callbacks"), 0) << "a task never went";
}

// A task stopped and destroyed in its own recv callback while that recv's tensor, from the
// task's pool, is still held is parked; it goes once the tensor has, though no task starts or
// goes afterwards. (Before, parked tasks were reaped only when a task started or went, so this
// one kept its threads and memory until the process ended.)
TEST_F(TASK_STOP_TEST, ATaskEndedInItsCallbackWhileItsPoolsTensorIsHeldGoesOnceTheTensorHas) {
  const int callback_threads = ThreadsNamed("tv-callbacks");  // both tasks'
  std::unique_ptr<Step> s0 = *tasks_[0]->BeginStep(1);
  Step* step = (*tasks_[1]->BeginStep(1)).release();
  // A promise, not absl::Notification: TSan sees its hand-off of `kept` (Debian's abseil is
  // not built for TSan).
  std::promise<void> returned;
  std::future<void> has_returned = returned.get_future();
  Tensor kept;
  step->RecvAsync("worker:0", "x", RecvOptions(), [&, step](absl::StatusOr<Tensor> t) {
    EXPECT_TRUE(t.ok()) << t.status();
    if (t.ok()) kept = *std::move(t);  // in task 1's pool (the default allocator)
    tasks_[1]->Stop();
    tasks_[1].reset();
    delete step;  // the last reference, while `kept` holds the pool
    returned.set_value();
  });
  ASSERT_TRUE(
      s0->Send("worker:1", "x", *tasks_[0]->Empty(DataType::kFloat32, TensorShape::Of({4}))).ok());
  ASSERT_EQ(has_returned.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  ASSERT_EQ(kept.TotalBytes(), 16u);
  EXPECT_TRUE(ThreadsComeTo("tv-reaper", 1)) << "task 1 was not parked";
  kept = Tensor();
  EXPECT_TRUE(ThreadsComeTo("tv-reaper", 0)) << "the parked task never went";
  // Threads that handed the task on (its stop's, its deleter's) were started from its callback
  // threads and carry their name until they end.
  EXPECT_TRUE(ThreadsComeTo("tv-callbacks", callback_threads / 2)) << "task 1 never went";
  s0.reset();
  tasks_[0].reset();
  EXPECT_EQ(ThreadsNamed("tv-callbacks"), 0);
}

}  // namespace
}  // namespace tensorverbs
