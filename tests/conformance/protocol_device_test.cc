// The protocol conformance suite (protocol_fixture.h) with GPU tensors on stand-in GPUs: the proxy
// path through host memory on every protocol, and the direct path of grpc+verbs over the
// same-host fabric.
#include "tests/conformance/protocol_fixture.h"

namespace tensorverbs::protocol_conformance {

namespace {

// A tensor of `dtype` and `dims` in (stand-in) device memory of `device`, with the pattern of
// `seed`; `host` gets the same bytes in host memory to compare against.
Tensor DeviceTensor(testing::StandInDeviceAllocator& device, DataType dtype,
                    std::vector<int64_t> dims, uint32_t seed, Tensor* host) {
  *host = *Tensor::Allocate(CpuAllocator(), dtype, *TensorShape::Create(dims));
  testing::FillPattern(*host, seed);
  Tensor t = *Tensor::Allocate(&device, dtype, host->shape());
  // The stand-in's memory is host memory: the test may write it, the transports may not.
  if (host->TotalBytes() > 0) std::memcpy(t.data(), host->data(), host->TotalBytes());
  return t;
}

// Bytes of a (stand-in) device tensor equal `host`'s.
bool SameBytes(const Tensor& device, const Tensor& host) {
  return device.dtype() == host.dtype() && device.shape() == host.shape() &&
         (host.TotalBytes() == 0 ||
          std::memcmp(device.data(), host.data(), host.TotalBytes()) == 0);
}

}  // namespace

void ProtocolTest::DeviceRecv(int64_t step, const std::string& name, const Tensor& sent,
                              const Tensor& host, const RecvArgs& args, int64_t* transfers) {
  ASSERT_TRUE(Step(1, step)->Send(Key(1, name), sent).ok()) << name;
  PendingRecv recv(*Step(0, step), Key(1, name), args);
  ASSERT_TRUE(recv.Wait()) << name;
  ASSERT_TRUE(recv.status().ok()) << name << ": " << recv.status();
  EXPECT_TRUE(SameBytes(recv.tensor(), host)) << name;
  EXPECT_EQ(recv.calls(), 1);
  // An empty tensor has no memory, so no placement and nothing to copy.
  if (host.TotalBytes() > 0) {
    EXPECT_EQ(recv.tensor().placement(), MemoryPlacement::CudaDevice(0)) << name;
    ++*transfers;
  }
}

namespace {

TEST_P(ProtocolTest, DeviceTensorsTakeTheProxyPathWithOneCopyEachWay) {
  testing::StandInDeviceCopier& copier = UseStandInGpus(2);
  testing::StandInDeviceAllocator& gpu0 = StandInGpu(0);
  testing::StandInDeviceAllocator& gpu1 = StandInGpu(1);
  StartCluster(2);
  RecvArgs to_gpu0;
  to_gpu0.allocator = &gpu0;
  int64_t step = 1, transfers = 0;
  uint32_t seed = 1;
  // Every dtype but strings, empty to 4 MiB, device to device: one device-to-host copy on the
  // sender, one host-to-device copy on the receiver, and the bytes arrive exactly.
  for (DataType dtype : AllDataTypes()) {
    if (dtype == DataType::kString) continue;
    for (std::vector<int64_t> dims : {std::vector<int64_t>{0}, {1}, {3, 5}, {1 << 20}}) {
      if (dims[0] == (1 << 20)) {
        // One large tensor per element size; under TSan only where the design moves large
        // tensors there in time (as EveryFixtureArrivesIntact's big fixture).
        if (DataTypeSize(dtype) != 4) continue;
        if (kUnderThreadSanitizer && !design().big_fixture_under_tsan) continue;
      }
      Tensor host;
      Tensor sent = DeviceTensor(gpu1, dtype, dims, seed++, &host);
      const std::string name = absl::StrCat(DataTypeName(dtype), "_", dims.size(), "_", dims[0]);
      ASSERT_NO_FATAL_FAILURE(DeviceRecv(step++, name, sent, host, to_gpu0, &transfers));
    }
  }
  EXPECT_EQ(copier.device_to_host(), transfers);
  EXPECT_EQ(copier.host_to_device(), transfers);
  EXPECT_EQ(server(1).stats().device_to_host.load(), transfers) << "staged on the sender";
  EXPECT_EQ(server(0).stats().host_to_device.load(), transfers) << "proxied on the receiver";
  EXPECT_EQ(server(1).stats().host_to_device.load(), 0);
  EXPECT_EQ(server(0).stats().device_to_host.load(), 0);
  EXPECT_GT(server(0).stats().tensors.load(), transfers);

  // Host to device: only the receiver copies. Device to host: only the sender.
  const int64_t d2h = copier.device_to_host(), h2d = copier.host_to_device();
  Tensor from_pool = PoolTensor(1, DataType::kFloat32, {1000}, 77);
  ASSERT_TRUE(Step(1, step)->Send(Key(1, "host_to_gpu"), from_pool).ok());
  PendingRecv into_gpu(*Step(0, step), Key(1, "host_to_gpu"), to_gpu0);
  ASSERT_TRUE(into_gpu.Wait());
  ASSERT_TRUE(into_gpu.status().ok()) << into_gpu.status();
  EXPECT_TRUE(SameBytes(into_gpu.tensor(), from_pool));
  EXPECT_EQ(copier.device_to_host(), d2h);
  EXPECT_EQ(copier.host_to_device(), h2d + 1);
  Tensor host;
  Tensor on_gpu1 = DeviceTensor(gpu1, DataType::kInt64, {333}, 78, &host);
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(step + 1, "gpu_to_host", host));  // the channel's warm
  ASSERT_TRUE(Step(1, step + 2)->Send(Key(1, "gpu_to_host"), on_gpu1).ok());
  PendingRecv into_host(*Step(0, step + 2), Key(1, "gpu_to_host"));
  ASSERT_TRUE(into_host.Wait());
  ASSERT_TRUE(into_host.status().ok()) << into_host.status();
  EXPECT_TRUE(into_host.tensor().placement().host_accessible());
  EXPECT_TRUE(into_host.tensor().ContentEquals(host));
  EXPECT_EQ(copier.device_to_host(), d2h + 1);
  EXPECT_EQ(copier.host_to_device(), h2d + 1);
  // Within the task a device tensor is handed over as it is, with no copy at all.
  ASSERT_TRUE(Step(1, step + 3)->Send(Key(1, "local", 1), on_gpu1).ok());
  PendingRecv local(*Step(1, step + 3), Key(1, "local", 1));
  ASSERT_TRUE(local.Wait());
  EXPECT_TRUE(local.tensor().SharesBufferWith(on_gpu1));
  EXPECT_EQ(copier.device_to_host(), d2h + 1);
}

TEST_P(ProtocolTest, ALargeDeviceTensorOnTheProxyPathGoesToTheDeviceInChunksAsItLands) {
  testing::StandInDeviceCopier& copier = UseStandInGpus(2);
  testing::StandInDeviceAllocator& gpu0 = StandInGpu(0);
  testing::StandInDeviceAllocator& gpu1 = StandInGpu(1);
  constexpr uint64_t kChunk = 64 << 10;
  StartCluster(2, [](ServerOptions& o) { o.proxy_chunk_bytes = kChunk; });
  RecvArgs to_gpu0;
  to_gpu0.allocator = &gpu0;
  // Not a whole number of chunks: the last one is short.
  constexpr int64_t kFloats = (1 << 18) + 1000;
  constexpr uint64_t kBytes = kFloats * 4;
  constexpr uint64_t kChunks = (kBytes + kChunk - 1) / kChunk;
  int64_t transfers = 0;
  // The first step asks for the meta-data, the later ones name the destination at once.
  for (int64_t step = 1; step <= 3; ++step) {
    Tensor host;
    Tensor sent =
        DeviceTensor(gpu1, DataType::kFloat32, {kFloats}, static_cast<uint32_t>(step), &host);
    ASSERT_NO_FATAL_FAILURE(DeviceRecv(step, "big", sent, host, to_gpu0, &transfers));
  }
  EXPECT_EQ(server(0).stats().host_to_device.load(), transfers)
      << "one host-to-device copy of each tensor, however many parts it went in";
  EXPECT_EQ(server(0).stats().device_copied_bytes.load(), transfers * static_cast<int64_t>(kBytes));
  EXPECT_EQ(server(1).stats().device_to_host.load(), transfers)
      << "one device-to-host copy of each tensor, however many parts it went in";
  // grpc+verbs writes into the receiver's proxy and can say which part landed: each chunk but
  // the last is an immediate of its own, and its copy may start at once (parts that landed
  // before the last copy started go in one copy). Other protocols land it whole.
  const bool in_segments = design().content_by_write && !design().frames_content;
  if (in_segments) {
    EXPECT_EQ(verbs_stats(0).content_segments.load(),
              transfers * static_cast<int64_t>(kChunks - 1));
    EXPECT_GE(copier.host_to_device(), transfers);
    EXPECT_LE(copier.host_to_device(), transfers * static_cast<int64_t>(kChunks));
    // The sender stages it in chunks too, and writes each as its copy completes.
    EXPECT_EQ(copier.device_to_host(), transfers * static_cast<int64_t>(kChunks));
  } else {
    EXPECT_EQ(verbs_stats(0).content_segments.load(), 0);
    EXPECT_EQ(copier.host_to_device(), transfers);
    EXPECT_EQ(copier.device_to_host(), transfers);
  }
  EXPECT_EQ(server(0).stats().device_copy_errors.load(), 0);
  EXPECT_EQ(verbs_stats(0).channel_errors.load(), 0);

  // The next copy in `direction` fails; the recv of `name` in `step` then fails once with its
  // error, naming the key (and `device`, if given).
  auto recv_failing = [&](CopyDirection direction, int64_t step, const std::string& name,
                          const Tensor& sent, const std::string& device,
                          std::unique_ptr<PendingRecv>* recv) {
    copier.FailNext(direction,
                    absl::InternalError("CUDA cudaMemcpyAsync failed: stand-in failure"));
    ASSERT_TRUE(Step(1, step)->Send(Key(1, name), sent).ok());
    *recv = std::make_unique<PendingRecv>(*Step(0, step), Key(1, name), to_gpu0);
    ASSERT_TRUE((*recv)->Wait());
    EXPECT_EQ((*recv)->status().code(), absl::StatusCode::kInternal) << (*recv)->status();
    EXPECT_THAT(std::string((*recv)->status().message()), HasSubstr(name));
    if (!device.empty()) {
      EXPECT_THAT(std::string((*recv)->status().message()),
                  HasSubstr("stand-in failure on " + device));
    }
    EXPECT_EQ((*recv)->calls(), 1);
  };
  // One part's copy fails: the recv fails once, naming the key and the part, and the next
  // tensor arrives whole on the same channel.
  Tensor host;
  Tensor sent = DeviceTensor(gpu1, DataType::kFloat32, {kFloats}, 40, &host);
  std::unique_ptr<PendingRecv> fails;
  ASSERT_NO_FATAL_FAILURE(
      recv_failing(CopyDirection::kHostToDevice, 4, "big", sent, "cuda:0", &fails));
  EXPECT_FALSE(fails->tensor().IsInitialized());
  EXPECT_EQ(server(0).stats().device_copy_errors.load(), 1);
  EXPECT_EQ(server(0).stats().host_to_device.load(), transfers) << "a failed recv counts no copy";
  // One part's device-to-host copy fails on the sender: the recv fails once with its error.
  // Parts staged before it may have been written; none after it is.
  Tensor unstaged = DeviceTensor(gpu1, DataType::kFloat32, {kFloats}, 42, &host);
  std::unique_ptr<PendingRecv> staging_fails;
  ASSERT_NO_FATAL_FAILURE(
      recv_failing(CopyDirection::kDeviceToHost, 5, "big", unstaged, "cuda:1", &staging_fails));
  // The same for a key the receiver has not received before: the failure may come before or
  // after its RE_REQUEST, and either way ends only that recv.
  std::unique_ptr<PendingRecv> fresh_fails;
  ASSERT_NO_FATAL_FAILURE(
      recv_failing(CopyDirection::kDeviceToHost, 5, "fresh", unstaged, "", &fresh_fails));
  EXPECT_EQ(server(1).stats().device_copy_errors.load(), 2);
  // (The tensor whose host-to-device copy failed was staged whole.)
  EXPECT_EQ(server(1).stats().device_to_host.load(), transfers + 1)
      << "a failed staging counts none";
  Tensor later = DeviceTensor(gpu1, DataType::kFloat32, {kFloats}, 41, &host);
  ASSERT_NO_FATAL_FAILURE(DeviceRecv(6, "big", later, host, to_gpu0, &transfers));
  EXPECT_EQ(verbs_stats(0).channel_errors.load(), 0);
  EXPECT_EQ(verbs_stats(1).channel_errors.load(), 0);
}

TEST_P(ProtocolTest, TheSenderWritesAStagedChunkWhileTheNextAreStillOnTheirWayToHostMemory) {
  if (!design().content_by_write || design().frames_content) {
    GTEST_SKIP() << "only grpc+verbs writes a tensor in parts";
  }
  testing::StandInDeviceCopier& copier = UseStandInGpus(2);
  testing::StandInDeviceAllocator& gpu0 = StandInGpu(0);
  testing::StandInDeviceAllocator& gpu1 = StandInGpu(1);
  constexpr uint64_t kChunk = 64 << 10;
  constexpr int64_t kFloats = 16 * kChunk / 4;
  StartCluster(2, [](ServerOptions& o) { o.proxy_chunk_bytes = kChunk; });
  RecvArgs to_gpu0;
  to_gpu0.allocator = &gpu0;
  auto within = [](const std::function<bool()>& condition) {
    for (int i = 0; i < 10000 && !condition(); ++i) absl::SleepFor(absl::Milliseconds(1));
    return condition();
  };
  copier.Hold(CopyDirection::kDeviceToHost);
  Tensor host;
  Tensor sent = DeviceTensor(gpu1, DataType::kFloat32, {kFloats}, 9, &host);
  ASSERT_TRUE(Step(1, 1)->Send(Key(1, "big"), sent).ok());
  PendingRecv recv(*Step(0, 1), Key(1, "big"), to_gpu0);
  ASSERT_TRUE(within([&] { return copier.held() == 16; })) << copier.held() << " chunks queued";
  // Two chunks reach host memory; the other fourteen wait. The receiver sees the first two
  // land (each its own segment) and copies them on to its device meanwhile.
  copier.ReleaseHeld(2);
  ASSERT_TRUE(within([&] { return verbs_stats(0).content_segments.load() == 2; }))
      << verbs_stats(0).content_segments.load() << " segments landed";
  EXPECT_TRUE(within([&] { return copier.host_to_device() >= 1; }))
      << "a landed part goes to the device before the rest is even staged";
  EXPECT_EQ(copier.held(), 14u);
  EXPECT_EQ(recv.calls(), 0);
  copier.ReleaseHeld(-1);
  ASSERT_TRUE(recv.Wait());
  ASSERT_TRUE(recv.status().ok()) << recv.status();
  EXPECT_TRUE(SameBytes(recv.tensor(), host));
  EXPECT_EQ(verbs_stats(0).content_segments.load(), 15);
  EXPECT_EQ(server(1).stats().device_to_host.load(), 1);
  EXPECT_EQ(server(0).stats().host_to_device.load(), 1);
}

TEST_P(ProtocolTest, UnderCopyRegistrationALargeDeviceTensorIsStagedWholeAndArrivesExactly) {
  // A sender that copies its sources into registered staging (copy registration; per-transfer
  // when a registration fails) must not copy a staging tensor whose chunks are still on their
  // way: it stages the device tensor whole, as before chunks.
  testing::StandInDeviceCopier& copier = UseStandInGpus(2);
  testing::StandInDeviceAllocator& gpu0 = StandInGpu(0);
  testing::StandInDeviceAllocator& gpu1 = StandInGpu(1);
  constexpr uint64_t kChunk = 64 << 10;
  StartCluster(2, [](ServerOptions& o) {
    o.proxy_chunk_bytes = kChunk;
    o.verbs.channel.registration = protocol::Registration::kCopy;
  });
  RecvArgs to_gpu0;
  to_gpu0.allocator = &gpu0;
  int64_t transfers = 0;
  for (int64_t step = 1; step <= 2; ++step) {
    Tensor host;
    Tensor sent = DeviceTensor(gpu1, DataType::kFloat32, {int64_t{8} * kChunk / 4},
                               static_cast<uint32_t>(step), &host);
    ASSERT_NO_FATAL_FAILURE(DeviceRecv(step, "big", sent, host, to_gpu0, &transfers));
  }
  EXPECT_EQ(copier.device_to_host(), transfers) << "one whole copy per tensor";
  EXPECT_EQ(server(1).stats().device_to_host.load(), transfers);
}

TEST_P(ProtocolTest, DeviceCopyFailuresAndMisuseFailTheirRecvOnceWithTheReason) {
  testing::StandInDeviceCopier& copier = UseStandInGpus(1);
  testing::StandInDeviceAllocator& gpu0 = StandInGpu(0);
  StartCluster(2);
  RecvArgs to_gpu0;
  to_gpu0.allocator = &gpu0;
  Tensor host;
  // The sender's device-to-host copy fails: the receiver gets its error, naming the key.
  copier.FailNext(CopyDirection::kDeviceToHost,
                  absl::InternalError("CUDA cudaMemcpyAsync failed: stand-in failure"));
  Tensor sent = DeviceTensor(gpu0, DataType::kFloat32, {256}, 5, &host);
  ASSERT_TRUE(Step(1, 1)->Send(Key(1, "d2h_fails"), sent).ok());
  PendingRecv d2h_fails(*Step(0, 1), Key(1, "d2h_fails"), to_gpu0);
  ASSERT_TRUE(d2h_fails.Wait());
  EXPECT_EQ(d2h_fails.status().code(), absl::StatusCode::kInternal) << d2h_fails.status();
  EXPECT_THAT(std::string(d2h_fails.status().message()),
              AllOf(HasSubstr("stand-in failure on cuda:0"), HasSubstr("d2h_fails")));
  // The receiver's host-to-device copy fails.
  copier.FailNext(CopyDirection::kHostToDevice,
                  absl::InternalError("CUDA cudaMemcpyAsync failed: stand-in failure"));
  ASSERT_TRUE(Step(1, 2)->Send(Key(1, "h2d_fails"), sent).ok());
  PendingRecv h2d_fails(*Step(0, 2), Key(1, "h2d_fails"), to_gpu0);
  ASSERT_TRUE(h2d_fails.Wait());
  EXPECT_EQ(h2d_fails.status().code(), absl::StatusCode::kInternal) << h2d_fails.status();
  EXPECT_THAT(std::string(h2d_fails.status().message()), HasSubstr("h2d_fails"));
  // The device is out of memory for the destination.
  gpu0.set_exhausted(true);
  ASSERT_TRUE(
      Step(1, 3)->Send(Key(1, "no_memory"), PoolTensor(1, DataType::kFloat32, {64}, 6)).ok());
  PendingRecv no_memory(*Step(0, 3), Key(1, "no_memory"), to_gpu0);
  ASSERT_TRUE(no_memory.Wait());
  EXPECT_EQ(no_memory.status().code(), absl::StatusCode::kResourceExhausted) << no_memory.status();
  EXPECT_THAT(std::string(no_memory.status().message()),
              AllOf(HasSubstr("no_memory"), HasSubstr("cuda:0"), HasSubstr("256 bytes")));
  gpu0.set_exhausted(false);
  // Strings never live on a device.
  ASSERT_TRUE(Step(1, 4)->Send(Key(1, "strings"), PoolTensor(1, DataType::kString, {3}, 7)).ok());
  PendingRecv strings(*Step(0, 4), Key(1, "strings"), to_gpu0);
  ASSERT_TRUE(strings.Wait());
  EXPECT_EQ(strings.status().code(), absl::StatusCode::kInvalidArgument) << strings.status();
  EXPECT_THAT(std::string(strings.status().message()), HasSubstr("strings live in host memory"));
  for (PendingRecv* r : {&d2h_fails, &h2d_fails, &no_memory, &strings}) EXPECT_EQ(r->calls(), 1);
  EXPECT_EQ(server(1).stats().device_copy_errors.load(), 1);
  EXPECT_EQ(server(0).stats().device_copy_errors.load(), 3);
  // None of it hurt the channel: the next device tensor arrives.
  Tensor later = DeviceTensor(gpu0, DataType::kUInt8, {4096}, 8, &host);
  ASSERT_TRUE(Step(1, 5)->Send(Key(1, "later"), later).ok());
  PendingRecv ok(*Step(0, 5), Key(1, "later"), to_gpu0);
  ASSERT_TRUE(ok.Wait());
  ASSERT_TRUE(ok.status().ok()) << ok.status();
  EXPECT_TRUE(SameBytes(ok.tensor(), host));
  EXPECT_EQ(verbs_stats(0).channel_errors.load(), 0);
}

TEST_P(ProtocolTest, WithoutACopierDeviceTensorsAreRefusedNamingKeyAndDevice) {
  StartCluster(2);
  testing::StandInDeviceAllocator gpu0(0);
  Tensor host;
  Tensor sent = DeviceTensor(gpu0, DataType::kFloat32, {4}, 9, &host);
  absl::Status s = Step(1, 1)->Send(Key(1, "refused"), sent);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr("refused"), HasSubstr("cuda:0 memory")));
  RecvArgs to_gpu0;
  to_gpu0.allocator = &gpu0;
  PendingRecv recv(*Step(0, 1), Key(1, "x"), to_gpu0);
  ASSERT_TRUE(recv.Wait());
  EXPECT_EQ(recv.status().code(), absl::StatusCode::kFailedPrecondition) << recv.status();
  EXPECT_THAT(std::string(recv.status().message()), HasSubstr("stand-in cuda:0"));
}

// grpc+verbs over the same-host fabric with a GPU runtime (stand-ins here, CUDA IPC on a GPU
// host): device tensors in the tasks' device pools move with no copy through host memory.
class DeviceDirectTest : public ProtocolTest {
 protected:
  // Stand-in GPUs (0 .. devices-1) with the direct path, for tasks started afterwards.
  testing::StandInDeviceMemory& UseDirectGpus(int devices) {
    UseStandInGpus(devices);
    device_memory_ = std::make_shared<testing::StandInDeviceMemory>();
    device_pool_factory_ = [](int device) -> absl::StatusOr<std::unique_ptr<PoolAllocator>> {
      return testing::NewStandInDevicePool(device);
    };
    return static_cast<testing::StandInDeviceMemory&>(*device_memory_);
  }
  // A tensor in task's device pool of cuda:0 with the pattern of `seed`; `host` gets its bytes.
  Tensor PoolDeviceTensor(int task, DataType dtype, std::vector<int64_t> dims, uint32_t seed,
                          Tensor* host) {
    *host = *Tensor::Allocate(CpuAllocator(), dtype, *TensorShape::Create(dims));
    testing::FillPattern(*host, seed);
    Tensor t = *Tensor::Allocate(*server(task).DeviceAllocator(0), dtype, host->shape());
    if (host->TotalBytes() > 0) std::memcpy(t.data(), host->data(), host->TotalBytes());
    return t;
  }
  // A host tensor first, so the channel is set up and each side knows the other's end.
  void WarmUp() {
    ASSERT_NO_FATAL_FAILURE(SendAndRecv(1000, "warm", PoolTensor(1, DataType::kInt32, {8}, 1)));
  }
};

TEST_P(DeviceDirectTest, DevicePoolTensorsMoveWithNoCopyThroughHostMemory) {
  testing::StandInDeviceMemory& dm = UseDirectGpus(1);
  testing::StandInDeviceCopier& copier = *stand_in_copier_;
  StartCluster(2);
  ASSERT_NO_FATAL_FAILURE(WarmUp());
  ASSERT_TRUE(transport(0).device_direct());
  RecvArgs to_gpu;
  to_gpu.allocator = *server(0).DeviceAllocator(0);
  EXPECT_TRUE(transport(0).LandsOnDevice("/job:worker/replica:0/task:1", to_gpu.allocator));
  EXPECT_FALSE(transport(0).LandsOnDevice("/job:worker/replica:0/task:1", &StandInGpu(0)));
  int64_t step = 1, transfers = 0;
  uint32_t seed = 10;
  for (DataType dtype : AllDataTypes()) {
    if (dtype == DataType::kString) continue;
    for (std::vector<int64_t> dims : {std::vector<int64_t>{0}, {1}, {3, 5}, {1 << 18}}) {
      if (dims[0] == (1 << 18) && DataTypeSize(dtype) != 4) continue;
      Tensor host;
      Tensor sent = PoolDeviceTensor(1, dtype, dims, seed++, &host);
      const std::string name = absl::StrCat(DataTypeName(dtype), "_", dims.size(), "_", dims[0]);
      // Each key twice: the second recv of a key is the steady state (cached meta-data).
      for (int round = 0; round < 2; ++round) {
        ASSERT_NO_FATAL_FAILURE(DeviceRecv(step++, name, sent, host, to_gpu, &transfers));
      }
    }
  }
  EXPECT_EQ(dm.device_to_device(), transfers) << "one device copy per tensor, by the fabric";
  EXPECT_EQ(copier.device_to_host(), 0) << "no staging";
  EXPECT_EQ(copier.host_to_device(), 0) << "no proxy";
  EXPECT_EQ(server(1).stats().device_direct_sends.load(), transfers);
  EXPECT_GE(server(0).stats().device_direct_recvs.load(), transfers);
  EXPECT_EQ(server(0).stats().copies.load() + server(1).stats().copies.load(), 0);

  // Host to device and device to host move directly too: one device copy each, by the fabric.
  Tensor from_pool = PoolTensor(1, DataType::kFloat32, {1000}, 77);
  Tensor got;
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(step++, "host_to_gpu", from_pool, &got, to_gpu));
  EXPECT_EQ(got.placement(), MemoryPlacement::CudaDevice(0));
  EXPECT_TRUE(SameBytes(got, from_pool));
  EXPECT_EQ(dm.host_to_device(), 1);
  Tensor host;
  Tensor on_gpu = PoolDeviceTensor(1, DataType::kInt64, {333}, 78, &host);
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(step++, "gpu_to_host", on_gpu, &got));
  EXPECT_TRUE(got.placement().host_accessible());
  EXPECT_TRUE(got.ContentEquals(host));
  EXPECT_EQ(dm.device_to_host(), 1);
  EXPECT_EQ(copier.device_to_host() + copier.host_to_device(), 0);
}

TEST_P(DeviceDirectTest, MemoryTheFabricCannotReachTakesTheProxyPathInstead) {
  testing::StandInDeviceMemory& dm = UseDirectGpus(1);
  testing::StandInDeviceCopier& copier = *stand_in_copier_;
  StartCluster(2);
  ASSERT_NO_FATAL_FAILURE(WarmUp());
  RecvArgs to_pool;
  to_pool.allocator = *server(0).DeviceAllocator(0);
  // A device tensor outside the sender's pool is staged to host, then written directly.
  Tensor host;
  Tensor outside = DeviceTensor(StandInGpu(0), DataType::kFloat32, {4096}, 5, &host);
  Tensor got;
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(1, "outside", outside, &got, to_pool));
  EXPECT_TRUE(SameBytes(got, host));
  EXPECT_EQ(copier.device_to_host(), 1);
  EXPECT_EQ(dm.host_to_device(), 1);
  // A recv into a device allocator the transport does not register lands in a proxy.
  RecvArgs to_other;
  to_other.allocator = &StandInGpu(0);
  Tensor sent = PoolDeviceTensor(1, DataType::kUInt8, {5000}, 6, &host);
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(2, "other", sent, &got, to_other));
  EXPECT_TRUE(SameBytes(got, host));
  EXPECT_EQ(got.placement(), MemoryPlacement::CudaDevice(0));
  EXPECT_EQ(copier.host_to_device(), 1);
  EXPECT_EQ(dm.device_to_host(), 1) << "written from the device into the proxy";
  // Strings never land on a device.
  ASSERT_TRUE(Step(1, 3)->Send(Key(1, "strings"), PoolTensor(1, DataType::kString, {3}, 7)).ok());
  PendingRecv strings(*Step(0, 3), Key(1, "strings"), to_pool);
  ASSERT_TRUE(strings.Wait());
  EXPECT_EQ(strings.status().code(), absl::StatusCode::kInvalidArgument) << strings.status();
  EXPECT_THAT(std::string(strings.status().message()), HasSubstr("strings live in host memory"));
  // The channel is fine afterwards.
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(4, "after", sent, &got, to_pool));
  EXPECT_TRUE(SameBytes(got, host));
  EXPECT_EQ(verbs_stats(0).channel_errors.load(), 0);
}

// The first recv of a key into the GPU, before the channel knows the sender's end writes GPU
// memory, lands in host memory and is copied over; the key's next step was asked for ahead
// then (TENSORVERBS_PUSH), into host memory too. A recv into the GPU that takes such a pushed
// request over stops the key's pushes, so the key goes direct from then on rather than
// through host memory at every step.
TEST_P(DeviceDirectTest, AKeyFirstReceivedThroughHostMemoryGoesDirectSoonAfter) {
  UseDirectGpus(1);
  testing::StandInDeviceCopier& copier = *stand_in_copier_;
  StartCluster(2);
  RecvArgs to_gpu;
  to_gpu.allocator = *server(0).DeviceAllocator(0);
  Tensor host;
  Tensor sent = PoolDeviceTensor(1, DataType::kFloat32, {256}, 31, &host);
  for (int64_t step = 1; step <= 8; ++step) {
    Tensor got;
    ASSERT_NO_FATAL_FAILURE(SendAndRecv(step, "again", sent, &got, to_gpu));
    EXPECT_TRUE(SameBytes(got, host)) << "step " << step;
    EXPECT_EQ(got.placement(), MemoryPlacement::CudaDevice(0)) << "step " << step;
  }
  EXPECT_LE(copier.host_to_device(), 2) << "the first recv and at most the one pushed after it";
  EXPECT_GE(server(0).stats().device_direct_recvs.load(), 6);
}

// A receiver that registers per transfer offers its own private memory, which the kernel's
// cross-memory copy reaches and a GPU copy cannot: the sender's direct device write goes
// through the fabric's bounce buffer, and the channel keeps working.
TEST_P(DeviceDirectTest, ADeviceWriteIntoAPeersPrivateMemoryGoesThroughABounceBuffer) {
  UseDirectGpus(1);
  auto first = std::make_shared<bool>(true);
  StartCluster(2, [first](ServerOptions& o) {
    // task 0, the receiver
    if (*first) o.verbs.channel.registration = protocol::Registration::kPerTransfer;
    *first = false;
  });
  ASSERT_NO_FATAL_FAILURE(WarmUp());
  ASSERT_FALSE(transport(0).device_direct());
  ASSERT_TRUE(transport(1).device_direct());
  const uint64_t bounced = fabric::shmem::Counters().device_bounced_ops.load();
  for (int64_t step = 1; step <= 3; ++step) {
    Tensor host;
    Tensor sent = PoolDeviceTensor(1, DataType::kFloat32, {1 << 16}, 20 + step, &host);
    RecvArgs args;
    args.allocator = CpuAllocator();  // heap memory, registered for this one recv
    Tensor got;
    ASSERT_NO_FATAL_FAILURE(SendAndRecv(step, "private", sent, &got, args));
    EXPECT_TRUE(got.ContentEquals(host));
  }
  EXPECT_EQ(fabric::shmem::Counters().device_bounced_ops.load() - bounced, 3u);
  EXPECT_EQ(server(1).stats().device_direct_sends.load(), 3);
  EXPECT_EQ(verbs_stats(0).channel_errors.load() + verbs_stats(1).channel_errors.load(), 0);
}

TEST_P(DeviceDirectTest, GpuDirectOffTakesTheProxyPath) {
  testing::StandInDeviceMemory& dm = UseDirectGpus(1);
  testing::StandInDeviceCopier& copier = *stand_in_copier_;
  StartCluster(2, [](ServerOptions& o) { o.verbs.gpu_direct = false; });
  ASSERT_NO_FATAL_FAILURE(WarmUp());
  EXPECT_FALSE(transport(0).device_direct());
  RecvArgs to_gpu;
  to_gpu.allocator = *server(0).DeviceAllocator(0);
  Tensor host;
  Tensor sent = PoolDeviceTensor(1, DataType::kFloat32, {1024}, 9, &host);
  Tensor got;
  ASSERT_NO_FATAL_FAILURE(SendAndRecv(1, "proxied", sent, &got, to_gpu));
  EXPECT_TRUE(SameBytes(got, host));
  EXPECT_EQ(copier.device_to_host(), 1);
  EXPECT_EQ(copier.host_to_device(), 1);
  EXPECT_EQ(dm.device_to_device() + dm.host_to_device() + dm.device_to_host(), 0);
  EXPECT_EQ(server(0).stats().device_direct_recvs.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(Protocols, DeviceDirectTest,
                         ::testing::ValuesIn(Combine({&kGrpcVerbs}, {&kShmem})), ParamName);

}  // namespace
}  // namespace tensorverbs::protocol_conformance
