// Lanes over several rails: two network namespaces stand in for two hosts joined by two links
// (veth pairs on networks of their own), as hosts with two NICs. Task 0 runs here and task 1,
// a tv_test_peer process, in the namespace; each binds a further lane to its address on rail 1
// (TENSORVERBS_RAILS). A large tensor must arrive intact with segments on both lanes, which
// both ends' per-channel stats show; a peer without rails shares one lane; a rail this host
// does not have fails the start naming it. Needs root for the namespaces; skips elsewhere.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "proto/worker.grpc.pb.h"
#include "src/common/checksum.h"
#include "src/server/server.h"
#include "tensorverbs/device_name.h"
#include "tests/support/fixtures.h"
#include "tests/support/pending_recv.h"
#include "tests/support/protocol_params.h"
#include "tests/support/subprocess.h"
#include "tools/netns.h"

namespace tensorverbs {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr int64_t kRailsStep = 5;

class RailsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::OfiProviderAvailable("tcp;ofi_rxm"))
      GTEST_SKIP() << "libfabric's tcp;ofi_rxm provider is not available here";
    tools::NetnsHost::Options options;
    options.rails = 2;
    absl::StatusOr<std::unique_ptr<tools::NetnsHost>> host = tools::NetnsHost::Create(0, options);
    if (!host.ok()) GTEST_SKIP() << "no network namespaces here: " << host.status().message();
    host_ = *std::move(host);
  }

  void TearDown() override {
    if (host_ != nullptr) (void)host_->SetRailUp(1, true);
    if (peer_ != nullptr) {
      peer_->Signal(SIGTERM);
      if (!peer_->Wait(absl::Seconds(20)).ok()) peer_->Signal(SIGKILL);
    }
    server_.reset();
    peer_.reset();
    host_.reset();
  }

  // The host again, its two rails limited to `rates` (NetnsHost::Options::rate).
  void RemakeHost(const std::string& rates) {
    host_.reset();
    tools::NetnsHost::Options options;
    options.rails = 2;
    options.rate = rates;
    absl::StatusOr<std::unique_ptr<tools::NetnsHost>> host = tools::NetnsHost::Create(0, options);
    ASSERT_TRUE(host.ok()) << host.status();
    host_ = *std::move(host);
  }

  // Sends task 1 (--recv-from 0) "stream" at step kRailsStep + `i`: `bytes` filled from
  // `pattern`. Returns their CRC-32C.
  uint32_t SendStream(int i, int64_t bytes, uint32_t pattern) {
    Tensor t = Tensor::Make(DataType::kUInt8, TensorShape::Of({bytes}));
    testing::FillPattern(t, pattern);
    auto r = *server_->rendezvous_mgr()->Find(kRailsStep + i);
    const std::string key = ParsedKey::Create(server_->device_name(), server_->incarnation(),
                                              CpuDeviceName("worker", 1), "stream");
    EXPECT_TRUE(r->Send(*ParsedKey::Parse(key), t, false).ok());
    return Crc32c(t.data(), t.TotalBytes());
  }
  // What task 1 prints (--crc 1) for recv `i` of the stream that got `bytes` whose CRC-32C is
  // `crc`.
  static std::string GotLine(int i, int64_t bytes, uint32_t crc) {
    return absl::StrFormat("got %d %d %08x", i, bytes, crc);
  }

  // Task 1, a test peer in the namespace, with `peer_flags` beside its cluster place (and a lane
  // on its rail 1 where `peer_rails`); task 0 here, with a lane on its rail 1. Returns once both
  // stand and task 1 said it is ready.
  void StartPair(const std::vector<std::string>& peer_flags, bool peer_rails) {
    absl::StatusOr<std::vector<int>> ports = PickFreePorts(2);
    ASSERT_TRUE(ports.ok()) << ports.status();
    addresses_ = {absl::StrCat(host_->local_address(), ":", (*ports)[0]),
                  absl::StrCat(host_->remote_address(), ":", (*ports)[1])};
    const std::string cluster = absl::StrCat("worker=", addresses_[0], ",", addresses_[1]);
    std::vector<std::string> args = {"--cluster",  cluster,
                                     "--job",      "worker",
                                     "--task",     "1",
                                     "--step",     absl::StrCat(kRailsStep),
                                     "--dst",      CpuDeviceName("worker", 0),
                                     "--protocol", "grpc+verbs"};
    args.insert(args.end(), peer_flags.begin(), peer_flags.end());
    if (peer_rails) args.insert(args.end(), {"--rails", host_->remote_address(1)});
    std::vector<std::string> prefix = host_->ExecPrefix();
    prefix.push_back(testing::TestPeerPath());
    args.insert(args.begin(), prefix.begin() + 1, prefix.end());
    absl::StatusOr<std::unique_ptr<support::Subprocess>> peer =
        support::Subprocess::Start(prefix.front(), args);
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *std::move(peer);
    ServerOptions options;
    options.cluster = *ClusterSpec::Parse(cluster);
    options.job = "worker";
    options.task = 0;
    options.protocol = "grpc+verbs";
    options.transfer.recv_timeout = absl::Seconds(60);
    options.verbs.rails = {host_->local_address(1)};
    if (peer_timeout_ > absl::ZeroDuration()) options.transfer.peer_timeout = peer_timeout_;
    absl::StatusOr<std::unique_ptr<Server>> server = Server::Create(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_TRUE(server_->WaitForPeers(absl::Seconds(60)).ok());
    absl::StatusOr<std::string> ready = peer_->WaitForLine("ready ", absl::Seconds(60));
    ASSERT_TRUE(ready.ok()) << ready.status();
    ASSERT_TRUE(absl::SimpleHexAtoi(ready->substr(6), &peer_incarnation_)) << *ready;
  }

  // Task 1 sends the fixtures, the 64 MiB one too, once its channels stand.
  void StartFixturePair(bool peer_rails) {
    StartPair({"--seed", "7", "--big", "1", "--wait-for-peers", "1"}, peer_rails);
  }

  // Task 0 receives task 1's fixtures and checks their bytes.
  void ExpectFixtures() {
    auto r = *server_->rendezvous_mgr()->Find(kRailsStep);
    for (const testing::Fixture& f : testing::MakeFixtures(7, /*with_big=*/true)) {
      const ParsedKey key = *ParsedKey::Parse(ParsedKey::Create(
          CpuDeviceName("worker", 1), peer_incarnation_, server_->device_name(), f.name));
      PendingRecv recv(*r, key);
      ASSERT_TRUE(recv.Wait(absl::Seconds(60))) << f.name;
      ASSERT_TRUE(recv.status().ok()) << f.name << ": " << recv.status();
      EXPECT_EQ(recv.is_dead(), f.is_dead);
      const Tensor got = recv.tensor();
      if (f.is_dead || f.tensor.dtype() == DataType::kString) continue;
      ASSERT_EQ(got.TotalBytes(), f.tensor.TotalBytes()) << f.name;
      EXPECT_EQ(std::memcmp(got.data(), f.tensor.data(), got.TotalBytes()), 0) << f.name;
    }
  }

  // Task t's ready channel with the other task, as its GetStats reports it.
  proto::ChannelStats ChannelOf(int t, bool receives) {
    auto stub = proto::WorkerService::NewStub(
        grpc::CreateChannel(addresses_[t], grpc::InsecureChannelCredentials()));
    proto::GetStatsRequest request;
    proto::GetStatsResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    grpc::Status s = stub->GetStats(&context, request, &response);
    EXPECT_TRUE(s.ok()) << "task " << t << ": " << s.error_message();
    for (const proto::ChannelStats& c : response.channels()) {
      if (c.state() == "ready" && c.receives() == receives) return c;
    }
    ADD_FAILURE() << "task " << t << " has no ready " << (receives ? "recv" : "send") << " channel";
    return {};
  }

  static int64_t Counter(const proto::ChannelStats& c, const std::string& name) {
    auto it = c.counters().find(name);
    return it == c.counters().end() ? -1 : it->second;
  }

  std::unique_ptr<tools::NetnsHost> host_;
  std::unique_ptr<support::Subprocess> peer_;
  std::unique_ptr<Server> server_;
  std::vector<std::string> addresses_;
  uint64_t peer_incarnation_ = 0;
  absl::Duration peer_timeout_ = absl::ZeroDuration();  // task 0's; zero: the default
};

TEST_F(RailsTest, ALargeTensorGoesOverBothLanesAndArrivesIntact) {
  ASSERT_NO_FATAL_FAILURE(StartFixturePair(/*peer_rails=*/true));
  ASSERT_NO_FATAL_FAILURE(ExpectFixtures());
  const proto::ChannelStats recv = ChannelOf(0, /*receives=*/true);
  EXPECT_THAT(recv.fabric(), HasSubstr(absl::StrCat("lanes on ", host_->local_address(1))));
  EXPECT_THAT(recv.description(), HasSubstr("2 lanes"));
  // The 64 MiB fixture in segments, some on each lane (the small ones keep to lane 0).
  EXPECT_GT(Counter(recv, "lane0_segments_received"), 0);
  EXPECT_GT(Counter(recv, "lane1_segments_received"), 0);
  const proto::ChannelStats send = ChannelOf(1, /*receives=*/false);
  EXPECT_THAT(send.fabric(), HasSubstr(absl::StrCat("lanes on ", host_->remote_address(1))));
  const int64_t lane0 = Counter(send, "lane0_bytes_sent");
  const int64_t lane1 = Counter(send, "lane1_bytes_sent");
  // Each lane carries at least two of its segments a round, whatever the rates measured
  // (stripes.h): unlimited, these links' speeds are the two cores'.
  EXPECT_GT(lane1, int64_t{4} << 20) << "the 64 MiB fixture is shared between the lanes";
  EXPECT_GT(lane0, int64_t{4} << 20);
  EXPECT_GE(lane0 + lane1, int64_t{64} << 20);
}

// Task 1 asks for a count (TENSORVERBS_RAILS=1): of its namespace's interfaces (loopback, the
// link on its own network, and rail 1's) it takes rail 1's.
TEST_F(RailsTest, ARailCountTakesTheHostsOtherNetwork) {
  ASSERT_NO_FATAL_FAILURE(
      StartPair({"--seed", "7", "--big", "1", "--wait-for-peers", "1", "--rails", "1"},
                /*peer_rails=*/false));
  ASSERT_NO_FATAL_FAILURE(ExpectFixtures());
  const proto::ChannelStats send = ChannelOf(1, /*receives=*/false);
  EXPECT_THAT(send.fabric(), HasSubstr(absl::StrCat("lanes on ", host_->remote_address(1))));
  // Each lane carries at least two of the 64 MiB fixture's segments a round (stripes.h).
  EXPECT_GT(Counter(send, "lane1_bytes_sent"), int64_t{4} << 20);
}

TEST_F(RailsTest, APeerWithoutRailsSharesOneLane) {
  ASSERT_NO_FATAL_FAILURE(StartFixturePair(/*peer_rails=*/false));
  ASSERT_NO_FATAL_FAILURE(ExpectFixtures());
  const proto::ChannelStats recv = ChannelOf(0, /*receives=*/true);
  EXPECT_THAT(recv.fabric(), Not(HasSubstr("lanes on")));
  EXPECT_EQ(Counter(recv, "lane1_segments_received"), -1) << "no lane 1 to count";
}

// Task 0 here sends a stream of 64 MiB tensors to task 1 in the namespace, both with a lane on
// rail 1, each rail at 1 Gbit/s; rail 1 goes down after the first has arrived. Every recv ends
// once, with the right bytes (task 1 prints each one's CRC-32C) or an error naming the lane; the
// channel takes lane 1 out and the stream goes on over rail 0, on that channel.
TEST_F(RailsTest, ARailThatGoesDownMidStreamEndsEachRecvOnceAndTheStreamGoesOn) {
  constexpr int kTensors = 8;
  ASSERT_NO_FATAL_FAILURE(RemakeHost("1gbit"));
  ASSERT_NO_FATAL_FAILURE(
      StartPair({"--recv-from", "0", "--recv-steps", absl::StrCat(kTensors), "--crc", "1"},
                /*peer_rails=*/true));

  std::vector<uint32_t> sums;
  for (int i = 1; i <= kTensors; ++i) {
    sums.push_back(SendStream(i, int64_t{64} << 20, static_cast<uint32_t>(100 + i)));
  }
  int got = 0, failed = 0, got_after_failure = 0;
  for (int i = 1; i <= kTensors; ++i) {
    absl::StatusOr<std::string> line = peer_->ReadLine(absl::Seconds(90));
    ASSERT_TRUE(line.ok()) << "recv " << i << " of the stream never ended: " << line.status();
    std::printf("%s\n", line->c_str());
    const std::vector<std::string> f = absl::StrSplit(*line, ' ');
    ASSERT_GE(f.size(), 2u) << *line;
    ASSERT_EQ(f[1], absl::StrCat(i)) << "each recv ends once, in order: " << *line;
    if (f[0] == "got") {
      ASSERT_EQ(f.size(), 4u) << *line;
      EXPECT_EQ(f[2], absl::StrCat(int64_t{64} << 20)) << *line;
      EXPECT_EQ(f[3], absl::StrFormat("%08x", sums[i - 1])) << "wrong bytes in recv " << i;
      ++got;
      if (failed > 0) ++got_after_failure;
    } else {
      EXPECT_EQ(f[0], "failed") << *line;
      ++failed;
    }
    if (i == 1) {
      ASSERT_TRUE(host_->SetRailUp(1, false).ok());
    }
  }
  std::printf("%d of %d arrived, %d failed, %d arrived after the first failure\n", got, kTensors,
              failed, got_after_failure);
  EXPECT_GE(failed, 1) << "rail 1 went down under the stream";
  EXPECT_GE(got_after_failure, 1) << "the stream goes on over rail 0";
  // On the same channel: lane 1 was taken out of it, and it carried every recv.
  const proto::ChannelStats recv = ChannelOf(1, /*receives=*/true);
  EXPECT_THAT(recv.description(), Not(HasSubstr("lanes")));
  EXPECT_EQ(Counter(recv, "tensors_received"), got);
  EXPECT_EQ(Counter(recv, "recv_errors"), failed);
}

// Rails of different speeds (as a host with a 100G and a 25G NIC): the receiver measures each
// lane's rate from the first tensor, and the next ones give rail 1, a quarter as fast, about a
// fifth of their bytes (TENSORVERBS_STRIPE_SHARES=rate), where going round the lanes evenly
// would give it half and leave rail 0 idle half the time.
TEST_F(RailsTest, ASlowerRailCarriesASmallerShareOfEachTensor) {
  constexpr int kTensors = 6;
  constexpr int64_t kBytes = int64_t{16} << 20;
  ASSERT_NO_FATAL_FAILURE(RemakeHost("1gbit,250mbit"));
  ASSERT_NO_FATAL_FAILURE(
      StartPair({"--recv-from", "0", "--recv-steps", absl::StrCat(kTensors), "--crc", "1"},
                /*peer_rails=*/true));
  for (int i = 1; i <= kTensors; ++i) {
    const uint32_t crc = SendStream(i, kBytes, static_cast<uint32_t>(200 + i));
    absl::StatusOr<std::string> line = peer_->ReadLine(absl::Seconds(60));
    ASSERT_TRUE(line.ok()) << "recv " << i << " never ended: " << line.status();
    EXPECT_EQ(*line, GotLine(i, kBytes, crc));
  }
  const proto::ChannelStats send = ChannelOf(0, /*receives=*/false);
  const int64_t lane0 = Counter(send, "lane0_bytes_sent");
  const int64_t lane1 = Counter(send, "lane1_bytes_sent");
  std::printf("lane 0 carried %lld bytes, lane 1 %lld\n", static_cast<long long>(lane0),
              static_cast<long long>(lane1));
  EXPECT_EQ(lane0 + lane1, kTensors * kBytes);
  // The first tensor half and half (nothing measured yet), or kept to lane 0 where its recv
  // asked before lane 1's probe came back (the next then goes half and half); the others
  // about 13 to 3: near a quarter in all, against a half had each tensor been split evenly.
  EXPECT_GT(lane1, kBytes / 2) << "rail 1 still carries its share";
  EXPECT_LT(lane1, kTensors * kBytes * 35 / 100) << "rail 1 is a quarter as fast as rail 0";
}

// A rail that failed and came back is used again: once the back-off after the failure ran out
// (twice the peer timeout, 1.5 s here at both ends), the receiver gives its channel back while
// it is quiet (between recvs), and the next recv sets one up with both lanes. That recv's
// tensor keeps to lane 0 (it asks before lane 1's probe came back); the next is spread.
TEST_F(RailsTest, ARailThatComesBackIsUsedAgainByTheNextChannel) {
  constexpr int64_t kBytes = int64_t{16} << 20;
  peer_timeout_ = absl::Milliseconds(1500);
  ASSERT_NO_FATAL_FAILURE(StartPair({"--recv-from", "0", "--recv-steps", "4", "--crc", "1",
                                     "--recv-gap-ms", "4000", "--peer-timeout-ms", "1500"},
                                    /*peer_rails=*/true));
  // The line task 1 prints once it got tensor `i` whole. Sent before its line is read: the
  // two are separate statements, since the operands of one comparison may go in either order.
  auto send = [&](int i) {
    return GotLine(i, kBytes, SendStream(i, kBytes, static_cast<uint32_t>(300 + i)));
  };
  auto line = [&](int i) {
    absl::StatusOr<std::string> l = peer_->ReadLine(absl::Seconds(60));
    EXPECT_TRUE(l.ok()) << "recv " << i << " never ended: " << l.status();
    std::printf("%s\n", l.ok() ? l->c_str() : "");
    return l.ok() ? *l : "";
  };
  // Both lanes carry the first; the second is lost on rail 1, which then comes back.
  const std::string first = send(1);
  ASSERT_EQ(line(1), first);
  ASSERT_TRUE(host_->SetRailUp(1, false).ok());
  send(2);
  EXPECT_THAT(line(2), HasSubstr("failed 2"));
  EXPECT_THAT(ChannelOf(1, /*receives=*/true).description(), Not(HasSubstr("lanes")));
  ASSERT_TRUE(host_->SetRailUp(1, true).ok());
  // The third, sent at once, is taken by a recv that starts after the gap, on a new channel.
  const std::string third = send(3);
  ASSERT_EQ(line(3), third);
  const std::string fourth = send(4);
  ASSERT_EQ(line(4), fourth);
  const proto::ChannelStats recv = ChannelOf(1, /*receives=*/true);
  EXPECT_THAT(recv.description(), HasSubstr("2 lanes"));
  EXPECT_GT(Counter(recv, "lane1_segments_received"), 0) << "rail 1 carries its share again";
  EXPECT_EQ(Counter(recv, "tensors_received"), 2) << "the new channel's tensors";
}

TEST(RailsStartTest, ARailThisHostLacksOrTooManyRailsFailTheStartNamingThem) {
  if (!testing::OfiProviderAvailable("tcp;ofi_rxm"))
    GTEST_SKIP() << "libfabric's tcp;ofi_rxm provider is not available here";
  absl::StatusOr<std::vector<int>> ports = PickFreePorts(2);
  ASSERT_TRUE(ports.ok()) << ports.status();
  ServerOptions options;
  options.cluster = *ClusterSpec::Parse(
      absl::StrCat("worker=127.0.0.1:", (*ports)[0], ",127.0.0.1:", (*ports)[1]));
  options.job = "worker";
  options.task = 0;
  options.protocol = "grpc+verbs";
  options.verbs.fabric = "ofi";
  options.verbs.ofi_provider = "tcp;ofi_rxm";
  // An address of no interface here (TEST-NET-2, RFC 5737).
  options.verbs.rails = {"198.51.100.7"};
  absl::StatusOr<std::unique_ptr<Server>> missing = Server::Create(options);
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("the rail 198.51.100.7 of TENSORVERBS_RAILS"));
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("no interface with address"));
  // An interface by name opens (libfabric's tcp names its domains after the interfaces).
  options.verbs.rails = {"lo"};
  absl::StatusOr<std::unique_ptr<Server>> named = Server::Create(options);
  ASSERT_TRUE(named.ok()) << named.status();
  (*named)->Stop();
  options.verbs.rails = {"127.0.0.1", "127.0.0.1", "127.0.0.1", "127.0.0.1"};
  absl::StatusOr<std::unique_ptr<Server>> many = Server::Create(options);
  ASSERT_FALSE(many.ok());
  EXPECT_EQ(many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(many.status().message()), HasSubstr("at most 3 beside its first"));
}

}  // namespace
}  // namespace tensorverbs
