// Server::WaitForPeers against peers that are slow to take a new connection. On a host running
// hundreds of tasks on a few cores, a peer may take seconds to answer a connection's first
// bytes; a probe must wait for it, not give up on every attempt and retry forever.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
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

// Each connection to task 1 goes through a proxy that holds it 2.5 s before task 1 sees it:
// longer than gRPC's whole reconnect backoff (1 s), so a connection attempt bounded by the
// backoff would time out every time and the probe would never be answered.
TEST(PeerProbe, APeerSlowerToAnswerAConnectionThanTheReconnectBackoffIsReached) {
  absl::StatusOr<std::vector<int>> ports = PickFreePorts(2);
  ASSERT_TRUE(ports.ok()) << ports.status();
  constexpr absl::Duration kHold = absl::Milliseconds(2500);
  auto proxy = testing::DelayingProxy::Start((*ports)[1], kHold);
  ASSERT_TRUE(proxy.ok()) << proxy.status();
  const std::string cluster =
      absl::StrCat("worker=127.0.0.1:", (*ports)[0], ",127.0.0.1:", (*proxy)->port());
  ServerOptions slow = Options(cluster, 1);
  slow.listen_address = absl::StrCat("127.0.0.1:", (*ports)[1]);
  absl::StatusOr<std::unique_ptr<Server>> peer = Server::Create(slow);
  ASSERT_TRUE(peer.ok()) << peer.status();
  absl::StatusOr<std::unique_ptr<Server>> prober = Server::Create(Options(cluster, 0));
  ASSERT_TRUE(prober.ok()) << prober.status();

  const absl::Time start = absl::Now();
  const absl::Status s = (*prober)->WaitForPeers(absl::Seconds(15));
  const absl::Duration took = absl::Now() - start;
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_GE(took, kHold);
  // One attempt waited the hold out; an attempt given up early leaves another connection.
  EXPECT_LE((*proxy)->connections_seen(), 2) << "took " << took;
  (*prober)->Stop();
  (*peer)->Stop();
}

}  // namespace
}  // namespace tensorverbs
