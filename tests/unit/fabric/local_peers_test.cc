// LocalPeers: this process's ofi endpoints by address, and the gates that refuse posts to one
// that closed.
#include "src/fabric/ofi/local_peers.h"

#include <atomic>
#include <mutex>
#include <shared_mutex>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace tensorverbs::fabric::ofi {
namespace {

TEST(LocalPeersTest, AnAddressIsFoundWhileItsEndpointIsOpenAndAReusedOneGetsANewGate) {
  LocalPeers& peers = LocalPeers::Get();
  const std::string address = "fi_test://local-peers-1";
  EXPECT_EQ(peers.Find(address), nullptr) << "a peer elsewhere has no gate";
  std::shared_ptr<LocalPeers::Gate> first = peers.Open(address);
  EXPECT_EQ(peers.Find(address), first);
  std::shared_ptr<LocalPeers::Gate> kept = peers.Find(address);  // a connected peer's
  peers.Close(address, first);
  EXPECT_EQ(peers.Find(address), nullptr);
  EXPECT_FALSE(kept->open);
  // A new endpoint at the same address (a reused tcp port) is another peer.
  std::shared_ptr<LocalPeers::Gate> second = peers.Open(address);
  EXPECT_NE(second, first);
  EXPECT_TRUE(second->open);
  EXPECT_FALSE(kept->open) << "a connection made to the closed endpoint stays refused";
  // Closing the old gate again does not forget the new endpoint.
  peers.Close(address, first);
  EXPECT_EQ(peers.Find(address), second);
  peers.Close(address, second);
}

TEST(LocalPeersTest, ClosingWaitsForAPostUnderWay) {
  LocalPeers& peers = LocalPeers::Get();
  const std::string address = "fi_test://local-peers-2";
  std::shared_ptr<LocalPeers::Gate> gate = peers.Open(address);
  std::atomic<bool> posting{false}, closed{false};
  std::thread poster([&] {
    std::shared_lock<std::shared_mutex> open(gate->mu);
    posting = true;
    absl::SleepFor(absl::Milliseconds(100));  // inside the provider's post
    EXPECT_FALSE(closed.load()) << "the endpoint closed under a post to it";
  });
  while (!posting) absl::SleepFor(absl::Milliseconds(1));
  peers.Close(address, gate);
  closed = true;
  poster.join();
  EXPECT_FALSE(gate->open);
}

}  // namespace
}  // namespace tensorverbs::fabric::ofi
