// A peer task for integration tests: starts a Server for --job/--task of --cluster, sends the
// standard fixtures (seeded with --seed) at --step over --protocol, prints "ready
// <incarnation-hex>" and serves until SIGTERM/SIGINT. With --late-ms N it sends one more tensor,
// "late" (a copy of the first fixture), N ms after it is ready: a slow sender. With
// --recv-from T --recv-steps N it also receives "stream" from task T of its job at steps
// --step+1 .. --step+N, one at a time, printing "got <i> <bytes>" or "failed <i> <status>".
// With --wait-for-peers 1 it sets up its channels to every peer before it says "ready". With
// --spares N it also sends "spare<i>" for i in 0..N-1 (testing::MakeSpare) at --step: one
// fresh key for each try of a receiver that retries after a fault (a failed recv may have
// consumed its tensor at the sender, so a retry must not ask for the same key). With --rails
// A[,B] its grpc+verbs channels get further lanes bound to those addresses (TENSORVERBS_RAILS).
// With --crc 1 each "got" line ends with the CRC-32C of the tensor's bytes, in hex. With
// --recv-gap-ms N it waits N ms after each recv of the stream ends before it starts the next.
// With --peer-timeout-ms N its peer timeout is N ms.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "src/common/checksum.h"
#include "src/server/server.h"
#include "src/support/process_util.h"
#include "tensorverbs/device_name.h"
#include "tests/support/fixtures.h"

int main(int argc, char** argv) {
  using namespace tensorverbs;
  std::string cluster, job, dst_device, protocol = "grpc";
  int task = 0;
  int64_t step = 1;
  uint32_t seed = 1;
  bool big = false;
  int late_ms = 0;
  int recv_from = -1, recv_steps = 0, recv_gap_ms = 0, peer_timeout_ms = 0;
  int spares = 0;
  bool wait_for_peers = false;
  std::string rails;
  bool crc = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--cluster")
      cluster = value;
    else if (flag == "--job")
      job = value;
    else if (flag == "--task")
      task = std::stoi(value);
    else if (flag == "--step")
      step = std::stoll(value);
    else if (flag == "--seed")
      seed = static_cast<uint32_t>(std::stoul(value));
    else if (flag == "--dst")
      dst_device = value;
    else if (flag == "--big")
      big = value == "1";
    else if (flag == "--protocol")
      protocol = value;
    else if (flag == "--late-ms")
      late_ms = std::stoi(value);
    else if (flag == "--recv-from")
      recv_from = std::stoi(value);
    else if (flag == "--recv-steps")
      recv_steps = std::stoi(value);
    else if (flag == "--recv-gap-ms")
      recv_gap_ms = std::stoi(value);
    else if (flag == "--peer-timeout-ms")
      peer_timeout_ms = std::stoi(value);
    else if (flag == "--spares")
      spares = std::stoi(value);
    else if (flag == "--wait-for-peers")
      wait_for_peers = value == "1";
    else if (flag == "--rails")
      rails = value;
    else if (flag == "--crc")
      crc = value == "1";
  }
  support::BlockTerminationSignals();
  absl::StatusOr<ClusterSpec> spec = ClusterSpec::Parse(cluster);
  if (!spec.ok()) {
    std::fprintf(stderr, "test_peer: %s\n", spec.status().ToString().c_str());
    return 2;
  }
  ServerOptions options;
  options.cluster = *spec;
  options.job = job;
  options.task = task;
  options.protocol = protocol;
  if (!rails.empty()) options.verbs.rails = absl::StrSplit(rails, ',');
  if (peer_timeout_ms > 0) options.transfer.peer_timeout = absl::Milliseconds(peer_timeout_ms);
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Create(options);
  if (!server.ok()) {
    std::fprintf(stderr, "test_peer: %s\n", server.status().ToString().c_str());
    return 1;
  }
  auto r = (*server)->rendezvous_mgr()->Find(step);
  for (const testing::Fixture& f : testing::MakeFixtures(seed, big)) {
    std::string key =
        ParsedKey::Create((*server)->device_name(), (*server)->incarnation(), dst_device, f.name);
    absl::Status s = (*r)->Send(*ParsedKey::Parse(key), f.tensor, f.is_dead);
    if (!s.ok()) {
      std::fprintf(stderr, "test_peer: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  const Tensor spare = testing::MakeSpare(seed);
  for (int i = 0; i < spares; ++i) {
    std::string key = ParsedKey::Create((*server)->device_name(), (*server)->incarnation(),
                                        dst_device, absl::StrCat("spare", i));
    absl::Status s = (*r)->Send(*ParsedKey::Parse(key), spare, /*is_dead=*/false);
    if (!s.ok()) {
      std::fprintf(stderr, "test_peer: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  if (wait_for_peers) {
    // Channels to every peer before "ready", so that the stats show each pair's fabric.
    absl::Status s = (*server)->WaitForPeers(absl::Seconds(60));
    if (s.ok()) s = (*server)->SetUpChannels(absl::Seconds(60));
    if (!s.ok()) {
      std::fprintf(stderr, "test_peer: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  std::printf("ready %016llx\n", static_cast<unsigned long long>((*server)->incarnation()));
  std::fflush(stdout);
  if (late_ms > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(late_ms));
    const testing::Fixture first = testing::MakeFixtures(seed, false).front();
    std::string key =
        ParsedKey::Create((*server)->device_name(), (*server)->incarnation(), dst_device, "late");
    absl::Status s = (*r)->Send(*ParsedKey::Parse(key), first.tensor, first.is_dead);
    if (!s.ok()) {
      std::fprintf(stderr, "test_peer: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  std::thread receiver;
  std::atomic<bool> stopping{false};
  if (recv_from >= 0 && recv_steps > 0) {
    receiver = std::thread([&server, &stopping, job, recv_from, recv_steps, recv_gap_ms, step,
                            crc] {
      Server& s = **server;
      const std::string src = CpuDeviceName(job, recv_from);
      absl::StatusOr<uint64_t> incarnation =
          s.PeerIncarnation(TaskName(job, recv_from), absl::Seconds(60));
      for (int i = 1; i <= recv_steps && !stopping.load(); ++i) {
        absl::Status status = incarnation.status();
        int64_t bytes = 0;
        uint32_t sum = 0;
        if (status.ok()) {
          auto r = *s.rendezvous_mgr()->Find(step + i);
          absl::StatusOr<std::vector<Tensor>> got = RecvAll(
              *r,
              {*ParsedKey::Parse(ParsedKey::Create(src, *incarnation, s.device_name(), "stream"))});
          status = got.status();
          if (got.ok()) {
            bytes = static_cast<int64_t>((*got)[0].TotalBytes());
            if (crc) sum = Crc32c((*got)[0].data(), (*got)[0].TotalBytes());
          }
          s.rendezvous_mgr()->Cleanup(step + i);
        }
        if (status.ok()) {
          if (crc) {
            std::printf("got %d %lld %08x\n", i, static_cast<long long>(bytes), sum);
          } else {
            std::printf("got %d %lld\n", i, static_cast<long long>(bytes));
          }
        } else {
          std::printf("failed %d %s\n", i, status.ToString().c_str());
        }
        std::fflush(stdout);
        if (recv_gap_ms > 0 && i < recv_steps) absl::SleepFor(absl::Milliseconds(recv_gap_ms));
      }
    });
  }
  support::WaitForTerminationSignal();
  stopping.store(true);
  (*server)->Stop();  // fails a recv still waiting
  if (receiver.joinable()) receiver.join();
  return 0;
}
