// Task::Stop's bound (TENSORVERBS_STOP_TIMEOUT_MS): a recv callback run inline on the progress
// thread (TENSORVERBS_CALLBACK_THREADS=0) that blocks holds the task's shutdown, as a fabric
// call that never returns would. Stop and the destructor give up after the timeout and say
// where the shutdown is stuck; once the callback returns, the shutdown finishes in the
// background with nothing freed under it. Its own binary: the settings are the process's.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "tensorverbs/placement.h"
#include "tensorverbs/task.h"

namespace tensorverbs {
namespace {

using ::testing::HasSubstr;

// Before anything reads the settings (they are read once per process).
const bool kSettings = [] {
  setenv("TENSORVERBS_CALLBACK_THREADS", "0", 1);
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

// The progress threads of this process's tasks (named tv-progress): one per grpc+verbs task
// until its shutdown has finished.
int ProgressThreads() {
  int n = 0;
  std::error_code ec;
  for (const auto& t : std::filesystem::directory_iterator("/proc/self/task", ec)) {
    std::ifstream comm(t.path() / "comm");
    std::string name;
    if (std::getline(comm, name) && name == "tv-progress") ++n;
  }
  return n;
}

class TaskStopTest : public ::testing::Test {
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

TEST_F(TaskStopTest, AStopWithNothingStuckHasFinishedWhenItReturns) {
  ASSERT_EQ(ProgressThreads(), 2);
  tasks_[1]->Stop();
  tasks_[1].reset();
  // The task is gone when the destructor returns, not some time later on Stop's thread.
  EXPECT_EQ(ProgressThreads(), 1);
  tasks_[0].reset();
  EXPECT_EQ(ProgressThreads(), 0);
}

TEST_F(TaskStopTest, ACallbackThatBlocksTheLoopHoldsStopOnlyUntilTheTimeout) {
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

}  // namespace
}  // namespace tensorverbs
