#include "src/device/adopted_memory.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace tensorverbs::device {
namespace {

TEST(AdoptDeviceMemory, TheTensorViewsTheMemoryAndReleasesItOnceWithTheLastReference) {
  std::vector<char> memory(1000);  // stands in for a GPU's: adopting never touches the bytes
  std::atomic<int> released{0};
  {
    absl::StatusOr<Tensor> t =
        AdoptDeviceMemory(MemoryPlacement::CudaDevice(0), memory.data() + 3, DataType::kFloat32,
                          TensorShape::Of({10, 7}), [&released] { released.fetch_add(1); });
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->data(), memory.data() + 3);  // not aligned, and not copied
    EXPECT_EQ(t->TotalBytes(), 280u);
    EXPECT_EQ(t->placement(), MemoryPlacement::CudaDevice(0));
    EXPECT_EQ(t->allocator()->Name(), "adopted cuda:0 memory");
    Tensor copy = *t;
    std::thread other([moved = std::move(copy)]() mutable { moved = Tensor(); });
    other.join();
    EXPECT_EQ(released.load(), 0);  // `t` still refers to it
  }
  EXPECT_EQ(released.load(), 1);
}

TEST(AdoptDeviceMemory, EveryRefusalStillReleasesOnceAndSaysWhy) {
  char byte = 0;
  int released = 0;
  auto release = [&released] { ++released; };
  absl::StatusOr<Tensor> t = AdoptDeviceMemory(MemoryPlacement::CudaDevice(0), &byte,
                                               DataType::kString, TensorShape::Of({1}), release);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("host memory only"), std::string::npos) << t.status();
  t = AdoptDeviceMemory(MemoryPlacement::Host(), &byte, DataType::kInt8, TensorShape::Of({1}),
                        release);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  t = AdoptDeviceMemory(MemoryPlacement::CudaDevice(0), nullptr, DataType::kInt8,
                        TensorShape::Of({1}), release);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("null pointer"), std::string::npos) << t.status();
  EXPECT_EQ(released, 3);
}

TEST(AdoptDeviceMemory, AnEmptyTensorHoldsNoMemoryAndReleasesAtOnce) {
  int released = 0;
  absl::StatusOr<Tensor> t =
      AdoptDeviceMemory(MemoryPlacement::CudaDevice(0), nullptr, DataType::kFloat32,
                        TensorShape::Of({0, 4}), [&released] { ++released; });
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(released, 1);
  EXPECT_EQ(t->TotalBytes(), 0u);
  EXPECT_EQ(t->shape(), TensorShape::Of({0, 4}));
}

}  // namespace
}  // namespace tensorverbs::device
