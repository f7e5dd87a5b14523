// What one steady-state grpc+verbs transfer costs in heap allocations, counted across every
// thread of both tasks (sender and receiver are Servers in this process over the loopback
// fabric). A training loop sends the same keys with the same shapes every step; after a few
// steps nothing about a transfer is new, so each allocation it still makes is per-tensor cost
// (a malloc, a free, often a lock in the allocator) that the design can pool away.
//
// Measured on 2026-11-24: 26 per transfer with one key per step (the step's own objects: its
// rendezvous on each task, their tables, the test's step handles) and 3.0 with 64 keys per
// step. What a transfer still allocates: the destination tensor's buffer object, a control
// message queued behind busy slots, and the per-turn vector of completed recvs handed to the
// callback thread.
//
// The counter (tests/support/allocation_counter.cc) replaces the global operator new of this
// binary only; the test is built without sanitizers, whose allocators count differently.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/support/allocation_counter.h"
#include "tests/support/inprocess_cluster.h"

namespace tensorverbs {
namespace {

struct Param {
  const char* name;
  int keys_per_step;
  // Heap allocations per transfer measured when this budget was set, plus a little room for
  // background threads (gRPC keep-alives, the watchdog's probes). It shrinks as per-tensor
  // allocations are pooled away, towards none.
  double budget;
};

class SteadyStateCostTest : public testing::ClusterTest<Param> {};

// Receives `keys` at `step` on task 0 (task 1 sends them first, as a passive Send) and waits for
// every callback. The callbacks only count, so they allocate nothing themselves.
void RunStep(testing::InProcessCluster& cluster, int64_t step, const std::vector<ParsedKey>& keys,
             const std::vector<Tensor>& tensors, std::atomic<int>* errors) {
  auto sender = cluster.Step(1, step);
  for (size_t i = 0; i < keys.size(); ++i) ASSERT_TRUE(sender->Send(keys[i], tensors[i]).ok());
  auto receiver = cluster.Step(0, step);
  std::atomic<int> done{0};
  for (const ParsedKey& key : keys) {
    receiver->RecvAsync(key, RecvArgs(),
                        [&done, errors](const absl::Status& s, const Tensor&, bool) {
                          if (!s.ok()) errors->fetch_add(1);
                          done.fetch_add(1, std::memory_order_release);
                        });
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (done.load(std::memory_order_acquire) < static_cast<int>(keys.size()) &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Microseconds(50));
  }
  ASSERT_EQ(done.load(), static_cast<int>(keys.size())) << "step " << step << " timed out";
  receiver.reset();
  sender.reset();
  cluster.server(0).rendezvous_mgr()->Cleanup(step);
  cluster.server(1).rendezvous_mgr()->Cleanup(step);
}

TEST_P(SteadyStateCostTest, AllocationsPerTransferStayWithinTheBudget) {
  testing::ClusterOptions o;
  o.protocol = "grpc+verbs";
  o.fabric = "loopback";
  StartWith(2, o);
  const int n = GetParam().keys_per_step;
  std::vector<ParsedKey> keys;
  std::vector<Tensor> tensors;
  for (int i = 0; i < n; ++i) {
    // TensorFlow-style names: the key carries devices, incarnation and an edge name.
    keys.push_back(Key(1, absl::StrCat("gradients/layer_", i, "/conv/weights_grad:0")));
    tensors.push_back(PoolTensor(1, DataType::kFloat32, {16}, static_cast<uint32_t>(i) + 1));
  }
  std::atomic<int> errors{0};
  int64_t step = 1;
  // Warm-up: channels, meta-data caches, pools and tables reach their steady size.
  for (; step <= 8; ++step) ASSERT_NO_FATAL_FAILURE(RunStep(cluster_, step, keys, tensors, &errors));
  constexpr int kSteps = 20;
  testing::StartCountingAllocations();
  for (int s = 0; s < kSteps; ++s, ++step) {
    ASSERT_NO_FATAL_FAILURE(RunStep(cluster_, step, keys, tensors, &errors));
  }
  const int64_t allocations = testing::StopCountingAllocations();
  EXPECT_EQ(errors.load(), 0);
  const double per_transfer =
      static_cast<double>(allocations) / (static_cast<double>(kSteps) * n);
  std::printf("%d keys per step: %.2f heap allocations per transfer (both tasks, every thread)\n",
              n, per_transfer);
  RecordProperty("allocations_per_transfer", absl::StrCat(per_transfer));
  EXPECT_LE(per_transfer, GetParam().budget) << "a change added heap allocations to every transfer";
}

INSTANTIATE_TEST_SUITE_P(Steps, SteadyStateCostTest,
                         ::testing::Values(Param{"OneKeyPerStep", 1, 30},
                                           Param{"SixtyFourKeysPerStep", 64, 4.5}),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace tensorverbs
