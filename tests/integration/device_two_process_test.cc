// GPU tensors between two processes: task 0 runs in the test, task 1 is a tv_device_echo_peer
// that receives each tensor into its GPU pool and sends it back from there. Every dtype but
// strings, empty to 2^20 elements (and 256 MiB and 1 GiB on a real GPU), leave task 0's GPU
// pool and come back into it byte for byte: over grpc+verbs on the same-host fabric with the
// direct path (device copies into the other process's GPU memory, opened through CUDA IPC) and
// without it (the proxy path: one device-to-host copy to send, one host-to-device copy to
// receive), and over grpc. Afterwards neither process holds a GPU allocation or an IPC mapping.
//
// Two suites, one per runtime. FakeGpuTwoProcessTest runs everywhere against the stand-in
// runtime (tests/support/fake_cudart.cc: device memory is shared memory that IPC maps across
// processes), so the cross-process bookkeeping runs in CI (label `integration`). GpuTwoProcessTest
// runs the same on a real GPU (label `gpu`) and skips without one. The runtime is chosen once per
// process, so each suite needs a process of its own (ctest runs every test in its own).
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "src/common/config.h"
#include "src/device/cuda_runtime.h"
#include "src/server/server.h"
#include "tensorverbs/device_name.h"
#include "tensorverbs/placement.h"
#include "tests/support/fixtures.h"
#include "tests/support/pending_recv.h"
#include "tests/support/subprocess.h"

namespace tensorverbs {
namespace {

struct Route {
  const char* name;
  const char* protocol;
  bool direct;  // TENSORVERBS_GPU_DIRECT in both tasks
};

std::string RouteName(const ::testing::TestParamInfo<Route>& info) { return info.param.name; }
void PrintTo(const Route& route, std::ostream* os) { *os << route.name; }

// The echo peer: TV_DEVICE_ECHO_PEER names it where the build folder is not at hand (the GPU
// bundle, scripts/gpu-bundle.sh).
std::string EchoPeerPath() {
  const char* carried = std::getenv("TV_DEVICE_ECHO_PEER");
  return carried != nullptr && *carried != '\0' ? carried : TV_DEVICE_ECHO_PEER_PATH;
}

// Live allocations and IPC opens not closed of the stand-in runtime loaded from `path`.
bool FakeRuntimeCounts(const std::string& path, long* allocations, long* opens) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) return false;
  using Counts = void (*)(long*, long*);
  auto counts = reinterpret_cast<Counts>(dlsym(lib, "tv_fake_cudart_counts"));
  if (counts != nullptr) counts(allocations, opens);
  dlclose(lib);
  return counts != nullptr;
}

class TwoProcessDeviceTest : public ::testing::TestWithParam<Route> {
 protected:
  static constexpr int64_t kFirstStep = 100;

  // Loads the runtime this suite is about, or skips saying why not.
  virtual void ChooseRuntime() = 0;
  virtual bool big() const = 0;

  void SetUp() override {
    ChooseRuntime();
    if (IsSkipped()) return;
    absl::StatusOr<std::vector<int>> ports = PickFreePorts(2);
    ASSERT_TRUE(ports.ok()) << ports.status();
    cluster_ = absl::StrCat("worker=127.0.0.1:", (*ports)[0], ",127.0.0.1:", (*ports)[1]);
    absl::StatusOr<std::unique_ptr<support::Subprocess>> peer = support::Subprocess::Start(
        EchoPeerPath(), {"--cluster", cluster_, "--job", "worker", "--task", "1", "--from", "0",
                         "--first-step", absl::StrCat(kFirstStep), "--protocol",
                         GetParam().protocol, "--gpu-direct", GetParam().direct ? "1" : "0"});
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *std::move(peer);
    absl::StatusOr<std::string> ready = peer_->WaitForLine("ready ", absl::Seconds(60));
    ASSERT_TRUE(ready.ok()) << ready.status();
    ASSERT_TRUE(absl::SimpleHexAtoi(ready->substr(6), &peer_incarnation_)) << *ready;

    ServerOptions options;
    options.cluster = *ClusterSpec::Parse(cluster_);
    options.job = "worker";
    options.task = 0;
    options.protocol = GetParam().protocol;
    options.verbs.gpu_direct = GetParam().direct;
    absl::StatusOr<std::unique_ptr<Server>> server = Server::Create(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    absl::StatusOr<PoolAllocator*> gpu = server_->DeviceAllocator(0);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    gpu_ = *gpu;
    ASSERT_TRUE(server_->WaitForPeers(absl::Seconds(30)).ok());
  }

  void TearDown() override {
    if (peer_ != nullptr) {
      peer_->Signal(SIGTERM);
      (void)peer_->Wait(absl::Seconds(30));
    }
  }

  // Stops this task (it holds imports of the peer's GPU memory), then the peer; returns the
  // peer's last lines.
  std::string StopBoth() {
    server_->Stop();
    gpu_ = nullptr;
    server_.reset();
    peer_->Signal(SIGTERM);
    std::string out = peer_->ReadAll(absl::Seconds(30));
    absl::StatusOr<int> code = peer_->Wait(absl::Seconds(30));
    EXPECT_TRUE(code.ok() && *code == 0) << "the echo peer did not exit cleanly: " << out;
    peer_.reset();
    return out;
  }

  // The peer's copy counters (direct recvs, direct sends, host-to-device, device-to-host copies)
  // as its line starting with `prefix` gives them after "copies".
  static bool PeerCopies(const std::string& out, const std::string& prefix, int64_t counts[4]) {
    const size_t line = out.find(prefix);
    if (line == std::string::npos) return false;
    const size_t at = out.find("copies ", line);
    return at != std::string::npos &&
           std::sscanf(out.c_str() + at, "copies %" SCNd64 " %" SCNd64 " %" SCNd64 " %" SCNd64,
                       &counts[0], &counts[1], &counts[2], &counts[3]) == 4;
  }

  ParsedKey Out() const {
    return *ParsedKey::Parse(ParsedKey::Create(server_->device_name(), server_->incarnation(),
                                               CpuDeviceName("worker", 1), "in"));
  }
  ParsedKey Back() const {
    return *ParsedKey::Parse(ParsedKey::Create(CpuDeviceName("worker", 1), peer_incarnation_,
                                               server_->device_name(), "back"));
  }

  // Sends `t` to the peer at `step` and receives its echo with `args`.
  void Echo(int64_t step, Tensor t, const RecvArgs& args, Tensor* back) {
    auto r = *server_->rendezvous_mgr()->Find(step);
    ASSERT_TRUE(r->Send(Out(), t, false).ok());
    t = Tensor();  // the rendezvous holds the only reference now
    PendingRecv recv(*r, Back(), args);
    ASSERT_TRUE(recv.Wait(absl::Seconds(120))) << "no echo of step " << step;
    ASSERT_TRUE(recv.status().ok()) << "step " << step << ": " << recv.status();
    EXPECT_EQ(recv.calls(), 1);
    *back = recv.tensor();
    server_->rendezvous_mgr()->Cleanup(step);
  }

  // A device tensor with `host`'s bytes, from this task's GPU pool.
  Tensor OnGpu(const Tensor& host) {
    Tensor t = *Tensor::Allocate(gpu_, host.dtype(), host.shape());
    if (host.TotalBytes() > 0) {
      EXPECT_TRUE(
          rt_->Memcpy(0, t.data(), host.data(), host.TotalBytes(), device::CopyKind::kHostToDevice)
              .ok());
    }
    return t;
  }
  bool SameOnGpu(const Tensor& device, const Tensor& host) {
    if (device.dtype() != host.dtype() || device.shape() != host.shape()) return false;
    if (host.TotalBytes() == 0) return true;
    std::vector<char> copy(host.TotalBytes());
    if (!rt_->Memcpy(0, copy.data(), device.data(), copy.size(), device::CopyKind::kDeviceToHost)
             .ok()) {
      return false;
    }
    return std::memcmp(copy.data(), host.data(), copy.size()) == 0;
  }

  // One tensor both ways first, so that each task's channel is up and knows whether the other
  // end writes GPU memory before any device tensor is counted. It is received into the GPU as
  // the rest will be: a recv into host memory would leave the sender destinations to push the
  // next tensors of its key into, in host memory.
  void WarmUp() {
    Tensor host = *Tensor::Allocate(CpuAllocator(), DataType::kInt32, TensorShape::Of({8}));
    testing::FillPattern(host, 1);
    RecvArgs into_gpu;
    into_gpu.allocator = gpu_;
    Tensor back;
    ASSERT_NO_FATAL_FAILURE(Echo(kFirstStep, host, into_gpu, &back));
    EXPECT_TRUE(SameOnGpu(back, host));
  }

  // Every dtype but strings at 0, 1, 15 and 2^20 elements (and 256 MiB and 1 GiB where big()),
  // out of this task's GPU pool and back into it; returns the non-empty round trips (`*all`:
  // every round trip).
  int64_t RoundTripEveryCase(int64_t* all) {
    std::vector<std::pair<DataType, std::vector<int64_t>>> cases;
    for (DataType dtype : AllDataTypes()) {
      if (dtype == DataType::kString) continue;
      for (std::vector<int64_t> dims : {std::vector<int64_t>{0}, {1}, {3, 5}, {1 << 20}}) {
        cases.emplace_back(dtype, dims);
      }
    }
    if (big()) {
      cases.push_back({DataType::kUInt8, {int64_t{256} << 20}});
      cases.push_back({DataType::kUInt8, {int64_t{1} << 30}});
    }
    RecvArgs into_gpu;
    into_gpu.allocator = gpu_;
    int64_t step = kFirstStep + 1, round_trips = 0;
    *all = static_cast<int64_t>(cases.size());
    uint32_t seed = 21;
    for (const auto& [dtype, dims] : cases) {
      Tensor host = *Tensor::Allocate(CpuAllocator(), dtype, *TensorShape::Create(dims));
      testing::FillPattern(host, seed++);
      const std::string name = absl::StrCat(DataTypeName(dtype), " x ", host.NumElements());
      Tensor back;
      Echo(step++, OnGpu(host), into_gpu, &back);
      if (HasFailure()) {
        ADD_FAILURE() << "at " << name;
        return round_trips;
      }
      EXPECT_TRUE(SameOnGpu(back, host)) << name;
      if (host.TotalBytes() > 0) {
        EXPECT_EQ(back.placement(), MemoryPlacement::CudaDevice(0)) << name;
        ++round_trips;
      }
    }
    return round_trips;
  }

  // The two tests, for both suites.
  void EveryDtypeAndSizeRoundTrips();
  void NothingOutlivesTheTasks();

  std::string cluster_;
  std::unique_ptr<support::Subprocess> peer_;
  uint64_t peer_incarnation_ = 0;
  std::unique_ptr<Server> server_;
  PoolAllocator* gpu_ = nullptr;
  device::CudaRuntime* rt_ = nullptr;
};

// The counters a round trip moves, read at one moment (TransferStats holds atomics).
struct CopyCounters {
  int64_t errors, direct_sends, direct_recvs, to_host, to_device, copies;
  explicit CopyCounters(const TransferStats& s)
      : errors(s.device_copy_errors.load()),
        direct_sends(s.device_direct_sends.load()),
        direct_recvs(s.device_direct_recvs.load()),
        to_host(s.device_to_host.load()),
        to_device(s.host_to_device.load()),
        copies(s.copies.load()) {}
};

// What this task's counters must say after `n` round trips out of and back into its GPU pool
// (the peer's own copies are not in them).
void ExpectCopies(const Route& route, const CopyCounters& before, const CopyCounters& after,
                  int64_t n, int64_t all) {
  EXPECT_EQ(after.errors - before.errors, 0);
  if (route.direct) {
    EXPECT_EQ(after.direct_sends - before.direct_sends, n);
    EXPECT_EQ(after.direct_recvs - before.direct_recvs, all) << "empty tensors included";
    EXPECT_EQ(after.to_host - before.to_host, 0);
    EXPECT_EQ(after.to_device - before.to_device, 0);
    EXPECT_EQ(after.copies - before.copies, 0);
  } else {
    EXPECT_EQ(after.direct_sends - before.direct_sends, 0);
    EXPECT_EQ(after.to_host - before.to_host, n) << "one device-to-host copy per send";
    EXPECT_EQ(after.to_device - before.to_device, n) << "one host-to-device copy per recv";
  }
}

class FakeGpuTwoProcessTest : public TwoProcessDeviceTest {
 protected:
  void ChooseRuntime() override {
    // Read once per process: set before anything asks, and inherited by the peer.
    setenv("TENSORVERBS_CUDA_RUNTIME", TV_FAKE_CUDART_PATH, 1);
    absl::StatusOr<device::CudaRuntime*> rt = device::CudaRuntime::Get();
    ASSERT_TRUE(rt.ok()) << rt.status();
    if ((*rt)->library() != TV_FAKE_CUDART_PATH) {
      GTEST_SKIP() << "this process already loaded " << (*rt)->library()
                   << "; run the stand-in tests in a process of their own (ctest does)";
    }
    rt_ = *rt;
  }
  bool big() const override { return false; }
};

class GpuTwoProcessTest : public TwoProcessDeviceTest {
 protected:
  void ChooseRuntime() override {
    if (Config::Get().cuda_runtime == TV_FAKE_CUDART_PATH) {
      GTEST_SKIP() << "this process chose the stand-in runtime; run --gtest_filter='Gpu*' alone";
    }
    if (!device::NvidiaDriverLoaded()) GTEST_SKIP() << "no GPU: no NVIDIA driver is loaded";
    absl::StatusOr<device::CudaRuntime*> rt = device::CudaRuntime::Get();
    if (!rt.ok()) GTEST_SKIP() << "no GPU: " << rt.status();
    rt_ = *rt;
  }
  bool big() const override { return GetParam().direct; }
};

void TwoProcessDeviceTest::EveryDtypeAndSizeRoundTrips() {
  ASSERT_NO_FATAL_FAILURE(WarmUp());
  const CopyCounters before(server_->stats());
  int64_t all = 0;
  const int64_t n = RoundTripEveryCase(&all);
  ExpectCopies(GetParam(), before, CopyCounters(server_->stats()), n, all);
  // The peer's side, from its echo of the warm-up to its exit: it received every tensor into
  // its GPU and sent it back from there, by the same path.
  const std::string peer_out = StopBoth();
  int64_t warm[4] = {0, 0, 0, 0}, last[4] = {0, 0, 0, 0}, peer[4];
  ASSERT_TRUE(PeerCopies(peer_out, absl::StrCat("echoed ", kFirstStep, " "), warm)) << peer_out;
  ASSERT_TRUE(PeerCopies(peer_out, "\ncopies ", last)) << peer_out;
  for (int i = 0; i < 4; ++i) peer[i] = last[i] - warm[i];
  if (GetParam().direct) {
    EXPECT_GE(peer[0], all) << "direct recvs";
    EXPECT_GE(peer[1], n) << "direct sends";
    EXPECT_EQ(peer[2] + peer[3], 0) << "no copy through host memory";
  } else {
    EXPECT_EQ(peer[0] + peer[1], 0) << "nothing direct";
    EXPECT_GE(peer[2], n) << "host-to-device copies of what it received";
    EXPECT_GE(peer[3], n) << "device-to-host copies of what it sent";
  }
}

void TwoProcessDeviceTest::NothingOutlivesTheTasks() {
  ASSERT_NO_FATAL_FAILURE(WarmUp());
  RecvArgs into_gpu;
  into_gpu.allocator = gpu_;
  for (int64_t i = 1; i <= 3; ++i) {
    Tensor host = *Tensor::Allocate(CpuAllocator(), DataType::kFloat32, TensorShape::Of({1 << 18}));
    testing::FillPattern(host, static_cast<uint32_t>(i));
    Tensor back;
    ASSERT_NO_FATAL_FAILURE(Echo(kFirstStep + i, OnGpu(host), into_gpu, &back));
    EXPECT_TRUE(SameOnGpu(back, host));
  }
  long allocations = -1, opens = -1;
  if (FakeRuntimeCounts(rt_->library(), &allocations, &opens) && GetParam().direct) {
    // The tensors this task sent were written into the peer's GPU pool, opened through IPC.
    EXPECT_GT(opens, 0) << "the direct path wrote no peer GPU memory";
  }
  const std::string peer_out = StopBoth();
  if (!FakeRuntimeCounts(rt_->library(), &allocations, &opens)) {
    GTEST_SUCCEED() << "the runtime does not count its allocations: both tasks stopped cleanly";
    return;
  }
  EXPECT_EQ(allocations, 0) << "GPU allocations this task did not free";
  EXPECT_EQ(opens, 0) << "peer GPU memory this task opened and did not close";
  EXPECT_NE(peer_out.find("runtime 0 0"), std::string::npos)
      << "the peer's allocations and IPC opens left at exit: " << peer_out;
}

const auto kRoutes =
    ::testing::Values(Route{"GrpcVerbs_Direct", "grpc+verbs", true},
                      Route{"GrpcVerbs_Proxy", "grpc+verbs", false}, Route{"Grpc", "grpc", false});

TEST_P(FakeGpuTwoProcessTest, EveryDtypeAndSizeRoundTripsExactly) { EveryDtypeAndSizeRoundTrips(); }
TEST_P(FakeGpuTwoProcessTest, NoGpuMemoryOrIpcMappingOutlivesTheTasks) {
  NothingOutlivesTheTasks();
}
INSTANTIATE_TEST_SUITE_P(Routes, FakeGpuTwoProcessTest, kRoutes, RouteName);

TEST_P(GpuTwoProcessTest, EveryDtypeAndSizeRoundTripsExactly) { EveryDtypeAndSizeRoundTrips(); }
TEST_P(GpuTwoProcessTest, NoGpuMemoryOrIpcMappingOutlivesTheTasks) { NothingOutlivesTheTasks(); }
INSTANTIATE_TEST_SUITE_P(Routes, GpuTwoProcessTest, kRoutes, RouteName);

}  // namespace
}  // namespace tensorverbs
