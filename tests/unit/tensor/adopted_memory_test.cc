#include "src/tensor/adopted_memory.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace tensorverbs {
namespace {

TEST(AdoptMemory, TheTensorViewsTheMemoryAndReleasesItOnceWithTheLastReference) {
  std::vector<char> memory(1000);  // stands in for a GPU's: adopting never touches the bytes
  std::atomic<int> released{0};
  {
    absl::StatusOr<Tensor> t =
        AdoptMemory(MemoryPlacement::CudaDevice(0), memory.data() + 3, DataType::kFloat32,
                    TensorShape::Of({10, 7}), [&released] { released.fetch_add(1); });
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->data(), memory.data() + 3);  // not aligned, and not copied
    EXPECT_EQ(t->TotalBytes(), 280u);
    EXPECT_EQ(t->placement(), MemoryPlacement::CudaDevice(0));
    EXPECT_EQ(t->allocator()->Name(), "adopted cuda:0 memory");
    Tensor copy = *t;
    std::thread other([moved = std::move(copy)]() mutable { moved.Clear(); });
    other.join();
    EXPECT_EQ(released.load(), 0);  // `t` still refers to it
  }
  EXPECT_EQ(released.load(), 1);
}

TEST(AdoptMemory, EveryRefusalStillReleasesOnceAndSaysWhy) {
  char byte = 0;
  int released = 0;
  auto release = [&released] { ++released; };
  absl::StatusOr<Tensor> t = AdoptMemory(MemoryPlacement::CudaDevice(0), &byte, DataType::kString,
                                         TensorShape::Of({1}), release);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("string tensors"), std::string::npos) << t.status();
  t = AdoptMemory(MemoryPlacement::CudaDevice(0), nullptr, DataType::kInt8, TensorShape::Of({1}),
                  release);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("null pointer"), std::string::npos) << t.status();
  EXPECT_EQ(released, 2);
}

TEST(AdoptMemory, HostMemoryIsAdoptedTheSameWay) {
  std::vector<float> memory(6, 1.5f);
  int released = 0;
  {
    absl::StatusOr<Tensor> t =
        AdoptMemory(MemoryPlacement::Host(), memory.data(), DataType::kFloat32,
                    TensorShape::Of({2, 3}), [&released] { ++released; });
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->data(), memory.data());
    EXPECT_TRUE(t->placement().host_accessible());
    EXPECT_EQ(t->allocator()->Name(), "adopted host memory");
    EXPECT_EQ(t->flat<float>()[5], 1.5f);  // the caller's bytes, not a copy
    EXPECT_EQ(released, 0);
  }
  EXPECT_EQ(released, 1);
}

TEST(AdoptMemory, AnEmptyTensorHoldsNoMemoryAndReleasesAtOnce) {
  int released = 0;
  absl::StatusOr<Tensor> t =
      AdoptMemory(MemoryPlacement::CudaDevice(0), nullptr, DataType::kFloat32,
                  TensorShape::Of({0, 4}), [&released] { ++released; });
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(released, 1);
  EXPECT_EQ(t->TotalBytes(), 0u);
  EXPECT_EQ(t->shape(), TensorShape::Of({0, 4}));
}

}  // namespace
}  // namespace tensorverbs
