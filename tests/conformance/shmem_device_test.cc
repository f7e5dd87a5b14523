// The same-host fabric with GPU memory (a stand-in runtime whose "device memory" is host memory):
// device copies in every direction, their order against immediates and host writes, failed
// copies, and the bounce buffer that carries device memory to a peer's private memory.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "absl/time/clock.h"
#include "src/fabric/fabric.h"
#include "tests/conformance/shmem_fixture.h"
#include "tests/support/stand_in_device_memory.h"

namespace tensorverbs::fabric {
namespace {

using shmem_testing::ShmemFabricTest;
using ::testing::HasSubstr;

// Two domains with a GPU runtime (a stand-in: its "device memory" is host memory), each with a
// region of it.
class ShmemDeviceTest : public ShmemFabricTest {
 protected:
  void SetUp() override {
    dm_ = std::make_shared<testing::StandInDeviceMemory>();
    DomainOptions options;
    options.device_memory = dm_;
    ASSERT_NO_FATAL_FAILURE(Open(options));
    gpu_a_.assign(1 << 20, 0);
    gpu_b_.assign(1 << 20, 0);
    gpu_a_mr_ = *a_->RegisterDeviceMemory(gpu_a_.data(), gpu_a_.size(), 0, kAccessLocal);
    gpu_b_mr_ = *b_->RegisterDeviceMemory(gpu_b_.data(), gpu_b_.size(), 0,
                                          kAccessRemoteWrite | kAccessRemoteRead);
  }
  void TearDown() override {
    // Endpoints first: they finish their copies into the buffers.
    ea_.reset();
    eb_.reset();
  }
  LocalBuffer OnGpuA(size_t offset, size_t n) {
    return LocalBuffer{gpu_a_mr_.get(), gpu_a_.data() + offset, n};
  }

  std::shared_ptr<testing::StandInDeviceMemory> dm_;
  std::vector<char> gpu_a_, gpu_b_;
  std::unique_ptr<MemoryRegion> gpu_a_mr_, gpu_b_mr_;
};

TEST_F(ShmemDeviceTest, DeviceMemoryMovesByDeviceCopiesInEveryDirection) {
  EXPECT_TRUE(a_->capabilities().device_memory);
  auto host_b = *b_->RegisterMemory(dst_->data(), dst_->size(), kAccessRemoteWrite);
  std::memset(src_->data(), 0x11, 4096);
  std::memset(gpu_a_.data(), 0x22, 8192);
  shmem::CopyCounters& c = shmem::Counters();
  const uint64_t mapped = c.mapped_bytes.load(), device_ops = c.device_ops.load();
  // Host to device, device to device (twice, one import), device to host.
  ASSERT_TRUE(ea_->PostWriteWithImm(Local(4096), Remote(*gpu_b_mr_), 1, 1).ok());
  RemoteBuffer second = Remote(*gpu_b_mr_);
  second.addr += 65536;
  ASSERT_TRUE(ea_->PostWriteWithImm(OnGpuA(0, 8192), second, 2, 2).ok());
  ASSERT_TRUE(ea_->PostWriteWithImm(OnGpuA(0, 100), Remote(*gpu_b_mr_), 3, 3).ok());
  ASSERT_TRUE(ea_->PostWriteWithImm(OnGpuA(4096, 4096), Remote(*host_b), 4, 4).ok());
  std::vector<Completion> done = PollFor(*a_, 4);
  ASSERT_EQ(done.size(), 4u);
  for (const Completion& d : done) EXPECT_TRUE(d.status.ok()) << d.status;
  std::vector<Completion> arrived = PollFor(*b_, 4);
  ASSERT_EQ(arrived.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(arrived[i].imm, static_cast<uint32_t>(i + 1));
  EXPECT_EQ(gpu_b_[0], 0x22) << "the third write landed after the first";
  EXPECT_EQ(gpu_b_[100], 0x11);
  EXPECT_EQ(gpu_b_[4095], 0x11);
  EXPECT_EQ(gpu_b_[65536 + 8191], 0x22);
  EXPECT_EQ(static_cast<char*>(dst_->data())[4095], 0x22);
  EXPECT_EQ(dm_->host_to_device(), 1);
  EXPECT_EQ(dm_->device_to_device(), 2);
  EXPECT_EQ(dm_->device_to_host(), 1);
  EXPECT_EQ(dm_->exports(), 2) << "each device region once, at registration";
  EXPECT_EQ(dm_->imports(), 1) << "the peer's region once, on first use";
  EXPECT_EQ(dm_->host_registrations(), 1) << "the peer's host region page-locked once";
  EXPECT_EQ(c.device_ops.load() - device_ops, 4u);
  EXPECT_EQ(c.mapped_bytes.load(), mapped) << "no CPU copy";
  // A read of device memory too.
  ASSERT_TRUE(ea_->PostRead(Local(16), Remote(*gpu_b_mr_), 5).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectOneOk(*a_));
  EXPECT_EQ(static_cast<char*>(src_->data())[0], 0x22);
  ea_.reset();
  EXPECT_EQ(dm_->closes(), 1) << "the import is closed with the endpoint";
  EXPECT_EQ(dm_->host_unregistrations(), 1);
}

TEST_F(ShmemDeviceTest, AnImmediateWaitsForTheDeviceCopiesPostedBeforeIt) {
  dm_->set_held(true);
  std::memset(gpu_a_.data(), 0x33, 4096);
  auto host_b = *b_->RegisterMemory(dst_->data(), dst_->size(), kAccessRemoteWrite);
  // A slow device write without an immediate, then a host write with one: the immediate may
  // only arrive once the device bytes are there.
  ASSERT_TRUE(ea_->PostWrite(OnGpuA(0, 4096), Remote(*gpu_b_mr_), 1).ok());
  ASSERT_TRUE(ea_->PostWriteWithImm(Local(0), Remote(*host_b), 7, 2).ok());
  // The writer polls while its device copy runs: the host write waits behind it.
  EXPECT_TRUE(PollFor(*a_, 1, absl::Milliseconds(5)).empty());
  EXPECT_TRUE(PollFor(*b_, 1, absl::Milliseconds(5)).empty()) << "an immediate before its data";
  dm_->set_held(false);
  EXPECT_EQ(PollFor(*a_, 2).size(), 2u);
  EXPECT_EQ(gpu_b_[4095], 0x33);
  std::vector<Completion> arrived = PollFor(*b_, 1);
  ASSERT_EQ(arrived.size(), 1u);
  EXPECT_EQ(arrived[0].imm, 7u);
}

TEST_F(ShmemDeviceTest, DeviceCopiesStartPastAStuckHostWriteAndStillCompleteAfterIt) {
  auto host_b = *b_->RegisterMemory(dst_->data(), dst_->size(), kAccessRemoteWrite);
  // b does not poll: its ring fills, and the next write with an immediate waits in a's queue.
  const size_t depth = a_->capabilities().queue_depth;
  for (size_t i = 0; i < depth; ++i) {
    ASSERT_TRUE(ea_->PostWriteWithImm(Local(8), Remote(*host_b), 0, i).ok());
  }
  ASSERT_EQ(PollFor(*a_, depth).size(), depth);
  ASSERT_TRUE(ea_->PostWriteWithImm(Local(8), Remote(*host_b), 1, 100).ok());
  std::memset(gpu_a_.data(), 0x44, 4096);
  ASSERT_TRUE(ea_->PostWriteWithImm(OnGpuA(0, 4096), Remote(*gpu_b_mr_), 2, 101).ok());
  // The device copy starts at once; neither write completes before the stuck one.
  EXPECT_TRUE(PollFor(*a_, 1, absl::Milliseconds(20)).empty());
  EXPECT_EQ(dm_->device_to_device(), 1);
  EXPECT_EQ(ea_->Outstanding(), 2u);
  // b drains its ring: the host write goes, then the device write completes, in order.
  EXPECT_EQ(PollFor(*b_, depth).size(), depth);
  std::vector<Completion> done = PollFor(*a_, 2);
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[0].context, 100u);
  EXPECT_EQ(done[1].context, 101u);
  std::vector<Completion> arrived = PollFor(*b_, 2);
  ASSERT_EQ(arrived.size(), 2u);
  EXPECT_EQ(arrived[0].imm, 1u);
  EXPECT_EQ(arrived[1].imm, 2u);
  EXPECT_EQ(gpu_b_[4095], 0x44);
}

TEST_F(ShmemDeviceTest, AFailedDeviceCopyFailsItsWriteAloneAndPublishesNothing) {
  dm_->FailNextCopy(absl::InternalError("stand-in DMA failure"));
  ASSERT_TRUE(ea_->PostWriteWithImm(OnGpuA(0, 64), Remote(*gpu_b_mr_), 1, 1).ok());
  std::vector<Completion> done = PollFor(*a_, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].status.code(), absl::StatusCode::kInternal) << done[0].status;
  EXPECT_THAT(std::string(done[0].status.message()),
              AllOf(HasSubstr("device write of 64 bytes"), HasSubstr("stand-in DMA failure")));
  EXPECT_TRUE(PollFor(*b_, 1, absl::Milliseconds(100)).empty());
  ASSERT_TRUE(ea_->PostWriteWithImm(OnGpuA(0, 64), Remote(*gpu_b_mr_), 2, 2).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectOneOk(*a_));
  std::vector<Completion> arrived = PollFor(*b_, 1);
  ASSERT_EQ(arrived.size(), 1u);
  EXPECT_EQ(arrived[0].imm, 2u);
}

TEST_F(ShmemDeviceTest, DeviceMemoryReachesAPeersPrivateMemoryThroughABounceBuffer) {
  // The peer's private memory is reached by the kernel's copy, which cannot reach a GPU: the
  // bytes go through the endpoint's bounce buffer, one operation at a time, in order.
  std::vector<char> priv(3 << 20, 0);
  auto private_mr =
      *b_->RegisterMemory(priv.data(), priv.size(), kAccessRemoteWrite | kAccessRemoteRead);
  for (size_t i = 0; i < (1 << 20); ++i) gpu_a_[i] = static_cast<char>(i * 7 + 1);
  shmem::CopyCounters& c = shmem::Counters();
  const uint64_t bounced = c.device_bounced_ops.load(), cross = c.cross_memory_bytes.load();
  RemoteBuffer second = Remote(*private_mr);
  second.addr += 2 << 20;
  // A small write, then one larger than the buffer so far (it grows), posted together.
  ASSERT_TRUE(ea_->PostWriteWithImm(OnGpuA(0, 64), Remote(*private_mr), 1, 1).ok());
  ASSERT_TRUE(ea_->PostWriteWithImm(OnGpuA(0, 1 << 20), second, 2, 2).ok());
  std::vector<Completion> done = PollFor(*a_, 2);
  ASSERT_EQ(done.size(), 2u);
  for (const Completion& d : done) EXPECT_TRUE(d.status.ok()) << d.status;
  std::vector<Completion> arrived = PollFor(*b_, 2);
  ASSERT_EQ(arrived.size(), 2u);
  EXPECT_EQ(arrived[0].imm, 1u);
  EXPECT_EQ(arrived[1].imm, 2u);
  EXPECT_EQ(std::memcmp(priv.data(), gpu_a_.data(), 64), 0);
  EXPECT_EQ(std::memcmp(priv.data() + (2 << 20), gpu_a_.data(), 1 << 20), 0);
  // And a read of the peer's private memory into GPU memory.
  std::memset(priv.data() + 4096, 0x5D, 4096);
  ASSERT_TRUE(ea_->PostRead(OnGpuA(8192, 4096),
                            RemoteBuffer{private_mr->PackRemoteKey(),
                                         reinterpret_cast<uint64_t>(priv.data() + 4096), 4096},
                            3)
                  .ok());
  ASSERT_NO_FATAL_FAILURE(ExpectOneOk(*a_));
  EXPECT_EQ(gpu_a_[8192], 0x5D);
  EXPECT_EQ(gpu_a_[8192 + 4095], 0x5D);
  EXPECT_EQ(c.device_bounced_ops.load() - bounced, 3u);
  EXPECT_EQ(c.cross_memory_bytes.load() - cross, 64u + (1 << 20) + 4096);
  EXPECT_EQ(dm_->device_to_host(), 2);
  EXPECT_EQ(dm_->host_to_device(), 1);
  ea_.reset();
  EXPECT_EQ(dm_->host_unregistrations(), dm_->host_registrations())
      << "the bounce buffer is unpinned with its endpoint";
}

TEST_F(ShmemDeviceTest, ABouncedOperationLargerThanTheBufferMovesInChunks) {
  const size_t n = (size_t{20} << 20) + 333;  // two full chunks and a part
  std::vector<char> gpu(n), priv(n, 0);
  for (size_t i = 0; i < n; ++i) gpu[i] = static_cast<char>(i * 13 + (i >> 20));
  auto gpu_mr = *a_->RegisterDeviceMemory(gpu.data(), n, 0, kAccessLocal);
  auto private_mr = *b_->RegisterMemory(priv.data(), n, kAccessRemoteWrite | kAccessRemoteRead);
  const int64_t d2h = dm_->device_to_host(), h2d = dm_->host_to_device();
  ASSERT_TRUE(ea_->PostWriteWithImm({gpu_mr.get(), gpu.data(), n}, Remote(*private_mr), 4, 1).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectWriteLanded(n));
  EXPECT_EQ(std::memcmp(priv.data(), gpu.data(), n), 0);
  EXPECT_EQ(dm_->device_to_host() - d2h, 3) << "three chunks of at most 8 MiB";
  // And back into the GPU buffer, cleared first.
  std::memset(gpu.data(), 0, n);
  ASSERT_TRUE(ea_->PostRead({gpu_mr.get(), gpu.data(), n}, Remote(*private_mr), 2).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectOneOk(*a_));
  EXPECT_EQ(std::memcmp(priv.data(), gpu.data(), n), 0);
  EXPECT_EQ(dm_->host_to_device() - h2d, 3);
  ea_.reset();  // finishes with the buffers above still alive
}

TEST_F(ShmemDeviceTest, AFailedBouncedCopyWritesNothingToThePeerAndFreesTheBuffer) {
  std::vector<char> priv(8192, 0x11);
  auto private_mr = *b_->RegisterMemory(priv.data(), priv.size(), kAccessRemoteWrite);
  std::memset(gpu_a_.data(), 0x66, 4096);
  dm_->FailNextCopy(absl::InternalError("stand-in DMA failure"));
  ASSERT_TRUE(ea_->PostWriteWithImm(OnGpuA(0, 4096), Remote(*private_mr), 1, 1).ok());
  std::vector<Completion> done = PollFor(*a_, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].status.code(), absl::StatusCode::kInternal) << done[0].status;
  EXPECT_EQ(priv[0], 0x11) << "the bounce buffer's stale bytes reached the peer";
  EXPECT_TRUE(PollFor(*b_, 1, absl::Milliseconds(50)).empty()) << "no immediate either";
  // The buffer is free again: the next bounced write goes through.
  ASSERT_TRUE(ea_->PostWriteWithImm(OnGpuA(0, 4096), Remote(*private_mr), 2, 2).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectOneOk(*a_));
  EXPECT_EQ(priv[4095], 0x66);
  ASSERT_EQ(PollFor(*b_, 1).size(), 1u);
}

TEST_F(ShmemDeviceTest, DeviceMemoryReachesNoPeerWithoutARuntime) {
  std::vector<Completion> done;
  // A domain without a runtime registers no device memory and cannot write a peer's.
  auto plain = *OpenDomain("shmem", DomainOptions());
  EXPECT_FALSE(plain->capabilities().device_memory);
  EXPECT_EQ(plain->RegisterDeviceMemory(gpu_a_.data(), 4096, 0, kAccessLocal).status().code(),
            absl::StatusCode::kUnimplemented);
  auto ep = *plain->CreateEndpoint();
  auto peer = *b_->CreateEndpoint();
  ASSERT_TRUE(ep->Connect(peer->LocalAddress()).ok());
  ASSERT_TRUE(peer->Connect(ep->LocalAddress()).ok());
  std::vector<char> host(64);
  auto host_mr = *plain->RegisterMemory(host.data(), host.size(), kAccessLocal);
  ASSERT_TRUE(ep->PostWrite({host_mr.get(), host.data(), 64}, Remote(*gpu_b_mr_), 2).ok());
  done = PollFor(*plain, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].status.code(), absl::StatusCode::kFailedPrecondition) << done[0].status;
  EXPECT_THAT(std::string(done[0].status.message()), HasSubstr("no GPU runtime"));
  // An export the runtime refuses is a registration error.
  dm_->set_fail_exports(true);
  absl::StatusOr<std::unique_ptr<MemoryRegion>> refused =
      a_->RegisterDeviceMemory(gpu_a_.data(), 4096, 0, kAccessLocal);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("cuda:0"));
}

}  // namespace
}  // namespace tensorverbs::fabric
