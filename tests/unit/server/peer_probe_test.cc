// Server::WaitForPeers against peers that are slow to take a new connection. On a host running
// hundreds of tasks on a few cores, a peer may take seconds to answer a connection's first
// bytes; a probe must wait for it, not give up on every attempt and retry forever.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/common/status_macros.h"
#include "src/server/server.h"
#include "tensorverbs/placement.h"
#include "tests/support/delaying_proxy.h"

namespace tensorverbs {
namespace {

ServerOptions Options(const std::string& cluster, int task) {
  ServerOptions options;
  options.cluster = *ClusterSpec::Parse(cluster);
  options.job = "worker";
  options.task = task;
  options.protocol = "grpc";
  options.transfer.peer_timeout = absl::Seconds(10);
  return options;
}

// Task 0 (the prober) and task 1 (the peer), with every connection to task 1 through a
// DelayingProxy holding it `hold` (the first `freeze` of them going silent once set up).
struct ProxiedPair {
  std::unique_ptr<testing::DelayingProxy> proxy;
  std::unique_ptr<Server> peer;
  std::unique_ptr<Server> prober;

  static absl::StatusOr<ProxiedPair> Start(absl::Duration hold, int freeze,
                                           absl::Duration prober_peer_timeout) {
    ASSIGN_OR_RETURN(std::vector<int> ports, PickFreePorts(2));
    ProxiedPair pair;
    ASSIGN_OR_RETURN(pair.proxy, testing::DelayingProxy::Start(ports[1], hold, freeze));
    const std::string cluster =
        absl::StrCat("worker=127.0.0.1:", ports[0], ",127.0.0.1:", pair.proxy->port());
    ServerOptions peer = Options(cluster, 1);
    peer.listen_address = absl::StrCat("127.0.0.1:", ports[1]);
    ASSIGN_OR_RETURN(pair.peer, Server::Create(peer));
    ServerOptions prober = Options(cluster, 0);
    prober.transfer.peer_timeout = prober_peer_timeout;
    ASSIGN_OR_RETURN(pair.prober, Server::Create(prober));
    return pair;
  }
  ~ProxiedPair() {
    if (prober) prober->Stop();
    if (peer) peer->Stop();
  }
  ProxiedPair() = default;
  ProxiedPair(ProxiedPair&&) = default;
};

// Each connection to task 1 is held 2.5 s before task 1 sees it: longer than gRPC's whole
// reconnect backoff (1 s), so a connection attempt bounded by the backoff would time out every
// time and the probe would never be answered.
TEST(PeerProbe, APeerSlowerToAnswerAConnectionThanTheReconnectBackoffIsReached) {
  constexpr absl::Duration kHold = absl::Milliseconds(2500);
  absl::StatusOr<ProxiedPair> pair = ProxiedPair::Start(kHold, 0, absl::Seconds(10));
  ASSERT_TRUE(pair.ok()) << pair.status();
  const absl::Time start = absl::Now();
  const absl::Status s = pair->prober->WaitForPeers(absl::Seconds(15));
  const absl::Duration took = absl::Now() - start;
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_GE(took, kHold);
  // One attempt waited the hold out; an attempt given up early leaves another connection.
  EXPECT_LE(pair->proxy->connections_seen(), 2) << "took " << took;
}

// Task 1's first connection goes silent once set up, with the probe on it: the keepalive finds
// it dead after the peer timeout (1 s here) and the call fails UNAVAILABLE. The peer is slow,
// not gone; the probe asks again over a new connection and the wait succeeds.
TEST(PeerProbe, AProbeWhoseConnectionWentSilentAsksAgainUntilTheDeadline) {
  absl::StatusOr<ProxiedPair> pair =
      ProxiedPair::Start(absl::ZeroDuration(), /*freeze=*/1, absl::Seconds(1));
  ASSERT_TRUE(pair.ok()) << pair.status();
  const absl::Status s = pair->prober->WaitForPeers(absl::Seconds(20));
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_GE(pair->proxy->connections_seen(), 2) << "the first connection was not the one frozen";
}

// A task waits for the peers it names and for no other: task 2 of three never starts.
TEST(PeerProbe, WaitingForNamedPeersProbesThoseAloneAndRefusesAStranger) {
  absl::StatusOr<std::vector<int>> ports = PickFreePorts(3);
  ASSERT_TRUE(ports.ok()) << ports.status();
  const std::string cluster = absl::StrCat("worker=127.0.0.1:", (*ports)[0],
                                           ",127.0.0.1:", (*ports)[1], ",127.0.0.1:", (*ports)[2]);
  absl::StatusOr<std::unique_ptr<Server>> t0 = Server::Create(Options(cluster, 0));
  ASSERT_TRUE(t0.ok()) << t0.status();
  absl::StatusOr<std::unique_ptr<Server>> t1 = Server::Create(Options(cluster, 1));
  ASSERT_TRUE(t1.ok()) << t1.status();
  const std::string name0 = "/job:worker/replica:0/task:0";
  const std::string name1 = "/job:worker/replica:0/task:1";
  const std::string name2 = "/job:worker/replica:0/task:2";

  // Its own name is skipped, a name given twice is probed once.
  absl::Status s = (*t0)->WaitForPeers({name0, name1, name1}, absl::Seconds(10));
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE((*t0)->KnownPeerIncarnation(name1).has_value());
  EXPECT_FALSE((*t0)->KnownPeerIncarnation(name2).has_value());

  s = (*t0)->WaitForPeers(absl::Milliseconds(500));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(),
              ::testing::HasSubstr(absl::StrCat(name2, " at 127.0.0.1:", (*ports)[2])));
  EXPECT_THAT(s.message(), ::testing::Not(::testing::HasSubstr(name1 + " at")));

  s = (*t0)->WaitForPeers({name1, "/job:worker/replica:0/task:7"}, absl::Seconds(10));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), ::testing::HasSubstr("'/job:worker/replica:0/task:7'"));
  (*t0)->Stop();
  (*t1)->Stop();
}

}  // namespace
}  // namespace tensorverbs
