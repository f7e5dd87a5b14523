// A peer task for the two-process device tests (device_two_process_test.cc): starts a Server
// for --job/--task of --cluster over --protocol (--gpu-direct 0|1 sets VerbsOptions::gpu_direct),
// prints "ready <incarnation-hex>", then for each step from --first-step on receives "in" from
// task --from of its job into its GPU pool (cuda:0) and sends that device tensor back as "back"
// at the same step, printing "echoed <step> <bytes>" or "failed <step> <status>". A step is
// cleaned up once the next one's tensor has arrived (the test has taken its "back" by then).
//
// On SIGTERM it stops its server, prints "copies <device_direct_recvs> <device_direct_sends>
// <host_to_device> <device_to_host>" (its TransferStats), destroys the server and, where the
// CUDA runtime is the tests' stand-in, prints "runtime <live allocations> <IPC opens not
// closed>", which a test expects to be "runtime 0 0": every GPU region freed and every peer
// mapping closed.
#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <string>
#include <thread>

#include "src/common/config.h"
#include "src/server/server.h"
#include "src/support/process_util.h"
#include "tensorverbs/device_name.h"

int main(int argc, char** argv) {
  using namespace tensorverbs;
  std::string cluster, job, protocol = "grpc+verbs";
  int task = 1, from = 0;
  int64_t first_step = 1;
  bool gpu_direct = true;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--cluster") {
      cluster = value;
    } else if (flag == "--job") {
      job = value;
    } else if (flag == "--task") {
      task = std::stoi(value);
    } else if (flag == "--from") {
      from = std::stoi(value);
    } else if (flag == "--first-step") {
      first_step = std::stoll(value);
    } else if (flag == "--protocol") {
      protocol = value;
    } else if (flag == "--gpu-direct") {
      gpu_direct = value == "1";
    }
  }
  support::BlockTerminationSignals();
  absl::StatusOr<ClusterSpec> spec = ClusterSpec::Parse(cluster);
  if (!spec.ok()) {
    std::fprintf(stderr, "device_echo_peer: %s\n", spec.status().ToString().c_str());
    return 2;
  }
  ServerOptions options;
  options.cluster = *spec;
  options.job = job;
  options.task = task;
  options.protocol = protocol;
  options.verbs.gpu_direct = gpu_direct;
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Create(options);
  if (!server.ok()) {
    std::fprintf(stderr, "device_echo_peer: %s\n", server.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<PoolAllocator*> gpu = (*server)->DeviceAllocator(0);
  if (!gpu.ok()) {
    std::fprintf(stderr, "device_echo_peer: %s\n", gpu.status().ToString().c_str());
    return 1;
  }
  std::printf("ready %016llx\n", static_cast<unsigned long long>((*server)->incarnation()));
  std::fflush(stdout);

  std::atomic<bool> stopping{false};
  std::thread echo([&] {
    Server& s = **server;
    const std::string src = CpuDeviceName(job, from);
    absl::StatusOr<uint64_t> incarnation =
        s.PeerIncarnation(TaskName(job, from), absl::Seconds(60));
    if (!incarnation.ok()) {
      std::printf("failed %lld %s\n", static_cast<long long>(first_step),
                  incarnation.status().ToString().c_str());
      std::fflush(stdout);
      return;
    }
    RecvArgs into_gpu;
    into_gpu.allocator = *gpu;
    for (int64_t step = first_step; !stopping.load(); ++step) {
      absl::StatusOr<std::shared_ptr<RemoteRendezvous>> found = s.rendezvous_mgr()->Find(step);
      if (!found.ok()) {
        std::printf("failed %lld %s\n", static_cast<long long>(step),
                    found.status().ToString().c_str());
        std::fflush(stdout);
        return;
      }
      std::shared_ptr<RemoteRendezvous> r = *std::move(found);
      absl::StatusOr<std::vector<Tensor>> got = RecvAll(
          *r, {*ParsedKey::Parse(ParsedKey::Create(src, *incarnation, s.device_name(), "in"))},
          into_gpu);
      absl::Status status = got.status();
      if (status.ok()) {
        status = r->Send(
            *ParsedKey::Parse(ParsedKey::Create(s.device_name(), s.incarnation(), src, "back")),
            (*got)[0], false);
      }
      if (step > first_step) s.rendezvous_mgr()->Cleanup(step - 1);
      if (status.ok()) {
        const TransferStats& st = s.stats();
        std::printf("echoed %lld %zu copies %lld %lld %lld %lld\n", static_cast<long long>(step),
                    (*got)[0].TotalBytes(), static_cast<long long>(st.device_direct_recvs.load()),
                    static_cast<long long>(st.device_direct_sends.load()),
                    static_cast<long long>(st.host_to_device.load()),
                    static_cast<long long>(st.device_to_host.load()));
      } else {
        std::printf("failed %lld %s\n", static_cast<long long>(step), status.ToString().c_str());
      }
      std::fflush(stdout);
      if (!status.ok()) return;
    }
  });
  support::WaitForTerminationSignal();
  stopping.store(true);
  (*server)->Stop();  // fails the recv still waiting
  echo.join();
  const TransferStats& stats = (*server)->stats();
  std::printf("copies %lld %lld %lld %lld\n",
              static_cast<long long>(stats.device_direct_recvs.load()),
              static_cast<long long>(stats.device_direct_sends.load()),
              static_cast<long long>(stats.host_to_device.load()),
              static_cast<long long>(stats.device_to_host.load()));
  server->reset();

  // The stand-in runtime counts what is still allocated and mapped; a real one does not.
  const std::string& runtime = Config::Get().cuda_runtime;
  if (!runtime.empty()) {
    if (void* lib = dlopen(runtime.c_str(), RTLD_NOW | RTLD_NOLOAD)) {
      using Counts = void (*)(long*, long*);
      if (auto counts = reinterpret_cast<Counts>(dlsym(lib, "tv_fake_cudart_counts"))) {
        long allocations = 0, opens = 0;
        counts(&allocations, &opens);
        std::printf("runtime %ld %ld\n", allocations, opens);
      }
      dlclose(lib);
    }
  }
  std::fflush(stdout);
  return 0;
}
