// The public Task and Step (include/tensorverbs/task.h): two tasks of one cluster in this
// process, over grpc on loopback, used only through the public headers.
#include "tensorverbs/task.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "src/common/mutex.h"
#include "tensorverbs/placement.h"

namespace tensorverbs {
namespace {

using ::testing::HasSubstr;

// Task `task` of the two-task grpc cluster `cluster`.
TaskOptions OptionsFor(const ClusterSpec& cluster, int task) {
  TaskOptions o;
  o.cluster = cluster;
  o.job = "worker";
  o.task = task;
  o.protocol = "grpc";
  o.recv_timeout = absl::Seconds(30);
  return o;
}

class TaskTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::vector<int>> ports = PickFreePorts(2);
    ASSERT_TRUE(ports.ok()) << ports.status();
    cluster_ = *ClusterSpec::Parse(
        absl::StrCat("worker=127.0.0.1:", (*ports)[0], ",127.0.0.1:", (*ports)[1]));
    for (int i = 0; i < 2; ++i) {
      absl::StatusOr<std::unique_ptr<Task>> t = Task::Start(Options(i));
      ASSERT_TRUE(t.ok()) << t.status();
      tasks_[i] = *std::move(t);
    }
    for (auto& t : tasks_) ASSERT_TRUE(t->WaitForPeers(absl::Seconds(30)).ok());
  }

  TaskOptions Options(int task) { return OptionsFor(cluster_, task); }

  ClusterSpec cluster_;
  std::unique_ptr<Task> tasks_[2];
};

// RecvAsync from a peer this task has not heard from yet returns at once (asking the peer for
// its incarnation may take up to 30 s, so a thread of its own asks), and the recv completes once
// the peer is up and sends.
TEST(TaskAloneTest, RecvAsyncFromAPeerNotStartedYetReturnsAtOnceAndCompletesWhenItSends) {
  absl::StatusOr<std::vector<int>> ports = PickFreePorts(2);
  ASSERT_TRUE(ports.ok()) << ports.status();
  const ClusterSpec cluster = *ClusterSpec::Parse(
      absl::StrCat("worker=127.0.0.1:", (*ports)[0], ",127.0.0.1:", (*ports)[1]));
  auto options = [&](int task) { return OptionsFor(cluster, task); };
  std::unique_ptr<Task> receiver = *Task::Start(options(0));
  std::unique_ptr<Step> step = *receiver->BeginStep(1);
  Notification done;
  absl::StatusOr<Tensor> result;
  const absl::Time start = absl::Now();
  step->RecvAsync("worker:1", "late", [&](absl::StatusOr<Tensor> r) {
    result = std::move(r);
    done.Notify();
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "RecvAsync waited for the peer";
  EXPECT_FALSE(done.HasBeenNotified());
  absl::SleepFor(absl::Milliseconds(300));
  std::unique_ptr<Task> sender = *Task::Start(options(1));
  std::unique_ptr<Step> sending = *sender->BeginStep(1);
  Tensor sent = *sender->Empty(DataType::kInt64, TensorShape::Of({3}));
  const int64_t values[3] = {40, 41, 42};
  ASSERT_EQ(sent.TotalBytes(), sizeof(values));
  std::memcpy(sent.data(), values, sizeof(values));
  ASSERT_TRUE(sending->Send("worker:0", "late", sent).ok());
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(60)));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->ContentEquals(sent));
}

TEST_F(TaskTest, TwoTasksExchangeTensorsByTaskNameAndTheTensorOutlivesItsStepAndTask) {
  EXPECT_EQ(tasks_[1]->name(), "/job:worker/replica:0/task:1");
  EXPECT_EQ(tasks_[1]->protocol(), "grpc");
  std::unique_ptr<Step> s0 = *tasks_[0]->BeginStep(3);
  std::unique_ptr<Step> s1 = *tasks_[1]->BeginStep(3);
  EXPECT_EQ(s0->id(), 3);
  Tensor sent = *tasks_[1]->Empty(DataType::kInt32, TensorShape::Of({4, 5}));
  for (int i = 0; i < 20; ++i) sent.flat<int32_t>()[i] = i * 3;
  ASSERT_TRUE(s1->Send("worker:0", "a", sent).ok());
  // The full task name and the short one name the same task.
  absl::StatusOr<Tensor> got = s0->Recv("/job:worker/replica:0/task:1", "a", absl::Seconds(30));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->ContentEquals(sent));
  EXPECT_TRUE(s1->WaitUntilSendsTaken(absl::Seconds(10)).ok());
  EXPECT_EQ(tasks_[0]->stats().tensors, 1);
  EXPECT_EQ(tasks_[0]->stats().bytes, 80);
  EXPECT_EQ(tasks_[0]->stats().errors, 0);
  Tensor kept = *got;
  s0.reset();
  s1.reset();
  tasks_[0].reset();
  EXPECT_TRUE(kept.ContentEquals(sent)) << "the received tensor died with its task";
}

int64_t Counter(const Task& task, const std::string& name) {
  for (const auto& [n, v] : task.counters()) {
    if (n == name) return v;
  }
  return -1;
}

// A recv that says what it expects skips the meta-data round trip of a name never received
// before (grpc+verbs); a wrong guess still receives the tensor, one round trip later.
TEST_F(TaskTest, ARecvThatExpectsTheRightShapeNeedsNoMetaDataRoundTrip) {
  for (auto& t : tasks_) t.reset();
  std::unique_ptr<Task> tasks[2];
  for (int i = 0; i < 2; ++i) {
    TaskOptions o = Options(i);
    o.protocol = "grpc+verbs";
    absl::StatusOr<std::unique_ptr<Task>> t = Task::Start(o);
    ASSERT_TRUE(t.ok()) << t.status();
    tasks[i] = *std::move(t);
  }
  for (auto& t : tasks) ASSERT_TRUE(t->WaitForPeers(absl::Seconds(30)).ok());
  std::unique_ptr<Step> rx = *tasks[0]->BeginStep(1);
  std::unique_ptr<Step> tx = *tasks[1]->BeginStep(1);
  Tensor sent = *tasks[1]->Empty(DataType::kFloat32, TensorShape::Of({3, 5}));
  for (int i = 0; i < 15; ++i) sent.flat<float>()[i] = 0.5f * i;
  const int64_t responses = Counter(*tasks[1], "meta_responses");
  const int64_t hits = Counter(*tasks[0], "meta_cache_hits");
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(tx->Send("worker:0", absl::StrCat("right", i), sent).ok());
    RecvOptions o;
    o.timeout = absl::Seconds(30);
    o.expected_dtype = DataType::kFloat32;
    o.expected_shape = TensorShape::Of({3, 5});
    absl::StatusOr<Tensor> got = rx->Recv("worker:1", absl::StrCat("right", i), o);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(got->ContentEquals(sent));
  }
  EXPECT_EQ(Counter(*tasks[1], "meta_responses"), responses);
  EXPECT_GE(Counter(*tasks[0], "meta_cache_hits"), hits + 5);
  ASSERT_TRUE(tx->Send("worker:0", "wrong", sent).ok());
  RecvOptions o;
  o.timeout = absl::Seconds(30);
  o.expected_dtype = DataType::kInt64;
  o.expected_shape = TensorShape::Of({7});
  absl::StatusOr<Tensor> got = rx->Recv("worker:1", "wrong", o);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->ContentEquals(sent));
  EXPECT_EQ(Counter(*tasks[1], "meta_responses"), responses + 1);
  ASSERT_TRUE(tx->WaitUntilSendsTaken(absl::Seconds(10)).ok());
}

TEST_F(TaskTest, ARecvLandsInTheAllocatorItsOptionsNameAndGpuPoolsSayWhyNot) {
  std::unique_ptr<Step> s0 = *tasks_[0]->BeginStep(5);
  std::unique_ptr<Step> s1 = *tasks_[1]->BeginStep(5);
  Tensor sent = *tasks_[1]->Empty(DataType::kFloat64, TensorShape::Of({64}));
  for (int i = 0; i < 64; ++i) sent.flat<double>()[i] = i * 0.25;
  ASSERT_TRUE(s1->Send("worker:0", "heap", sent).ok());
  RecvOptions options;
  options.allocator = CpuAllocator();
  options.timeout = absl::Seconds(30);
  absl::StatusOr<Tensor> got = s0->Recv("worker:1", "heap", options);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->ContentEquals(sent));
  EXPECT_EQ(got->allocator(), CpuAllocator()) << "the options' allocator, not the pool";
  // Without a GPU (this machine), the GPU pool says why; with one it is that GPU's memory.
  absl::StatusOr<Allocator*> gpu = tasks_[0]->DeviceAllocator(0);
  if (gpu.ok()) {
    EXPECT_EQ((*gpu)->Placement(), MemoryPlacement::CudaDevice(0));
    // Into the GPU, then from the GPU back to the host of the other task: both proxy legs
    // through the public API alone, checked by the bytes that come back.
    RecvOptions into_gpu;
    into_gpu.allocator = *gpu;
    into_gpu.timeout = absl::Seconds(30);
    ASSERT_TRUE(s1->Send("worker:0", "to_gpu", sent).ok());
    absl::StatusOr<Tensor> on_gpu = s0->Recv("worker:1", "to_gpu", into_gpu);
    ASSERT_TRUE(on_gpu.ok()) << on_gpu.status();
    EXPECT_EQ(on_gpu->placement(), MemoryPlacement::CudaDevice(0));
    ASSERT_TRUE(s0->Send("worker:1", "from_gpu", *on_gpu).ok());
    absl::StatusOr<Tensor> back = s1->Recv("worker:0", "from_gpu", absl::Seconds(30));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(back->placement().host_accessible());
    EXPECT_TRUE(back->ContentEquals(sent));
    // GPU memory the caller owns (here: the GPU tensor just received), adopted and sent.
    ASSERT_TRUE(tasks_[0]->WaitForDeviceWork(0).ok());
    std::atomic<int> released{0};
    absl::StatusOr<Tensor> adopted = tasks_[0]->AdoptDeviceMemory(
        0, on_gpu->data(), on_gpu->dtype(), on_gpu->shape(), [keep = *on_gpu, &released]() mutable {
          keep = Tensor();
          released.fetch_add(1);
        });
    ASSERT_TRUE(adopted.ok()) << adopted.status();
    ASSERT_TRUE(s0->Send("worker:1", "adopted", *std::move(adopted)).ok());
    adopted = Tensor();
    absl::StatusOr<Tensor> taken = s1->Recv("worker:0", "adopted", absl::Seconds(30));
    ASSERT_TRUE(taken.ok()) << taken.status();
    EXPECT_TRUE(taken->ContentEquals(sent));
    for (int i = 0; i < 1000 && released.load() == 0; ++i) absl::SleepFor(absl::Milliseconds(10));
    EXPECT_EQ(released.load(), 1);
  } else {
    EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition) << gpu.status();
    EXPECT_THAT(gpu.status().message(), HasSubstr("GPU"));
    // Nor can the task send GPU memory the caller owns: refused, and released once.
    int released = 0;
    char byte = 0;
    absl::StatusOr<Tensor> adopted = tasks_[0]->AdoptDeviceMemory(
        0, &byte, DataType::kInt8, TensorShape::Of({1}), [&released] { ++released; });
    EXPECT_EQ(adopted.status().code(), absl::StatusCode::kFailedPrecondition) << adopted.status();
    EXPECT_THAT(adopted.status().message(), HasSubstr("CUDA runtime"));
    EXPECT_EQ(released, 1);
    absl::Status waited = tasks_[0]->WaitForDeviceWork(0);
    EXPECT_EQ(waited.code(), absl::StatusCode::kFailedPrecondition) << waited;
    EXPECT_THAT(waited.message(), HasSubstr("cuda:0"));
  }
  // The options' timeout bounds a blocking recv.
  RecvOptions brief;
  brief.timeout = absl::Milliseconds(50);
  EXPECT_EQ(s0->Recv("worker:1", "never", brief).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST_F(TaskTest, BadInputIsAClearErrorAndNothingElse) {
  TaskOptions bad = Options(7);
  absl::StatusOr<std::unique_ptr<Task>> t = Task::Start(bad);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("7"));
  bad = Options(0);
  bad.protocol = "carrier-pigeon";
  t = Task::Start(bad);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("carrier-pigeon"));
  bad = Options(0);
  bad.recv_timeout = absl::ZeroDuration();
  EXPECT_EQ(Task::Start(bad).status().code(), absl::StatusCode::kInvalidArgument);

  std::unique_ptr<Step> step = *tasks_[0]->BeginStep(1);
  Tensor x = Tensor::Make(DataType::kFloat32, TensorShape::Of({2}));
  for (const char* task : {"nonsense", "worker:", ":1", "worker:-1", "/job:worker/task:x"}) {
    absl::Status s = step->Send(task, "x", x);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << task << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("not a task name")) << task;
  }
  EXPECT_EQ(step->Send("worker:1", "x", Tensor()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(step->Recv("worker:5", "x", absl::Seconds(5)).ok()) << "no such task";
  std::atomic<int> calls{0};
  Notification done;
  step->RecvAsync("worker", "x", [&](absl::StatusOr<Tensor> r) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    if (calls.fetch_add(1) == 0) done.Notify();
  });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  // Sending the same name twice in a step is refused; the first send stands.
  ASSERT_TRUE(step->Send("worker:1", "twice", x).ok());
  EXPECT_FALSE(step->Send("worker:1", "twice", x).ok());
  EXPECT_EQ(calls.load(), 1);
}

TEST_F(TaskTest, ARecvTimesOutAndEndingTheStepCancelsWhatStillWaits) {
  std::unique_ptr<Step> step = *tasks_[0]->BeginStep(2);
  absl::StatusOr<Tensor> r = step->Recv("worker:1", "never", absl::Milliseconds(200));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(r.status().message(), HasSubstr("never"));
  std::atomic<int> calls{0};
  absl::Status status;
  Notification done;
  step->RecvAsync("worker:1", "also-never", [&](absl::StatusOr<Tensor> r) {
    status = r.status();
    if (calls.fetch_add(1) == 0) done.Notify();
  });
  step.reset();
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(calls.load(), 1);
  // A step just ended cannot be begun again by mistake.
  EXPECT_EQ(tasks_[0]->BeginStep(2).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(TaskTest, WaitingForSendsToBeTakenNamesWhatIsLeft) {
  std::unique_ptr<Step> s1 = *tasks_[1]->BeginStep(4);
  Tensor x = Tensor::Make(DataType::kFloat32, TensorShape::Of({3}));
  ASSERT_TRUE(s1->Send("worker:0", "x", x).ok());
  absl::Status s = s1->WaitUntilSendsTaken(absl::Milliseconds(100));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("1 tensors"));
  std::unique_ptr<Step> s0 = *tasks_[0]->BeginStep(4);
  ASSERT_TRUE(s0->Recv("worker:1", "x", absl::Seconds(30)).ok());
  EXPECT_TRUE(s1->WaitUntilSendsTaken(absl::Seconds(10)).ok());
}

// Over grpc+verbs the threads that block in Recv drive the task's progress themselves, one at a
// time, and leave it to each other and to the progress thread: several threads receiving at
// once, one of them giving up again and again, each get exactly their own tensors.
TEST(TaskWaitersTest, ThreadsBlockedInRecvOverGrpcVerbsEachGetTheirOwnTensors) {
  absl::StatusOr<std::vector<int>> ports = PickFreePorts(2);
  ASSERT_TRUE(ports.ok()) << ports.status();
  const ClusterSpec cluster = *ClusterSpec::Parse(
      absl::StrCat("worker=127.0.0.1:", (*ports)[0], ",127.0.0.1:", (*ports)[1]));
  std::unique_ptr<Task> tasks[2];
  for (int i = 0; i < 2; ++i) {
    TaskOptions o = OptionsFor(cluster, i);
    o.protocol = "grpc+verbs";
    absl::StatusOr<std::unique_ptr<Task>> t = Task::Start(o);
    ASSERT_TRUE(t.ok()) << t.status();
    tasks[i] = *std::move(t);
  }
  for (auto& t : tasks) ASSERT_TRUE(t->WaitForPeers(absl::Seconds(30)).ok());
  constexpr int kThreads = 3;
  constexpr int kRounds = 100;
  std::atomic<int> wrong{0}, gave_up{0};
  std::vector<std::thread> threads;
  for (int k = 0; k < kThreads; ++k) {
    threads.emplace_back([&, k] {
      for (int r = 0; r < kRounds; ++r) {
        const int64_t step_id = 1 + r;
        std::unique_ptr<Step> receiving = *tasks[0]->BeginStep(step_id * 10 + k);
        std::unique_ptr<Step> sending = *tasks[1]->BeginStep(step_id * 10 + k);
        // A recv nobody sends, given up at once: the wait hands progress on.
        if (!receiving->Recv("worker:1", "never", absl::Microseconds(200)).ok()) ++gave_up;
        Tensor t = *tasks[1]->Empty(DataType::kInt64, TensorShape::Of({2}));
        static_cast<int64_t*>(t.data())[0] = k;
        static_cast<int64_t*>(t.data())[1] = r;
        if (!sending->Send("worker:0", "x", t).ok()) ++wrong;
        absl::StatusOr<Tensor> got = receiving->Recv("worker:1", "x", absl::Seconds(30));
        if (!got.ok() || static_cast<const int64_t*>(got->data())[0] != k ||
            static_cast<const int64_t*>(got->data())[1] != r) {
          ++wrong;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(gave_up.load(), kThreads * kRounds);
  int64_t drives = -1;
  for (const auto& [name, value] : tasks[0]->counters()) {
    if (name == "waiter_drives") drives = value;
  }
  EXPECT_GE(drives, 0) << "the task reports no waiter_drives counter";
}

}  // namespace
}  // namespace tensorverbs
