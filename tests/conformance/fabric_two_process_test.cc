// The fabric between two real processes, over the shmem fabric (into shared and private memory),
// libfabric shm and tcp;ofi_rxm: data and immediates arrive, a killed peer shows up as errors
// within a bounded time, never a hang, and the shmem fabric leaves nothing behind it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/common/checksum.h"
#include "src/fabric/fabric.h"
#include "tests/support/shm_regions.h"
#include "tests/support/subprocess.h"

namespace tensorverbs::fabric {
namespace {

using testing::Subprocess;

struct Case {
  std::string backend;
  std::string provider;
  bool shared;  // the peer's buffer comes from SharedMemory
  std::string name;
};

class FabricTwoProcessTest : public ::testing::TestWithParam<Case> {};

TEST_P(FabricTwoProcessTest, WritesLandAndAKilledPeerIsAnErrorWithinBoundedTime) {
  DomainOptions options;
  options.provider = GetParam().provider;
  options.source_address = "127.0.0.1";  // not another test's veth (fabric.h)
  options.op_timeout = absl::Seconds(3);
  absl::StatusOr<std::unique_ptr<Domain>> domain = OpenDomain(GetParam().backend, options);
  if (absl::IsUnavailable(domain.status())) GTEST_SKIP() << domain.status();
  ASSERT_TRUE(domain.ok()) << domain.status();
  auto ep = *(*domain)->CreateEndpoint();

  constexpr size_t kSize = 1 << 20;
  auto peer = support::Subprocess::Start(
      TV_FABRIC_PEER_PATH,
      {"--backend", GetParam().backend, "--provider", GetParam().provider, "--source", "127.0.0.1", "--check",
       absl::StrCat(kSize), "--shared", GetParam().shared ? "1" : "0"});
  ASSERT_TRUE(peer.ok());
  absl::StatusOr<std::string> hello = (*peer)->WaitForLine("address ", absl::Seconds(30));
  ASSERT_TRUE(hello.ok()) << hello.status();
  std::vector<std::string> f = absl::StrSplit(*hello, ' ');
  ASSERT_EQ(f.size(), 6u) << *hello;
  ASSERT_TRUE(ep->Connect(absl::HexStringToBytes(f[1])).ok());
  RemoteBuffer remote{absl::HexStringToBytes(f[3]), 0, kSize};
  ASSERT_TRUE(absl::SimpleAtoi(f[5], &remote.addr));
  // Tell the peer our address so it can connect back.
  ASSERT_TRUE(support::WriteLine(**peer, absl::BytesToHexString(ep->LocalAddress())));

  void* src = mmap(nullptr, kSize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  for (size_t i = 0; i < kSize; ++i) static_cast<char*>(src)[i] = static_cast<char>(i * 13 + 1);
  auto mr = *(*domain)->RegisterMemory(src, kSize, kAccessLocal);

  auto poll_one = [&](absl::Duration timeout) -> absl::StatusOr<Completion> {
    absl::Time deadline = absl::Now() + timeout;
    Completion c[4];
    while (absl::Now() < deadline) {
      absl::StatusOr<size_t> n = (*domain)->Poll(absl::MakeSpan(c));
      if (!n.ok()) return n.status();
      if (*n > 0) return c[0];
    }
    return absl::DeadlineExceededError("no completion");
  };

  ASSERT_TRUE(ep->PostWriteWithImm({mr.get(), src, kSize}, remote, 4242, 1).ok());
  absl::StatusOr<Completion> local = poll_one(absl::Seconds(20));
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_TRUE(local->status.ok()) << local->status;
  absl::StatusOr<std::string> got = (*peer)->WaitForLine("imm ", absl::Seconds(20));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, absl::StrCat("imm 4242 crc ", Crc32c(src, kSize)));

  const pid_t peer_pid = (*peer)->pid();
  (*peer)->Signal(SIGKILL);
  ASSERT_TRUE((*peer)->Wait(absl::Seconds(10)).ok());
  if (GetParam().backend == "shmem") {
    // Its memory was memfds and its socket abstract: the kernel took all of it with the process.
    EXPECT_THAT(testing::ShmRegionsOf(peer_pid), ::testing::IsEmpty());
  }
  testing::UnlinkShmRegionsOf(peer_pid);
  // A fabric learns of the death asynchronously (the shmem fabric checks its peers every 10 ms,
  // and until then a write into the dead peer's still-mapped memory is a plain copy), so the
  // contract is an error within a bounded time, not on the first write: keep writing until one
  // fails.
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + absl::Seconds(25);
  absl::Status last;
  for (int i = 0; last.ok() && absl::Now() < deadline; ++i) {
    absl::Status posted = ep->PostWriteWithImm({mr.get(), src, kSize}, remote, i, 10 + i);
    if (!posted.ok()) {
      last = posted;
      break;
    }
    absl::StatusOr<Completion> c = poll_one(absl::Seconds(20));
    ASSERT_TRUE(c.ok()) << "write " << i << " to the killed peer never completed";
    last = c->status;
    if (last.ok()) absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_FALSE(last.ok()) << "writes to a killed peer looked successful for 25 s";
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  munmap(src, kSize);
}

// The shmem fabric's boundary is the user: a process of another user neither connects to us nor
// is connected to, and each side says why.
TEST(ShmemTwoUsersTest, AProcessOfAnotherUserIsRefusedBothWays) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run the peer as another user";
  if (access("/usr/bin/setpriv", X_OK) != 0) GTEST_SKIP() << "needs setpriv (util-linux)";
  absl::StatusOr<std::unique_ptr<Domain>> domain = OpenDomain("shmem", DomainOptions());
  ASSERT_TRUE(domain.ok()) << domain.status();
  auto ep = *(*domain)->CreateEndpoint();
  auto peer = support::Subprocess::Start(
      "/usr/bin/setpriv", {"--reuid=65534", "--regid=65534", "--clear-groups", TV_FABRIC_PEER_PATH,
                           "--backend", "shmem", "--shared", "1", "--check", "64"});
  ASSERT_TRUE(peer.ok()) << peer.status();
  absl::StatusOr<std::string> hello = (*peer)->WaitForLine("address ", absl::Seconds(30));
  if (!hello.ok()) {
    GTEST_SKIP() << "the peer did not start as user 65534 (can it reach " << TV_FABRIC_PEER_PATH
                 << "?): " << hello.status();
  }
  std::vector<std::string> f = absl::StrSplit(*hello, ' ');
  ASSERT_EQ(f.size(), 6u) << *hello;
  absl::Status s = ep->Connect(absl::HexStringToBytes(f[1]));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("user 65534")) << s;
  // And its attempt to connect to us is refused by our descriptor server: it gives up.
  ASSERT_TRUE(support::WriteLine(**peer, absl::BytesToHexString(ep->LocalAddress())));
  absl::StatusOr<int> code = (*peer)->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << "the refused peer kept running: " << code.status();
  EXPECT_NE(*code, 0);
}

INSTANTIATE_TEST_SUITE_P(Providers, FabricTwoProcessTest,
                         ::testing::Values(Case{"shmem", "", true, "shmem"},
                                           Case{"shmem", "", false, "shmem_cross_memory"},
                                           Case{"ofi", "shm", false, "shm"},
                                           Case{"ofi", "tcp;ofi_rxm", false, "tcp"}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace tensorverbs::fabric
