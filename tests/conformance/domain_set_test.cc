// DomainSet (src/fabric/domain_set.h): one progress thread driving the same-host shmem fabric
// and libfabric tcp;ofi_rxm (or a second shmem domain, where tcp is missing) as one domain, as a
// task whose peers sit on its host and on others does. The set's side ("a") is polled and slept
// on through the set only; each member's peer ("b") is driven by the test thread. Also: the
// libfabric rxm defaults the ofi backend sets for the many endpoints a cluster opens.
#include "src/fabric/domain_set.h"

#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/time/clock.h"

namespace tensorverbs::fabric {
namespace {

constexpr size_t kBytes = 1 << 16;

// One member of the set and its peer: a connected endpoint pair and a registered buffer each.
struct Pair {
  std::unique_ptr<Domain> a, b;
  std::unique_ptr<Endpoint> ea, eb;
  char* a_buf = nullptr;
  char* b_buf = nullptr;
  std::unique_ptr<MemoryRegion> a_mr, b_mr;

  ~Pair() {
    a_mr.reset();
    b_mr.reset();
    if (a_buf != nullptr) munmap(a_buf, kBytes);
    if (b_buf != nullptr) munmap(b_buf, kBytes);
  }
  // b writes `bytes` of `fill` into a's buffer, announcing it with `imm`.
  absl::Status WriteToA(char fill, size_t bytes, uint32_t imm) {
    std::memset(b_buf, fill, bytes);
    return eb->PostWriteWithImm({b_mr.get(), b_buf, bytes},
                                {a_mr->PackRemoteKey(), reinterpret_cast<uint64_t>(a_buf), kBytes},
                                imm, imm);
  }
  // Drives b's side (its write completions; manual-progress providers need it).
  void PollB() {
    Completion c[8];
    (void)b->Poll(absl::MakeSpan(c));
  }
};

absl::StatusOr<std::unique_ptr<Pair>> OpenPair(const std::string& backend,
                                               const std::string& provider) {
  DomainOptions options;
  options.provider = provider;
  options.source_address = "127.0.0.1";  // not another test's veth (fabric.h)
  auto p = std::make_unique<Pair>();
  absl::StatusOr<std::unique_ptr<Domain>> a = OpenDomain(backend, options);
  if (!a.ok()) return a.status();
  p->a = *std::move(a);
  absl::StatusOr<std::unique_ptr<Domain>> b = OpenDomain(backend, options);
  if (!b.ok()) return b.status();
  p->b = *std::move(b);
  p->ea = *p->a->CreateEndpoint();
  p->eb = *p->b->CreateEndpoint();
  if (absl::Status s = p->ea->Connect(p->eb->LocalAddress()); !s.ok()) return s;
  if (absl::Status s = p->eb->Connect(p->ea->LocalAddress()); !s.ok()) return s;
  for (char** buf : {&p->a_buf, &p->b_buf}) {
    *buf = static_cast<char*>(
        mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    std::memset(*buf, 0, kBytes);
  }
  const uint32_t access = kAccessRemoteWrite;
  absl::StatusOr<std::unique_ptr<MemoryRegion>> a_mr =
      p->a->RegisterMemory(p->a_buf, kBytes, access);
  if (!a_mr.ok()) return a_mr.status();
  p->a_mr = *std::move(a_mr);
  absl::StatusOr<std::unique_ptr<MemoryRegion>> b_mr =
      p->b->RegisterMemory(p->b_buf, kBytes, access);
  if (!b_mr.ok()) return b_mr.status();
  p->b_mr = *std::move(b_mr);
  return p;
}

class DomainSetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Pair>> local = OpenPair("shmem", "");
    ASSERT_TRUE(local.ok()) << local.status();
    pairs_.push_back(*std::move(local));
    absl::StatusOr<std::unique_ptr<Pair>> remote = OpenPair("ofi", "tcp;ofi_rxm");
    if (!remote.ok()) {
      std::printf("no libfabric tcp here (%s): a second shmem domain stands in\n",
                  std::string(remote.status().message()).c_str());
      remote = OpenPair("shmem", "");
    }
    ASSERT_TRUE(remote.ok()) << remote.status();
    pairs_.push_back(*std::move(remote));
    set_ =
        std::make_unique<DomainSet>(std::vector<Domain*>{pairs_[0]->a.get(), pairs_[1]->a.get()});
  }

  // Polls the set (and the peers) until it gave `count` completions or 20 s passed.
  std::vector<Completion> PollSet(size_t count) {
    std::vector<Completion> got;
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (got.size() < count && absl::Now() < deadline) {
      for (auto& p : pairs_) p->PollB();
      Completion c[8];
      absl::StatusOr<size_t> n = set_->Poll(absl::MakeSpan(c));
      EXPECT_TRUE(n.ok()) << n.status();
      if (n.ok()) got.insert(got.end(), c, c + *n);
    }
    return got;
  }

  std::vector<std::unique_ptr<Pair>> pairs_;
  std::unique_ptr<DomainSet> set_;
};

TEST_F(DomainSetTest, CompletionsOfEveryMemberComeOutOfTheSetsPoll) {
  ASSERT_TRUE(pairs_[0]->WriteToA('L', 4096, 11).ok());
  ASSERT_TRUE(pairs_[1]->WriteToA('R', 8192, 22).ok());
  std::vector<Completion> got = PollSet(2);
  ASSERT_EQ(got.size(), 2u);
  for (const Completion& c : got) {
    ASSERT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(c.kind, CompletionKind::kRemoteWriteImm);
    // Each names the member's own endpoint, so the caller finds its channel as with one domain.
    EXPECT_EQ(c.endpoint, c.imm == 11 ? pairs_[0]->ea.get() : pairs_[1]->ea.get()) << c.imm;
  }
  EXPECT_EQ(pairs_[0]->a_buf[4095], 'L');
  EXPECT_EQ(pairs_[1]->a_buf[8191], 'R');
}

TEST_F(DomainSetTest, ABusyMemberDoesNotStarveTheOther) {
  // Two shmem members, whose completions are ready as soon as they landed (tcp's need polls of
  // their own to progress): 16 wait on the first, one on the second, and polls of one
  // completion at a time still reach the second within two polls.
  absl::StatusOr<std::unique_ptr<Pair>> busy = OpenPair("shmem", "");
  absl::StatusOr<std::unique_ptr<Pair>> quiet = OpenPair("shmem", "");
  ASSERT_TRUE(busy.ok() && quiet.ok());
  DomainSet set({(*busy)->a.get(), (*quiet)->a.get()});
  for (uint32_t i = 0; i < 16; ++i) ASSERT_TRUE((*busy)->WriteToA('x', 64, 100 + i).ok());
  ASSERT_TRUE((*quiet)->WriteToA('y', 64, 7).ok());
  absl::SleepFor(absl::Milliseconds(100));  // everything lands
  std::vector<uint32_t> order;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (order.size() < 17 && absl::Now() < deadline) {
    (*busy)->PollB();
    (*quiet)->PollB();
    Completion c[1];
    absl::StatusOr<size_t> n = set.Poll(absl::MakeSpan(c));
    ASSERT_TRUE(n.ok()) << n.status();
    if (*n == 1) order.push_back(c[0].imm);
  }
  ASSERT_EQ(order.size(), 17u);
  size_t at = 0;
  while (at < order.size() && order[at] != 7) ++at;
  EXPECT_LT(at, 2u) << "the second member's completion came " << at + 1 << "th";
}

TEST_F(DomainSetTest, AWriteOnEitherMemberEndsTheSetsSleep) {
  for (int member = 0; member < 2; ++member) {
    Pair& p = *pairs_[member];
    std::thread writer([&p] {
      absl::SleepFor(absl::Milliseconds(100));
      ASSERT_TRUE(p.WriteToA('w', 256, 5).ok());
      // The writer's side may need progress to send (manual progress).
      const absl::Time until = absl::Now() + absl::Milliseconds(500);
      while (absl::Now() < until) p.PollB();
    });
    std::vector<Completion> got;
    const absl::Time start = absl::Now();
    while (got.empty() && absl::Now() - start < absl::Seconds(20)) {
      ASSERT_TRUE(set_->Wait(absl::Seconds(10)).ok());
      Completion c[4];
      absl::StatusOr<size_t> n = set_->Poll(absl::MakeSpan(c));
      ASSERT_TRUE(n.ok()) << n.status();
      got.insert(got.end(), c, c + *n);
    }
    writer.join();
    ASSERT_EQ(got.size(), 1u) << "member " << member;
    EXPECT_EQ(got[0].endpoint, p.ea.get());
    EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "member " << member << "'s write did not "
                                                     << "end the sleep";
  }
}

TEST_F(DomainSetTest, AnIdleSetSleepsAndAnInterruptEndsTheSleep) {
  const absl::Time start = absl::Now();
  ASSERT_TRUE(set_->Wait(absl::Milliseconds(300)).ok());
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(1)) << "an idle set did not sleep at all";
  std::thread waker([this] {
    absl::SleepFor(absl::Milliseconds(50));
    set_->Interrupt();
  });
  const absl::Time again = absl::Now();
  ASSERT_TRUE(set_->Wait(absl::Seconds(20)).ok());
  waker.join();
  EXPECT_LT(absl::Now() - again, absl::Seconds(10)) << "Interrupt did not end the set's sleep";
}

TEST_F(DomainSetTest, AMemberWithNoFdToSleepOnIsStillPolled) {
  // Loopback sleeps on a condition, not an fd: the set naps instead, and its completions come.
  absl::StatusOr<std::unique_ptr<Pair>> loop = OpenPair("loopback", "");
  ASSERT_TRUE(loop.ok()) << loop.status();
  Pair& l = **loop;
  DomainSet set({pairs_[0]->a.get(), l.a.get()});
  ASSERT_TRUE(l.WriteToA('q', 128, 9).ok());
  std::vector<Completion> got;
  const absl::Time start = absl::Now();
  while (got.empty() && absl::Now() - start < absl::Seconds(20)) {
    l.PollB();
    ASSERT_TRUE(set.Wait(absl::Seconds(10)).ok());
    Completion c[4];
    absl::StatusOr<size_t> n = set.Poll(absl::MakeSpan(c));
    ASSERT_TRUE(n.ok()) << n.status();
    got.insert(got.end(), c, c + *n);
  }
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].imm, 9u);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

}  // namespace
}  // namespace tensorverbs::fabric

namespace tensorverbs::fabric {
namespace {

// libfabric's rxm layer would give every endpoint (one per channel) 64 MiB of receive bounce
// buffers; the ofi backend asks for 256 of 2 KiB instead, unless the user set the variables.
TEST(OfiRxmDefaultsTest, SmallReceiveBuffersUnlessTheUserSetThem) {
  setenv("FI_OFI_RXM_EAGER_LIMIT", "16384", /*overwrite=*/1);
  DomainOptions options;
  options.provider = "tcp;ofi_rxm";
  absl::StatusOr<std::unique_ptr<Domain>> d = OpenDomain("ofi", options);
  if (absl::IsUnavailable(d.status())) GTEST_SKIP() << d.status();
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_NE(getenv("FI_OFI_RXM_BUFFER_SIZE"), nullptr);
  EXPECT_STREQ(getenv("FI_OFI_RXM_BUFFER_SIZE"), "2048");
  EXPECT_STREQ(getenv("FI_OFI_RXM_MSG_RX_SIZE"), "256");
  EXPECT_STREQ(getenv("FI_OFI_RXM_EAGER_LIMIT"), "16384") << "the user's value was overwritten";
}

// tcp lists one fabric per interface, in the kernel's order: another job's veth can come before
// eth0 and lo, and go away under an endpoint bound to it. With a source address (a task's host
// in the cluster spec) the endpoints bind to the interface that holds it.
TEST(OfiSourceAddressTest, EndpointsBindToTheInterfaceThatHoldsIt) {
  DomainOptions options;
  options.provider = "tcp;ofi_rxm";
  options.source_address = "127.0.0.1";
  absl::StatusOr<std::unique_ptr<Domain>> d = OpenDomain("ofi", options);
  if (absl::IsUnavailable(d.status())) GTEST_SKIP() << d.status();
  ASSERT_TRUE(d.ok()) << d.status();
  absl::StatusOr<std::unique_ptr<Endpoint>> ep = (*d)->CreateEndpoint();
  ASSERT_TRUE(ep.ok()) << ep.status();
  const std::string name = (*ep)->LocalAddress();
  ASSERT_GE(name.size(), sizeof(sockaddr_in));
  sockaddr_in sin{};
  std::memcpy(&sin, name.data(), sizeof(sin));
  EXPECT_EQ(sin.sin_family, AF_INET);
  EXPECT_EQ(ntohl(sin.sin_addr.s_addr), INADDR_LOOPBACK);
  EXPECT_NE(sin.sin_port, 0) << "the endpoint listens on a port of its own";
}

// An address no interface here holds (a host name that resolves elsewhere, behind NAT) is not
// an error: the provider's first interface serves, as without one.
TEST(OfiSourceAddressTest, AnAddressNotHereFallsBackToTheFirstInterface) {
  DomainOptions options;
  options.provider = "tcp;ofi_rxm";
  options.source_address = "203.0.113.77";  // TEST-NET-3: on no interface
  absl::StatusOr<std::unique_ptr<Domain>> d = OpenDomain("ofi", options);
  if (absl::IsUnavailable(d.status())) GTEST_SKIP() << d.status();
  ASSERT_TRUE(d.ok()) << d.status();
  absl::StatusOr<std::unique_ptr<Endpoint>> ep = (*d)->CreateEndpoint();
  ASSERT_TRUE(ep.ok()) << ep.status();
  EXPECT_FALSE((*ep)->LocalAddress().empty());
}

// shm names endpoints itself: a source address would become every endpoint's name, so the
// backend does not pass it there, and two endpoints still get names of their own.
TEST(OfiSourceAddressTest, SharedMemoryProviderIgnoresIt) {
  DomainOptions options;
  options.provider = "shm";
  options.source_address = "127.0.0.1";
  absl::StatusOr<std::unique_ptr<Domain>> d = OpenDomain("ofi", options);
  if (absl::IsUnavailable(d.status())) GTEST_SKIP() << d.status();
  ASSERT_TRUE(d.ok()) << d.status();
  absl::StatusOr<std::unique_ptr<Endpoint>> a = (*d)->CreateEndpoint();
  absl::StatusOr<std::unique_ptr<Endpoint>> b = (*d)->CreateEndpoint();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE((*a)->LocalAddress(), (*b)->LocalAddress());
}

}  // namespace
}  // namespace tensorverbs::fabric
