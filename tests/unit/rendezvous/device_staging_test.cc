// The machines of device staging (device_staging.h), driven directly with a stand-in GPU whose
// copies the test holds, fails and releases: a recv into device memory (ProxyToDevice, through
// CopyingToDevice) and a staging in chunks (StageToHostInChunks). Every row of both tables is
// walked, and each test says which rows it took (the tables' tap); a move that is no row fails
// the test that made it.
#include "src/rendezvous/device_staging.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "src/common/state_table.h"
#include "src/rendezvous/remote_rendezvous.h"
#include "tests/support/stand_in_device.h"
#include "tests/support/state_rows.h"

namespace tensorverbs::device_staging {
namespace {

using ::tensorverbs::testing::ExpectEveryRowWalked;
using ::tensorverbs::testing::RowsTaken;
using ::tensorverbs::testing::Walk;
using ::testing::HasSubstr;

constexpr uint64_t kChunk = 4096;
constexpr int64_t kFloats = 3 * kChunk / 4;  // three chunks

// Polls `condition` for up to 10 s: the stand-in copier completes on a thread of its own.
bool Within(const std::function<bool()>& condition) {
  for (int i = 0; i < 10000 && !condition(); ++i) absl::SleepFor(absl::Milliseconds(1));
  return condition();
}

struct RecvOutcome {
  std::atomic<int> calls{0};
  absl::Status status;
  Tensor tensor;
  bool is_dead = false;
};

class DeviceStagingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    RowsTaken::Clear();
    SetTransitionTap(&RowsTaken::Tap);
    env_.recv_allocator = CpuAllocator();
    env_.stats = &stats_;
    env_.device_copier = &copier_;
    env_.proxy_chunk_bytes = kChunk;
  }
  void TearDown() override {
    copier_.ReleaseHeld(-1);
    EXPECT_TRUE(Within([&] { return stats_.device_copies_in_flight.load() == 0; }));
    EXPECT_THAT(RowsTaken::Refused(), ::testing::IsEmpty()) << "moves that are no row";
    SetTransitionTap(nullptr);
  }

  // A host tensor of three chunks, standing in for the pool tensor a recv lands in.
  static Tensor Landing(float scale) {
    Tensor t = *Tensor::Allocate(CpuAllocator(), DataType::kFloat32, TensorShape::Of({kFloats}));
    for (int64_t i = 0; i < kFloats; ++i) t.flat<float>()[i] = scale * static_cast<float>(i);
    return t;
  }
  // A recv into the stand-in GPU: its `done` (to call as the transport would) and its progress
  // (RecvArgs::on_landed).
  RecvDoneCallback StartRecv(const std::shared_ptr<RecvOutcome>& out, RecvArgs* args) {
    return CopyingToDevice(
        &env_, "k", &gpu_,
        [out](const absl::Status& s, const Tensor& t, bool is_dead) {
          out->status = s;
          out->tensor = t;
          out->is_dead = is_dead;
          out->calls.fetch_add(1);
        },
        args);
  }
  static bool SameBytes(const Tensor& a, const Tensor& b) {
    return a.TotalBytes() == b.TotalBytes() && std::memcmp(a.data(), b.data(), a.TotalBytes()) == 0;
  }
  static ::testing::AssertionResult Took(ProxyState from, ProxyEvent event, ProxyState to) {
    return RowsTaken::Took(ProxyStateTable(), from, event, to);
  }
  static ::testing::AssertionResult Took(StagingState from, StagingEvent event, StagingState to) {
    return RowsTaken::Took(StagingStateTable(), from, event, to);
  }

  TransferStats stats_;
  testing::StandInDeviceAllocator gpu_{0};
  testing::StandInDeviceCopier copier_{1};
  WorkerEnv env_;  // no callback executor: `done` runs on the thread that ends the machine
};

TEST(DeviceStagingTables, EveryRowIsWalkedByATest) {
  const char* const kParts = "DeviceStagingTest.PartsGoToTheDeviceAsTheyLandAndTheRestAtTheEnd";
  ExpectEveryRowWalked(
      ProxyStateTable(),
      {
          Walk(ProxyState::kLanding, ProxyEvent::kLanded, ProxyState::kLanding, kParts),
          Walk(ProxyState::kLanding, ProxyEvent::kCopyDone, ProxyState::kLanding, kParts),
          Walk(ProxyState::kLanding, ProxyEvent::kRecvEnded, ProxyState::kDraining, kParts),
          Walk(ProxyState::kLanding, ProxyEvent::kRecvEnded, ProxyState::kDone,
               "DeviceStagingTest.ARecvThatFailsWithNoCopyInFlightEndsAtOnce"),
          Walk(ProxyState::kDraining, ProxyEvent::kCopyDone, ProxyState::kDraining, kParts),
          Walk(ProxyState::kDraining, ProxyEvent::kCopyDone, ProxyState::kDone, kParts),
          Walk(ProxyState::kDraining, ProxyEvent::kLanded, ProxyState::kDraining,
               "DeviceStagingTest.AFailedPartEndsTheRecvWithItsErrorAndALateLandingCopiesNothing"),
          Walk(ProxyState::kDone, ProxyEvent::kLanded, ProxyState::kDone,
               "DeviceStagingTest.AFailedPartEndsTheRecvWithItsErrorAndALateLandingCopiesNothing"),
      });
  auto staging = [](StagingState from, StagingState to, const char* test) {
    return Walk(from, StagingEvent::kChunkDone, to, test);
  };
  ExpectEveryRowWalked(StagingStateTable(),
                       {
                           staging(StagingState::kStaging, StagingState::kStaging,
                                   "DeviceStagingTest.ChunksAreToldInOrderAsTheyAreStaged"),
                           staging(StagingState::kStaging, StagingState::kStaged,
                                   "DeviceStagingTest.ChunksAreToldInOrderAsTheyAreStaged"),
                           staging(StagingState::kStaging, StagingState::kFailed,
                                   "DeviceStagingTest.AChunkThatFailsIsToldOnceAndNothingAfterIt"),
                           staging(StagingState::kFailed, StagingState::kFailed,
                                   "DeviceStagingTest.AChunkThatFailsIsToldOnceAndNothingAfterIt"),
                       });
}

// Two parts land and go to the device at once; the recv ends while the second copy waits, and
// the third part's copy goes at the end. `done` comes after the last copy, with every byte.
TEST_F(DeviceStagingTest, PartsGoToTheDeviceAsTheyLandAndTheRestAtTheEnd) {
  auto out = std::make_shared<RecvOutcome>();
  RecvArgs args;
  RecvDoneCallback done = StartRecv(out, &args);
  ASSERT_EQ(args.progress_bytes, kChunk);
  ASSERT_TRUE(args.on_landed);
  const Tensor landing = Landing(2.0f);
  copier_.Hold(CopyDirection::kHostToDevice);
  args.on_landed(landing, kChunk);
  ASSERT_TRUE(Within([&] { return copier_.held() == 1; }));
  copier_.ReleaseHeld(1);  // the first part's copy completes while the recv goes on
  ASSERT_TRUE(Within([&] { return stats_.device_copies_in_flight.load() == 0; }));
  EXPECT_TRUE(Took(ProxyState::kLanding, ProxyEvent::kCopyDone, ProxyState::kLanding));
  args.on_landed(landing, 2 * kChunk);
  ASSERT_TRUE(Within([&] { return copier_.held() == 1; }));
  EXPECT_TRUE(Took(ProxyState::kLanding, ProxyEvent::kLanded, ProxyState::kLanding));
  std::move(done)(absl::OkStatus(), landing, false);
  ASSERT_TRUE(Within([&] { return copier_.held() == 2; })) << "the rest goes at the end";
  EXPECT_TRUE(Took(ProxyState::kLanding, ProxyEvent::kRecvEnded, ProxyState::kDraining));
  EXPECT_EQ(out->calls.load(), 0) << "not before the copies completed";
  copier_.ReleaseHeld(-1);
  ASSERT_TRUE(Within([&] { return out->calls.load() == 1; }));
  ASSERT_TRUE(out->status.ok()) << out->status;
  EXPECT_TRUE(out->tensor.placement() == gpu_.Placement());
  EXPECT_TRUE(SameBytes(out->tensor, landing));
  EXPECT_TRUE(Took(ProxyState::kDraining, ProxyEvent::kCopyDone, ProxyState::kDraining));
  EXPECT_TRUE(Took(ProxyState::kDraining, ProxyEvent::kCopyDone, ProxyState::kDone));
  EXPECT_EQ(stats_.host_to_device.load(), 1) << "one copy of the tensor, in three parts";
  EXPECT_EQ(copier_.host_to_device(), 3);
}

TEST_F(DeviceStagingTest, ARecvThatFailsWithNoCopyInFlightEndsAtOnce) {
  auto out = std::make_shared<RecvOutcome>();
  RecvArgs args;
  RecvDoneCallback done = StartRecv(out, &args);
  std::move(done)(absl::UnavailableError("the peer went away"), Tensor(), false);
  EXPECT_EQ(out->calls.load(), 1);
  EXPECT_EQ(out->status.code(), absl::StatusCode::kUnavailable) << out->status;
  EXPECT_TRUE(Took(ProxyState::kLanding, ProxyEvent::kRecvEnded, ProxyState::kDone));
  EXPECT_EQ(copier_.host_to_device(), 0);
}

// The first part's copy fails after the recv ended (both its copies in flight): the recv ends
// with that error once the last copy completed, and a landing told after the recv ended (the
// transport's progress can trail it) copies nothing, before and after the end.
TEST_F(DeviceStagingTest, AFailedPartEndsTheRecvWithItsErrorAndALateLandingCopiesNothing) {
  auto out = std::make_shared<RecvOutcome>();
  RecvArgs args;
  RecvDoneCallback done = StartRecv(out, &args);
  const Tensor landing = Landing(3.0f);
  copier_.Hold(CopyDirection::kHostToDevice);
  copier_.FailNext(CopyDirection::kHostToDevice, absl::InternalError("stand-in failure"));
  args.on_landed(landing, kChunk);
  std::move(done)(absl::OkStatus(), landing, false);
  EXPECT_EQ(copier_.held(), 2u) << "the first part's copy and the rest's";
  args.on_landed(landing, 2 * kChunk);  // late: the recv ended, its copies are in flight
  EXPECT_EQ(copier_.held(), 2u);
  EXPECT_TRUE(Took(ProxyState::kDraining, ProxyEvent::kLanded, ProxyState::kDraining));
  copier_.ReleaseHeld(-1);
  ASSERT_TRUE(Within([&] { return out->calls.load() == 1; }));
  EXPECT_EQ(out->status.code(), absl::StatusCode::kInternal) << out->status;
  EXPECT_THAT(std::string(out->status.message()), HasSubstr("stand-in failure"));
  EXPECT_THAT(std::string(out->status.message()), HasSubstr("bytes 0 to 4096"));
  EXPECT_FALSE(out->tensor.IsInitialized());
  args.on_landed(landing, 3 * kChunk);  // later still
  EXPECT_TRUE(Took(ProxyState::kDone, ProxyEvent::kLanded, ProxyState::kDone));
  EXPECT_EQ(copier_.held(), 0u);
  EXPECT_EQ(out->calls.load(), 1);
  EXPECT_EQ(stats_.device_copy_errors.load(), 1);
}

// A part's copy fails while the recv goes on: the recv's end copies nothing more and ends at
// once with that error.
TEST_F(DeviceStagingTest, AFailedPartStopsTheCopiesAndTheRecvEndsWithItsError) {
  auto out = std::make_shared<RecvOutcome>();
  RecvArgs args;
  RecvDoneCallback done = StartRecv(out, &args);
  const Tensor landing = Landing(3.0f);
  copier_.FailNext(CopyDirection::kHostToDevice, absl::InternalError("stand-in failure"));
  args.on_landed(landing, kChunk);
  ASSERT_TRUE(Within([&] { return stats_.device_copy_errors.load() == 1; }));
  args.on_landed(landing, 2 * kChunk);
  std::move(done)(absl::OkStatus(), landing, false);
  ASSERT_TRUE(Within([&] { return out->calls.load() == 1; }));
  EXPECT_EQ(out->status.code(), absl::StatusCode::kInternal) << out->status;
  EXPECT_EQ(copier_.host_to_device(), 0) << "no copy after the failed one";
  EXPECT_TRUE(Took(ProxyState::kLanding, ProxyEvent::kRecvEnded, ProxyState::kDone));
}

TEST_F(DeviceStagingTest, ChunksAreToldInOrderAsTheyAreStaged) {
  Tensor source = *Tensor::Allocate(&gpu_, DataType::kFloat32, TensorShape::Of({kFloats}));
  const Tensor host = Landing(4.0f);
  std::memcpy(source.data(), host.data(), host.TotalBytes());
  std::mutex mu;
  std::vector<uint64_t> told;
  absl::StatusOr<Tensor> staged =
      StageToHostInChunks(&env_, "k", source, kChunk, [&](const absl::Status& s, uint64_t bytes) {
        EXPECT_TRUE(s.ok()) << s;
        std::lock_guard<std::mutex> lock(mu);
        told.push_back(bytes);
      });
  ASSERT_TRUE(staged.ok()) << staged.status();
  ASSERT_TRUE(Within([&] {
    std::lock_guard<std::mutex> lock(mu);
    return told.size() == 3;
  }));
  EXPECT_EQ(told, (std::vector<uint64_t>{kChunk, 2 * kChunk, 3 * kChunk}));
  EXPECT_TRUE(SameBytes(*staged, host));
  EXPECT_TRUE(Took(StagingState::kStaging, StagingEvent::kChunkDone, StagingState::kStaging));
  EXPECT_TRUE(Took(StagingState::kStaging, StagingEvent::kChunkDone, StagingState::kStaged));
  EXPECT_EQ(stats_.device_to_host.load(), 1) << "one copy of the tensor, in three parts";
}

TEST_F(DeviceStagingTest, AChunkThatFailsIsToldOnceAndNothingAfterIt) {
  Tensor source = *Tensor::Allocate(&gpu_, DataType::kFloat32, TensorShape::Of({kFloats}));
  std::mutex mu;
  std::vector<absl::Status> told;
  copier_.FailNext(CopyDirection::kDeviceToHost, absl::InternalError("stand-in failure"));
  absl::StatusOr<Tensor> staged =
      StageToHostInChunks(&env_, "k", source, kChunk, [&](const absl::Status& s, uint64_t) {
        std::lock_guard<std::mutex> lock(mu);
        told.push_back(s);
      });
  ASSERT_TRUE(staged.ok()) << staged.status();
  ASSERT_TRUE(Within([&] { return stats_.device_copies_in_flight.load() == 0; }));
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(told.size(), 1u);
  EXPECT_EQ(told[0].code(), absl::StatusCode::kInternal) << told[0];
  EXPECT_TRUE(Took(StagingState::kStaging, StagingEvent::kChunkDone, StagingState::kFailed));
  EXPECT_TRUE(Took(StagingState::kFailed, StagingEvent::kChunkDone, StagingState::kFailed));
  EXPECT_EQ(stats_.device_copy_errors.load(), 1);
}

}  // namespace
}  // namespace tensorverbs::device_staging
