// A long run under churn (label `soak`, outside `make test`; `make soak` runs it): task 0 in
// this process sends tensors of mixed sizes (4 B to 64 MiB) to two tv_test_peer processes, each
// receiving one step after another; some steps are aborted before their tensor is sent, and a
// peer is killed and restarted every so often. Every tensor must reach the recv of its own step
// with its own size, every failure must be an aborted step's (or the killed peer's), and this
// process's memory and descriptors must stay flat from the first quarter of the run to its end.
//
// TV_SOAK_SECONDS (default 600) sets the length, TV_SOAK_PROTOCOL (default
// grpc+verbs) the protocol.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/server/server.h"
#include "src/support/process_util.h"
#include "tensorverbs/device_name.h"
#include "tensorverbs/placement.h"
#include "tests/support/subprocess.h"

namespace tensorverbs {
namespace {

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  int64_t out = 0;
  return v != nullptr && absl::SimpleAtoi(v, &out) && out > 0 ? out : fallback;
}

// One receiving peer: its process, and the steps this test sent (or aborted) for it.
struct Peer {
  int task = 0;
  int64_t base = 0;  // its steps are base+1, base+2, ...
  std::unique_ptr<support::Subprocess> process;
  int64_t next = 1;                     // the next step index to send or abort
  struct Sent {
    int64_t bytes = 0;  // -1: aborted
    absl::Time at;      // when it was sent or aborted
  };
  std::map<int64_t, Sent> expected;  // step index -> what was sent
  int64_t last_reported = 0;              // the step index of its last report
  absl::Time last_report_at = absl::InfinitePast();
};

TEST(SoakTest, SizesAbortsAndKillsLeaveEveryRecvRightAndMemoryAndDescriptorsFlat) {
  const absl::Duration length = absl::Seconds(EnvInt("TV_SOAK_SECONDS", 600));
  const char* protocol_env = std::getenv("TV_SOAK_PROTOCOL");
  const std::string protocol = protocol_env != nullptr ? protocol_env : "grpc+verbs";
  absl::StatusOr<std::vector<int>> ports = PickFreePorts(3);
  ASSERT_TRUE(ports.ok()) << ports.status();
  std::vector<std::string> addresses;
  for (int p : *ports) addresses.push_back(absl::StrCat("127.0.0.1:", p));
  const std::string cluster = absl::StrCat("worker=", absl::StrJoin(addresses, ","));

  // Each incarnation of a peer receives steps base+1 .. base+kPeerSteps and then stops asking,
  // so the budget must exceed what a run can send one peer (about 750 steps a second here;
  // 900,000 once ran out within a 60-minute run, and its last steps went unreported). Bases
  // are far enough apart that no two incarnations share a step id.
  constexpr int64_t kPeerSteps = 1000000000;
  constexpr int64_t kBaseSpacing = 2 * kPeerSteps;
  int64_t next_base = kBaseSpacing;
  auto start_peer = [&](Peer& peer) {
    peer.base = next_base;
    next_base += kBaseSpacing;
    peer.next = 1;
    peer.expected.clear();
    peer.last_reported = 0;
    peer.last_report_at = absl::Now();
    absl::StatusOr<std::unique_ptr<support::Subprocess>> p = support::Subprocess::Start(
        testing::TestPeerPath(),
        {"--cluster", cluster, "--job", "worker", "--task", absl::StrCat(peer.task), "--step",
         absl::StrCat(peer.base), "--seed", "1", "--dst", CpuDeviceName("worker", 0), "--protocol",
         protocol, "--recv-from", "0", "--recv-steps", absl::StrCat(kPeerSteps)});
    ASSERT_TRUE(p.ok()) << p.status();
    peer.process = *std::move(p);
    ASSERT_TRUE(peer.process->WaitForLine("ready ", absl::Seconds(60)).ok());
  };
  std::vector<Peer> peers(2);
  for (int i = 0; i < 2; ++i) {
    peers[i].task = i + 1;
    ASSERT_NO_FATAL_FAILURE(start_peer(peers[i]));
  }
  ServerOptions options;
  options.cluster = *ClusterSpec::Parse(cluster);
  options.job = "worker";
  options.task = 0;
  options.protocol = protocol;
  options.transfer.recv_timeout = absl::Seconds(30);
  options.transfer.peer_timeout = absl::Seconds(2);
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Create(options);
  ASSERT_TRUE(server.ok()) << server.status();
  RendezvousMgr* mgr = (*server)->rendezvous_mgr();

  std::mt19937 random(12345);
  const std::vector<int64_t> elements = {1, 256, 16 << 10, 256 << 10, 2 << 20};
  int64_t delivered = 0, delivered_bytes = 0, aborted = 0, kills = 0, wrong = 0, unexpected = 0;
  const absl::Time start = absl::Now();
  const absl::Duration kill_every = std::max(absl::Seconds(20), length / 8);
  absl::Time next_kill = start + kill_every;
  int64_t quarter_rss = -1;
  int quarter_fds = -1;

  // Reads what `peer` printed, checking each outcome against what was sent for that step.
  auto collect = [&](Peer& peer, absl::Duration wait) {
    for (absl::Duration w = wait;; w = absl::ZeroDuration()) {
      absl::StatusOr<std::string> line = peer.process->ReadLine(w);
      if (!line.ok()) return;
      std::vector<std::string> parts = absl::StrSplit(*line, absl::MaxSplits(' ', 2));
      int64_t index = 0, bytes = 0;
      if (parts.size() < 3 || !absl::SimpleAtoi(parts[1], &index)) continue;
      auto it = peer.expected.find(index);
      if (it == peer.expected.end()) {
        ++unexpected;
        ADD_FAILURE() << "task " << peer.task << " reported step " << index
                      << ", which was never sent: " << *line;
        continue;
      }
      if (parts[0] == "got" && absl::SimpleAtoi(parts[2], &bytes) && bytes == it->second.bytes) {
        ++delivered;
        delivered_bytes += bytes;
      } else if (parts[0] == "failed" && it->second.bytes < 0) {
        ++aborted;
      } else if (parts[0] == "got") {
        ++wrong;
        ADD_FAILURE() << "task " << peer.task << " step " << index << " got " << parts[2]
                      << " bytes; sent " << it->second.bytes;
      } else {
        ++unexpected;
        ADD_FAILURE() << "task " << peer.task << " step " << index << ": " << parts[2];
      }
      peer.expected.erase(it);
      peer.last_reported = index;
      peer.last_report_at = absl::Now();
    }
  };
  // What this side knows of `peer`'s unreported steps, for a failure: when each was sent or
  // aborted, and whether the peer's request took its tensor (a sent tensor no request took
  // is still pending here).
  auto describe = [&](Peer& peer) {
    std::string out = absl::StrCat("last report: step index ", peer.last_reported, ", ",
                                   absl::FormatDuration(absl::Now() - peer.last_report_at),
                                   " ago; unreported:");
    for (const auto& [index, sent] : peer.expected) {
      const int64_t step = peer.base + index;
      absl::StrAppend(&out, "\n  step ", step, " (index ", index, "): ");
      if (sent.bytes < 0) {
        absl::StrAppend(&out, "aborted");
      } else {
        absl::StrAppend(&out, sent.bytes, " bytes sent");
        absl::StatusOr<std::shared_ptr<RemoteRendezvous>> r = mgr->Find(step);
        if (r.ok()) {
          absl::StrAppend(&out, (*r)->NumPendingSends() > 0 ? ", not taken by any request"
                                                            : ", taken by a request");
        } else {
          absl::StrAppend(&out, ", ", r.status().ToString());
        }
      }
      absl::StrAppend(&out, ", ", absl::FormatDuration(absl::Now() - sent.at), " ago");
    }
    return out;
  };

  while (absl::Now() - start < length) {
    if (quarter_rss < 0 && absl::Now() - start > length / 4) {
      quarter_rss = support::ResidentBytes();
      quarter_fds = support::OpenDescriptors();
    }
    if (absl::Now() > next_kill) {
      next_kill += kill_every;
      Peer& victim = peers[random() % peers.size()];
      victim.process->Signal(SIGKILL);
      ASSERT_TRUE(victim.process->Wait(absl::Seconds(10)).ok());
      support::UnlinkShmRegionsOf(victim.process->pid());
      for (const auto& [index, sent] : victim.expected) mgr->Cleanup(victim.base + index);
      ++kills;
      ASSERT_NO_FATAL_FAILURE(start_peer(victim));
    }
    for (Peer& peer : peers) {
      // At most two steps ahead of what the peer reported.
      while (peer.expected.size() < 2) {
        ASSERT_LE(peer.next, kPeerSteps) << "task " << peer.task << " used up its step budget";
        const int64_t index = peer.next++;
        const int64_t step = peer.base + index;
        if (random() % 20 == 0) {
          mgr->Cleanup(step);  // aborted before its tensor exists
          peer.expected[index] = {-1, absl::Now()};
          continue;
        }
        const int64_t n = index % 50 == 0 ? (16 << 20) : elements[random() % elements.size()];
        absl::StatusOr<Tensor> t =
            Tensor::Allocate((*server)->recv_allocator(), DataType::kFloat32, TensorShape::Of({n}));
        ASSERT_TRUE(t.ok()) << t.status();
        const ParsedKey key =
            *ParsedKey::Parse(ParsedKey::Create((*server)->device_name(), (*server)->incarnation(),
                                                CpuDeviceName("worker", peer.task), "stream"));
        ASSERT_TRUE((*mgr->Find(step))->Send(key, *t).ok());
        peer.expected[index] = {n * 4, absl::Now()};
      }
      collect(peer, absl::Milliseconds(5));
      // A step the peer has taken (or failed) is over on this side too.
      for (int64_t index = std::max<int64_t>(1, peer.next - 8); index < peer.next; ++index) {
        if (!peer.expected.contains(index)) mgr->Cleanup(peer.base + index);
      }
    }
  }
  // Drain: every outstanding step ends, one way or the other. Each peer has a minute of its
  // own, so that one slow peer cannot leave the next none.
  for (Peer& peer : peers) {
    const absl::Time drain = absl::Now();
    while (!peer.expected.empty() && absl::Now() - drain < absl::Seconds(60)) {
      collect(peer, absl::Milliseconds(200));
    }
    EXPECT_TRUE(peer.expected.empty()) << "task " << peer.task << " never reported "
                                       << peer.expected.size() << " step(s); " << describe(peer);
    for (int64_t index = 1; index < peer.next; ++index) mgr->Cleanup(peer.base + index);
  }
  absl::SleepFor(absl::Seconds(3));  // quarantines end
  const int64_t end_rss = support::ResidentBytes();
  const int end_fds = support::OpenDescriptors();
  std::printf(
      "soak over %s for %s: %lld tensors (%.1f GiB) delivered, %lld aborted steps, %lld kills, "
      "%lld wrong, %lld unexpected; RSS %.0f MiB at a quarter, %.0f MiB at the end; descriptors "
      "%d, %d\n",
      protocol.c_str(), absl::FormatDuration(absl::Now() - start).c_str(),
      static_cast<long long>(delivered), delivered_bytes / 1073741824.0,
      static_cast<long long>(aborted), static_cast<long long>(kills), static_cast<long long>(wrong),
      static_cast<long long>(unexpected), quarter_rss / 1048576.0, end_rss / 1048576.0, quarter_fds,
      end_fds);
  EXPECT_GT(delivered, 0);
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(unexpected, 0);
  ASSERT_GE(quarter_rss, 0);
  // Flat: what the run holds once warm does not grow with its length (under 5 % from a
  // quarter of the run to its end).
  EXPECT_LT(end_rss, quarter_rss + quarter_rss / 20)
      << "RSS grew from " << quarter_rss << " to " << end_rss << " bytes";
  EXPECT_LE(end_fds, quarter_fds + 8);

  for (Peer& peer : peers) peer.process->Signal(SIGTERM);
  for (Peer& peer : peers) (void)peer.process->Wait(absl::Seconds(20));
  (*server)->Stop();
}

}  // namespace
}  // namespace tensorverbs
