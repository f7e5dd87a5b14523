// The fabric contract (src/fabric/fabric.h), checked on every backend that can run here:
// loopback and shmem always, ofi shm and ofi tcp;ofi_rxm where libfabric provides them. Two domains
// in this process play the two peers; the test thread drives both.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <iostream>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/common/shared_memory.h"
#include "src/fabric/fabric.h"
#include "src/fabric/loopback/loopback.h"
#include "tests/support/shm_regions.h"

namespace tensorverbs::fabric {
namespace {

using ::testing::HasSubstr;

// Whether the running backend's buffers come from SharedMemory (set by the fixture).
bool g_shared_buffers = false;

// Page-aligned, pre-touched memory: private, or SharedMemory where the backend maps peers'
// memory and the case covers that path.
class Buffer {
 public:
  explicit Buffer(size_t size) : size_(size) {
    if (g_shared_buffers) {
      shared_ = *SharedMemory::Create(size, "fabric-conformance");
      ptr_ = static_cast<char*>(shared_->data());
    } else {
      ptr_ = static_cast<char*>(
          mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    }
    std::memset(ptr_, 0, size);
  }
  ~Buffer() {
    if (shared_ == nullptr) munmap(ptr_, size_);
  }
  char* data() { return ptr_; }
  size_t size() const { return size_; }

 private:
  std::unique_ptr<SharedMemory> shared_;
  char* ptr_;
  size_t size_;
};

struct Backend {
  std::string backend;
  std::string provider;
  std::string name;
  bool shared_buffers = false;
  bool shared_endpoint = true;  // DomainOptions::ofi_shared_endpoint
};

std::ostream& operator<<(std::ostream& os, const Backend& b) { return os << b.name; }

class FabricConformanceTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    g_shared_buffers = GetParam().shared_buffers;
    ASSERT_NO_FATAL_FAILURE(Open(DomainOptions()));
  }

  void Open(DomainOptions options) {
    options.provider = GetParam().provider;
    options.ofi_shared_endpoint = GetParam().shared_endpoint;
    // Both domains in this process: loopback, not whichever interface tcp lists first (another
    // test's veth, deleted under the endpoints when that test ends).
    options.source_address = "127.0.0.1";
    absl::StatusOr<std::unique_ptr<Domain>> a = OpenDomain(GetParam().backend, options);
    if (absl::IsUnavailable(a.status())) GTEST_SKIP() << a.status();
    ASSERT_TRUE(a.ok()) << a.status();
    a_ = *std::move(a);
    b_ = *OpenDomain(GetParam().backend, options);
    ea_ = *a_->CreateEndpoint();
    eb_ = *b_->CreateEndpoint();
    ASSERT_TRUE(ea_->Connect(eb_->LocalAddress()).ok());
    ASSERT_TRUE(eb_->Connect(ea_->LocalAddress()).ok());
  }

  // Polls both domains until `done()` or `timeout`; collects completions.
  template <typename Pred>
  bool PollUntil(Pred done, absl::Duration timeout = absl::Seconds(30)) {
    absl::Time deadline = absl::Now() + timeout;
    Completion batch[64];
    while (true) {
      for (auto [domain, sink] : {std::pair{a_.get(), &at_a_}, std::pair{b_.get(), &at_b_}}) {
        if (domain == nullptr) continue;
        absl::StatusOr<size_t> n = domain->Poll(absl::MakeSpan(batch));
        EXPECT_TRUE(n.ok()) << n.status();
        if (n.ok()) sink->insert(sink->end(), batch, batch + *n);
      }
      if (done()) return true;
      if (absl::Now() > deadline) return false;
    }
  }

  RemoteBuffer Remote(const MemoryRegion& mr, size_t offset, size_t length) {
    return RemoteBuffer{mr.PackRemoteKey(), reinterpret_cast<uint64_t>(mr.base()) + offset, length};
  }
  std::unique_ptr<MemoryRegion> Register(Domain& d, Buffer& b) {
    absl::StatusOr<std::unique_ptr<MemoryRegion>> mr =
        d.RegisterMemory(b.data(), b.size(), kAccessRemoteWrite | kAccessRemoteRead);
    EXPECT_TRUE(mr.ok()) << mr.status();
    return mr.ok() ? *std::move(mr) : nullptr;
  }
  // Posts one write through `ep` (an endpoint of a_) and reports its outcome: the post's
  // refusal, or its completion's status.
  absl::Status WriteOnce(Endpoint& ep, const LocalBuffer& local, const RemoteBuffer& remote) {
    const size_t before = at_a_.size();
    absl::Status posted = ep.PostWrite(local, remote, 77);
    if (!posted.ok()) return posted;
    if (!PollUntil([&] { return at_a_.size() > before; }, absl::Seconds(20))) {
      return absl::DeadlineExceededError("the write never completed");
    }
    return at_a_.back().status;
  }
  size_t Count(const std::vector<Completion>& v, CompletionKind kind) {
    return std::count_if(v.begin(), v.end(), [&](const Completion& c) { return c.kind == kind; });
  }

  std::unique_ptr<Domain> a_, b_;
  std::unique_ptr<Endpoint> ea_, eb_;
  std::vector<Completion> at_a_, at_b_;
};

TEST_P(FabricConformanceTest, RegistersAndDeregistersManyRegions) {
  Buffer buf(1 << 20);
  std::set<std::string> keys;
  std::vector<std::unique_ptr<MemoryRegion>> regions;
  for (int i = 0; i < 64; ++i) {
    absl::StatusOr<std::unique_ptr<MemoryRegion>> mr =
        a_->RegisterMemory(buf.data() + i * 4096, 4096, kAccessRemoteWrite);
    ASSERT_TRUE(mr.ok()) << mr.status();
    EXPECT_EQ((*mr)->base(), buf.data() + i * 4096);
    keys.insert((*mr)->PackRemoteKey().ToString());
    regions.push_back(*std::move(mr));
  }
  EXPECT_EQ(keys.size(), 64u) << "each region has its own key";
  regions.clear();
  EXPECT_FALSE(a_->RegisterMemory(nullptr, 0, kAccessLocal).ok());
}

TEST_P(FabricConformanceTest, WriteWithImmediateLandsTheBytesAndTheImmediateOnce) {
  Buffer src(1 << 20), dst(1 << 20);
  for (size_t i = 0; i < src.size(); ++i) src.data()[i] = static_cast<char>(i * 7 + 3);
  auto src_mr = Register(*a_, src);
  auto dst_mr = Register(*b_, dst);
  ASSERT_TRUE(ea_->PostWriteWithImm({src_mr.get(), src.data(), src.size()},
                                    Remote(*dst_mr, 0, dst.size()), /*imm=*/77, /*context=*/5)
                  .ok());
  ASSERT_TRUE(PollUntil([&] { return !at_a_.empty() && !at_b_.empty(); }));
  ASSERT_EQ(at_a_.size(), 1u);
  EXPECT_EQ(at_a_[0].kind, CompletionKind::kWrite);
  EXPECT_EQ(at_a_[0].context, 5u);
  EXPECT_EQ(at_a_[0].endpoint, ea_.get());
  EXPECT_TRUE(at_a_[0].status.ok()) << at_a_[0].status;
  ASSERT_EQ(at_b_.size(), 1u);
  EXPECT_EQ(at_b_[0].kind, CompletionKind::kRemoteWriteImm);
  EXPECT_EQ(at_b_[0].imm, 77u);
  EXPECT_TRUE(at_b_[0].byte_len == src.size() || at_b_[0].byte_len == 0) << at_b_[0].byte_len;
  EXPECT_EQ(at_b_[0].endpoint, eb_.get());
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), src.size()), 0);
  PollUntil([] { return false; }, absl::Milliseconds(100));
  EXPECT_EQ(at_b_.size(), 1u) << "the immediate arrives exactly once";
  EXPECT_EQ(ea_->Outstanding(), 0u);
}

TEST_P(FabricConformanceTest, ZeroByteWriteWithImmediate) {
  Buffer dst(4096);
  auto dst_mr = Register(*b_, dst);
  ASSERT_TRUE(ea_->PostWriteWithImm({}, Remote(*dst_mr, 0, 0), 0xFFFFFFFE, 1).ok());
  ASSERT_TRUE(PollUntil([&] { return !at_a_.empty() && !at_b_.empty(); }));
  EXPECT_TRUE(at_a_[0].status.ok()) << at_a_[0].status;
  EXPECT_EQ(at_b_[0].imm, 0xFFFFFFFEu);
  EXPECT_EQ(at_b_[0].byte_len, 0u);
}

TEST_P(FabricConformanceTest, ReservedAndExtremeImmediatesArriveIntact) {
  Buffer src(4096), dst(4096);
  auto src_mr = Register(*a_, src);
  auto dst_mr = Register(*b_, dst);
  const std::vector<uint32_t> imms = {0,          1,          0x7FFFFFFF, 0x80000000,
                                      0xFFFFFFFD, 0xFFFFFFFE, 0xFFFFFFFF};
  for (uint32_t imm : imms) {
    ASSERT_TRUE(
        ea_->PostWriteWithImm({src_mr.get(), src.data(), 8}, Remote(*dst_mr, 0, 8), imm, imm).ok());
  }
  ASSERT_TRUE(
      PollUntil([&] { return at_b_.size() == imms.size() && at_a_.size() == imms.size(); }));
  std::multiset<uint32_t> got;
  for (const Completion& c : at_b_) got.insert(c.imm);
  EXPECT_EQ(got, std::multiset<uint32_t>(imms.begin(), imms.end()));
}

TEST_P(FabricConformanceTest, ThousandsOfWritesBeyondTheQueueDepth) {
  DomainOptions options;
  options.queue_depth = 32;
  ASSERT_NO_FATAL_FAILURE(Open(options));
  constexpr int kWrites = 4000;
  constexpr size_t kChunk = 2048;
  Buffer src(kWrites * kChunk), dst(kWrites * kChunk);
  for (size_t i = 0; i < src.size(); ++i) src.data()[i] = static_cast<char>(i % 251);
  auto src_mr = Register(*a_, src);
  auto dst_mr = Register(*b_, dst);
  for (int i = 0; i < kWrites; ++i) {
    ASSERT_TRUE(ea_->PostWriteWithImm({src_mr.get(), src.data() + i * kChunk, kChunk},
                                      Remote(*dst_mr, i * kChunk, kChunk), i, i)
                    .ok())
        << i;
  }
  EXPECT_GT(ea_->Outstanding(), 0u);
  ASSERT_TRUE(PollUntil([&] { return at_a_.size() == kWrites && at_b_.size() == kWrites; },
                        absl::Seconds(60)))
      << at_a_.size() << " local, " << at_b_.size() << " remote";
  std::set<uint32_t> imms;
  for (const Completion& c : at_b_) imms.insert(c.imm);
  EXPECT_EQ(imms.size(), static_cast<size_t>(kWrites));
  for (const Completion& c : at_a_) ASSERT_TRUE(c.status.ok()) << c.status;
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), src.size()), 0);
  EXPECT_EQ(ea_->Outstanding(), 0u);
}

TEST_P(FabricConformanceTest, WaitSleepsWhenIdleAndReturnsWhenWorkArrives) {
  absl::Time start = absl::Now();
  ASSERT_TRUE(b_->Wait(absl::Milliseconds(300)).ok());
  const absl::Duration idle = absl::Now() - start;
  EXPECT_LT(idle, absl::Seconds(5));
  Buffer src(4096), dst(4096);
  auto src_mr = Register(*a_, src);
  auto dst_mr = Register(*b_, dst);
  ASSERT_TRUE(
      ea_->PostWriteWithImm({src_mr.get(), src.data(), 64}, Remote(*dst_mr, 0, 64), 1, 1).ok());
  // The writer's side may need progress too (manual progress): poll it, then wait on b.
  absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (at_b_.empty() && absl::Now() < deadline) {
    Completion c[8];
    size_t n = *a_->Poll(absl::MakeSpan(c));
    at_a_.insert(at_a_.end(), c, c + n);
    start = absl::Now();
    ASSERT_TRUE(b_->Wait(absl::Seconds(2)).ok());
    n = *b_->Poll(absl::MakeSpan(c));
    at_b_.insert(at_b_.end(), c, c + n);
  }
  ASSERT_EQ(at_b_.size(), 1u) << "the immediate arrived through Wait/Poll";
  EXPECT_EQ(at_b_[0].imm, 1u);
  std::cout << GetParam().name << ": idle Wait(300ms) took " << absl::FormatDuration(idle) << "\n";
}

TEST_P(FabricConformanceTest, InterruptEndsAWaitFromAnotherThread) {
  // An interrupt that comes before the wait makes it return at once.
  b_->Interrupt();
  absl::Time start = absl::Now();
  ASSERT_TRUE(b_->Wait(absl::Seconds(20)).ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // One from another thread ends a wait in progress.
  std::thread waker([this] {
    absl::SleepFor(absl::Milliseconds(50));
    b_->Interrupt();
  });
  start = absl::Now();
  ASSERT_TRUE(b_->Wait(absl::Seconds(20)).ok());
  const absl::Duration waited = absl::Now() - start;
  waker.join();
  EXPECT_LT(waited, absl::Seconds(10)) << "Interrupt did not end the wait";
}

TEST_P(FabricConformanceTest, PlainWriteAndRead) {
  Buffer a(65536), b(65536);
  for (size_t i = 0; i < b.size(); ++i) b.data()[i] = static_cast<char>(i ^ 0x3C);
  auto a_mr = Register(*a_, a);
  auto b_mr = Register(*b_, b);
  ASSERT_TRUE(ea_->PostRead({a_mr.get(), a.data(), 32768}, Remote(*b_mr, 1024, 32768), 9).ok());
  ASSERT_TRUE(PollUntil([&] { return !at_a_.empty(); }));
  EXPECT_EQ(at_a_[0].kind, CompletionKind::kRead);
  EXPECT_TRUE(at_a_[0].status.ok()) << at_a_[0].status;
  EXPECT_EQ(std::memcmp(a.data(), b.data() + 1024, 32768), 0);
  std::memset(a.data(), 0x11, 100);
  ASSERT_TRUE(ea_->PostWrite({a_mr.get(), a.data(), 100}, Remote(*b_mr, 60000, 100), 10).ok());
  ASSERT_TRUE(PollUntil([&] { return at_a_.size() == 2; }));
  EXPECT_TRUE(at_a_[1].status.ok());
  EXPECT_EQ(b.data()[60000], 0x11);
  EXPECT_EQ(Count(at_b_, CompletionKind::kRemoteWriteImm), 0u) << "plain writes notify nobody";
}

TEST_P(FabricConformanceTest, BadKeysAndRangesAreErrorsAndTheProcessLives) {
  Buffer src(8192), dst(8192), other(8192);
  auto src_mr = Register(*a_, src);
  auto dst_mr = Register(*b_, dst);
  auto other_mr = Register(*a_, other);
  LocalBuffer local{src_mr.get(), src.data(), 4096};
  EXPECT_EQ(ea_->PostWrite(local, RemoteBuffer{"garbage", 0, 4096}, 1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(ea_->PostWrite(local, Remote(*dst_mr, 6000, 4096), 1).ok()) << "past the end";
  RemoteBuffer below = Remote(*dst_mr, 0, 4096);
  below.addr -= 64;
  EXPECT_FALSE(ea_->PostWrite(local, below, 1).ok()) << "before the start";
  EXPECT_FALSE(ea_->PostWrite(local, Remote(*dst_mr, 0, 100), 1).ok())
      << "larger than the remote buffer";
  EXPECT_FALSE(ea_->PostWrite({other_mr.get(), src.data(), 4096}, Remote(*dst_mr, 0, 4096), 1).ok())
      << "local buffer outside its region";
  PollUntil([] { return false; }, absl::Milliseconds(50));
  EXPECT_TRUE(at_a_.empty()) << "a refused post produces no completion";
  ASSERT_TRUE(ea_->PostWriteWithImm(local, Remote(*dst_mr, 0, 4096), 3, 2).ok());
  ASSERT_TRUE(PollUntil([&] { return !at_a_.empty() && !at_b_.empty(); }));
  EXPECT_TRUE(at_a_[0].status.ok());
}

TEST_P(FabricConformanceTest, ChannelKeysAreTheirEndpointsAloneAndDieWithTheirRegistration) {
  if (!a_->capabilities().channel_keys) {
    EXPECT_TRUE(
        absl::IsUnimplemented(b_->RegisterMemoryFor(*eb_, this, 64, kAccessRemoteWrite).status()))
        << "without channel keys, RegisterMemoryFor says so";
    GTEST_SKIP() << GetParam().name << " offers no per-endpoint keys";
  }
  // A second pair of endpoints between the same domains: another channel.
  std::unique_ptr<Endpoint> ea2 = *a_->CreateEndpoint();
  std::unique_ptr<Endpoint> eb2 = *b_->CreateEndpoint();
  ASSERT_TRUE(ea2->Connect(eb2->LocalAddress()).ok());
  ASSERT_TRUE(eb2->Connect(ea2->LocalAddress()).ok());
  Buffer src(8192), dst(8192);
  std::memset(src.data(), 0x5C, src.size());
  auto src_mr = Register(*a_, src);
  absl::StatusOr<std::unique_ptr<MemoryRegion>> for_b =
      b_->RegisterMemoryFor(*eb_, dst.data(), dst.size(), kAccessRemoteWrite);
  absl::StatusOr<std::unique_ptr<MemoryRegion>> for_b2 =
      b_->RegisterMemoryFor(*eb2, dst.data(), dst.size(), kAccessRemoteWrite);
  ASSERT_TRUE(for_b.ok()) << for_b.status();
  ASSERT_TRUE(for_b2.ok()) << for_b2.status();
  EXPECT_NE((*for_b)->PackRemoteKey(), (*for_b2)->PackRemoteKey())
      << "two channels' keys to the same memory differ";
  const LocalBuffer local{src_mr.get(), src.data(), 4096};
  const RemoteBuffer remote = Remote(**for_b, 0, 4096);
  EXPECT_TRUE(WriteOnce(*ea_, local, remote).ok()) << "through its own channel";
  EXPECT_EQ(dst.data()[100], 0x5C);
  if (a_->capabilities().endpoint_bound_keys) {
    std::memset(dst.data(), 0, dst.size());
    absl::Status s = WriteOnce(*ea2, local, remote);
    EXPECT_FALSE(s.ok()) << "a key offered to one channel is refused on another";
    EXPECT_EQ(dst.data()[100], 0) << "and nothing landed";
  }
  // The channel closes: its registration goes, and the key with it. The other channel's
  // registration of the same memory still works.
  for_b->reset();
  std::memset(dst.data(), 0, dst.size());
  absl::Status stale = WriteOnce(*ea_, local, remote);
  // The writer may hear of the refusal (loopback) or not: libfabric's shm and tcp complete the
  // write as sent and the target drops it. Either way nothing lands, which is what keeps a
  // closed channel's peer out.
  PollUntil([] { return false; }, absl::Milliseconds(200));
  EXPECT_EQ(dst.data()[100], 0) << "a dropped registration's key still wrote (" << stale << ")";
  if (a_->capabilities().endpoint_bound_keys) {
    EXPECT_FALSE(stale.ok());
  }
  EXPECT_TRUE(WriteOnce(*ea2, local, Remote(**for_b2, 0, 4096)).ok());
  EXPECT_EQ(dst.data()[100], 0x5C);
}

TEST_P(FabricConformanceTest,
       ADomainsEndpointsShareOneProviderEndpointAndEachGetsItsOwnImmediates) {
  // 32 channels each way between two domains, each writing at once: every immediate reaches the
  // endpoint its writer was connected to, and over libfabric the 64 endpoints open no provider
  // endpoint beyond the one per domain the fixture's endpoints opened (unless asked not to share).
  constexpr int kPairs = 32;
  const int64_t before = ReadFabricProcessStats().provider_endpoints;
  Buffer src(kPairs * 64), dst(kPairs * 64);
  for (size_t i = 0; i < src.size(); ++i) src.data()[i] = static_cast<char>(i % 199 + 1);
  auto src_mr = Register(*a_, src);
  auto dst_mr = Register(*b_, dst);
  std::vector<std::unique_ptr<Endpoint>> as, bs;
  for (int i = 0; i < kPairs; ++i) {
    as.push_back(*a_->CreateEndpoint());
    bs.push_back(*b_->CreateEndpoint());
    ASSERT_TRUE(as[i]->Connect(bs[i]->LocalAddress()).ok());
    ASSERT_TRUE(bs[i]->Connect(as[i]->LocalAddress()).ok());
  }
  for (int i = 0; i < kPairs; ++i) {
    ASSERT_TRUE(as[i]
                    ->PostWriteWithImm({src_mr.get(), src.data() + i * 64, 64},
                                       Remote(*dst_mr, i * 64, 64), 1000 + i, i)
                    .ok());
  }
  ASSERT_TRUE(PollUntil([&] { return at_a_.size() == kPairs && at_b_.size() == kPairs; }));
  for (const Completion& c : at_b_) {
    ASSERT_GE(c.imm, 1000u);
    ASSERT_LT(c.imm, 1000u + kPairs);
    EXPECT_EQ(c.endpoint, bs[c.imm - 1000].get()) << "immediate " << c.imm;
  }
  for (const Completion& c : at_a_) {
    ASSERT_LT(c.context, static_cast<uint64_t>(kPairs));
    EXPECT_EQ(c.endpoint, as[c.context].get());
    EXPECT_TRUE(c.status.ok()) << c.status;
  }
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), src.size()), 0);
  const int64_t opened = ReadFabricProcessStats().provider_endpoints - before;
  if (GetParam().backend == "ofi") {
    EXPECT_EQ(opened, GetParam().shared_endpoint ? 0 : 2 * kPairs);
  } else {
    EXPECT_EQ(opened, 0);
  }
}

TEST_P(FabricConformanceTest, AClosedEndpointsLateImmediatesReachNeitherItNorItsSuccessor) {
  // The target endpoint closes before its domain has seen a burst of writes to it, and a new
  // endpoint (on a shared provider endpoint: the same slot, a new generation) takes its place.
  // Another pair keeps the domains' connection to each other up, as a task's other channels to
  // the same peer do, so the burst arrives rather than going with a connection.
  constexpr int kWrites = 16;
  const int64_t dropped_before = ReadFabricProcessStats().late_immediates_dropped;
  Buffer src(kWrites * 4096), dst(kWrites * 4096);
  auto src_mr = Register(*a_, src);
  auto dst_mr = Register(*b_, dst);
  auto keep_a = *a_->CreateEndpoint();
  auto keep_b = *b_->CreateEndpoint();
  ASSERT_TRUE(keep_a->Connect(keep_b->LocalAddress()).ok());
  ASSERT_TRUE(keep_b->Connect(keep_a->LocalAddress()).ok());
  for (int i = 0; i < kWrites; ++i) {
    ASSERT_TRUE(ea_->PostWriteWithImm({src_mr.get(), src.data() + i * 4096, 4096},
                                      Remote(*dst_mr, i * 4096, 4096), 100 + i, i)
                    .ok());
  }
  const std::string old_address = eb_->LocalAddress();
  eb_.reset();
  auto eb2 = *b_->CreateEndpoint();
  auto ea2 = *a_->CreateEndpoint();
  EXPECT_NE(eb2->LocalAddress(), old_address) << "a successor must not answer to the old name";
  ASSERT_TRUE(ea2->Connect(eb2->LocalAddress()).ok());
  ASSERT_TRUE(eb2->Connect(ea2->LocalAddress()).ok());
  ASSERT_TRUE(PollUntil([&] { return Count(at_a_, CompletionKind::kWrite) == kWrites; }))
      << "the writes to the closed endpoint never completed";
  ASSERT_TRUE(
      ea2->PostWriteWithImm({src_mr.get(), src.data(), 8}, Remote(*dst_mr, 0, 8), 7, 99).ok());
  ASSERT_TRUE(PollUntil([&] { return !at_b_.empty(); }));
  PollUntil([] { return false; }, absl::Milliseconds(200));
  ASSERT_EQ(at_b_.size(), 1u) << "only the successor's own immediate arrives";
  EXPECT_EQ(at_b_[0].imm, 7u);
  EXPECT_EQ(at_b_[0].endpoint, eb2.get());
  if (GetParam().backend == "ofi" && GetParam().shared_endpoint) {
    EXPECT_EQ(ReadFabricProcessStats().late_immediates_dropped - dropped_before, kWrites);
  }
}

TEST_P(FabricConformanceTest, APeersAddressGoesWithTheLastEndpointToItAndComesBackWithTheNext) {
  // Over rxm an address vector entry is a connection: one a partition stalled must not carry the
  // next channel's messages, so it goes when no endpoint uses it, and the next pair makes anew.
  const int64_t per_pair = GetParam().backend == "ofi" ? 2 : 0;  // one entry in each domain
  const int64_t none = ReadFabricProcessStats().peer_addresses - per_pair;  // the fixture's pair
  auto ea2 = *a_->CreateEndpoint();
  auto eb2 = *b_->CreateEndpoint();
  ASSERT_TRUE(ea2->Connect(eb2->LocalAddress()).ok());
  ASSERT_TRUE(eb2->Connect(ea2->LocalAddress()).ok());
  // With a shared provider endpoint the second pair reaches the same peer; without, another.
  const int64_t two_pairs = GetParam().shared_endpoint ? per_pair : 2 * per_pair;
  EXPECT_EQ(ReadFabricProcessStats().peer_addresses - none, two_pairs);
  ea_.reset();
  eb_.reset();
  EXPECT_EQ(ReadFabricProcessStats().peer_addresses - none, per_pair) << "the second pair's";
  ea2.reset();
  eb2.reset();
  EXPECT_EQ(ReadFabricProcessStats().peer_addresses - none, 0);

  Buffer src(4096), dst(4096);
  for (size_t i = 0; i < src.size(); ++i) src.data()[i] = static_cast<char>(i % 251 + 1);
  auto src_mr = Register(*a_, src);
  auto dst_mr = Register(*b_, dst);
  auto ea3 = *a_->CreateEndpoint();
  auto eb3 = *b_->CreateEndpoint();
  ASSERT_TRUE(ea3->Connect(eb3->LocalAddress()).ok());
  ASSERT_TRUE(eb3->Connect(ea3->LocalAddress()).ok());
  EXPECT_EQ(ReadFabricProcessStats().peer_addresses - none, per_pair);
  ASSERT_TRUE(ea3->PostWriteWithImm({src_mr.get(), src.data(), src.size()},
                                    Remote(*dst_mr, 0, dst.size()), 42, 3)
                  .ok());
  ASSERT_TRUE(PollUntil([&] { return !at_a_.empty() && !at_b_.empty(); }));
  EXPECT_TRUE(at_a_[0].status.ok()) << at_a_[0].status;
  EXPECT_EQ(at_b_[0].imm, 42u);
  EXPECT_EQ(at_b_[0].endpoint, eb3.get());
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), src.size()), 0);
}

TEST_P(FabricConformanceTest, AClosedEndpointsOperationsInFlightReachNeitherItNorItsSuccessor) {
  // The writer closes with its writes in flight: their completions are dropped with it (the
  // contract), including on a provider endpoint that stays open for the endpoint that takes its
  // place; the records the provider still holds are freed as they return (ASan checks).
  constexpr int kWrites = 16;
  Buffer src(kWrites * 4096), dst(kWrites * 4096);
  auto src_mr = Register(*a_, src);
  auto dst_mr = Register(*b_, dst);
  for (int i = 0; i < kWrites; ++i) {
    ASSERT_TRUE(ea_->PostWriteWithImm({src_mr.get(), src.data() + i * 4096, 4096},
                                      Remote(*dst_mr, i * 4096, 4096), 100 + i, 1000 + i)
                    .ok());
  }
  ea_.reset();
  auto ea2 = *a_->CreateEndpoint();
  auto eb2 = *b_->CreateEndpoint();
  ASSERT_TRUE(ea2->Connect(eb2->LocalAddress()).ok());
  ASSERT_TRUE(eb2->Connect(ea2->LocalAddress()).ok());
  ASSERT_TRUE(
      ea2->PostWriteWithImm({src_mr.get(), src.data(), 8}, Remote(*dst_mr, 0, 8), 7, 5).ok());
  ASSERT_TRUE(PollUntil([&] {
    return !at_a_.empty() &&
           std::any_of(at_b_.begin(), at_b_.end(), [&](const Completion& c) { return c.imm == 7; });
  }));
  PollUntil([] { return false; }, absl::Milliseconds(200));
  ASSERT_EQ(at_a_.size(), 1u) << "only the successor's own write completes";
  EXPECT_EQ(at_a_[0].context, 5u);
  EXPECT_EQ(at_a_[0].endpoint, ea2.get());
  EXPECT_TRUE(at_a_[0].status.ok()) << at_a_[0].status;
  for (const Completion& c : at_b_) {
    // The closed writer's writes may still land on their own target; none reaches the successor.
    EXPECT_EQ(c.endpoint == eb2.get(), c.imm == 7) << "immediate " << c.imm;
  }
}

TEST_P(FabricConformanceTest, ClosedPeerGivesAnErrorWithinABoundedTime) {
  // Providers may report a write to a vanished peer as done (shm for small writes, tcp before it
  // notices the closed connection), so the contract is: every post completes within a bounded
  // time, and the dead peer shows up as an error by the last of a few writes. Over libfabric
  // shm the peer here is in this process, whose closing unmaps what shm would write through
  // (libfabric 1.17 crashed in fi_writedata): the ofi backend refuses the post itself
  // (ofi/local_peers.h). A dead peer in another process: fabric_two_process_test.
  DomainOptions options;
  options.op_timeout = absl::Seconds(2);
  ASSERT_NO_FATAL_FAILURE(Open(options));
  constexpr size_t kSize = 65536;
  Buffer src(kSize), dst(kSize);
  auto src_mr = Register(*a_, src);
  auto dst_mr = Register(*b_, dst);
  RemoteBuffer remote = Remote(*dst_mr, 0, kSize);
  dst_mr.reset();
  eb_.reset();
  b_.reset();
  absl::Time start = absl::Now();
  size_t posted = 0;
  absl::Status last_error;
  for (int i = 0; i < 3; ++i) {
    absl::Status s = ea_->PostWriteWithImm({src_mr.get(), src.data(), kSize}, remote, i, i);
    if (s.ok()) {
      ++posted;
    } else {
      last_error = s;
    }
    ASSERT_TRUE(PollUntil([&] { return at_a_.size() == posted; }, absl::Seconds(20)))
        << "write " << i << " never completed";
    if (!at_a_.empty() && !at_a_.back().status.ok()) last_error = at_a_.back().status;
  }
  EXPECT_FALSE(last_error.ok()) << "three writes to a closed peer all looked successful";
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
}

TEST_P(FabricConformanceTest, ClosingTheTargetMidWriteLeavesBothSidesWhole) {
  // What a network partition or a watchdog does to a receiver: its endpoint closes while a
  // large write with an immediate is half placed. libfabric 1.17's rxm over tcp reported that
  // half-received write to itself as a cancelled operation without a context and crashed on it,
  // so the ofi backend sends large writes as the data followed by an empty write with the
  // immediate; this holds that to the contract on every backend.
  if (GetParam().provider == "shm") GTEST_SKIP() << "needs the peer in another process for shm";
  DomainOptions options;
  options.op_timeout = absl::Seconds(5);
  constexpr size_t kSize = size_t{16} << 20;
  constexpr int kTries = 3;
  int caught_mid_write = 0;
  for (int attempt = 0; attempt < kTries; ++attempt) {
    at_a_.clear();
    at_b_.clear();
    ASSERT_NO_FATAL_FAILURE(Open(options));
    Buffer src(kSize), dst(kSize);
    std::memset(src.data(), 0xAB, kSize);
    auto src_mr = Register(*a_, src);
    auto dst_mr = Register(*b_, dst);
    ASSERT_TRUE(
        ea_->PostWriteWithImm({src_mr.get(), src.data(), kSize}, Remote(*dst_mr, 0, kSize), 5, 9)
            .ok());
    // Drive both sides until the first bytes have landed and the last have not.
    const volatile char* first = dst.data();
    const volatile char* last = dst.data() + kSize - 1;
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    Completion batch[16];
    while (*first != static_cast<char>(0xAB) && absl::Now() < deadline) {
      for (Domain* d : {a_.get(), b_.get()}) {
        absl::StatusOr<size_t> n = d->Poll(absl::MakeSpan(batch));
        ASSERT_TRUE(n.ok()) << n.status();
        std::vector<Completion>& sink = d == a_.get() ? at_a_ : at_b_;
        sink.insert(sink.end(), batch, batch + *n);
      }
    }
    ASSERT_EQ(*first, static_cast<char>(0xAB)) << "the write never started to arrive";
    if (*last != static_cast<char>(0xAB)) ++caught_mid_write;
    eb_.reset();  // the target goes, mid-write or (rarely) just after
    dst_mr.reset();
    b_.reset();
    ASSERT_TRUE(PollUntil([&] { return !at_a_.empty(); }, absl::Seconds(20)))
        << "the write to a closed target never completed";
    EXPECT_EQ(at_a_.size(), 1u);
    EXPECT_EQ(at_a_[0].context, 9u);
    src_mr.reset();
    ea_.reset();
    a_.reset();
  }
  // Over tcp most tries close mid-write; a backend that places a write at once never does.
  RecordProperty("closed_mid_write", caught_mid_write);
}

TEST_P(FabricConformanceTest, ShmLeavesNothingBehindInDevShm) {
  auto count = [] { return testing::ShmRegionsOf(getpid()).size(); };
  ea_.reset();
  eb_.reset();
  a_.reset();
  b_.reset();
  const size_t before = count();
  for (int i = 0; i < 3; ++i) {
    ASSERT_NO_FATAL_FAILURE(Open(DomainOptions()));
    if (GetParam().provider == "shm") {
      EXPECT_GT(count(), before) << "open shm endpoints are visible, so the check is meaningful";
    }
    ea_.reset();
    eb_.reset();
    a_.reset();
    b_.reset();
  }
  EXPECT_EQ(count(), before);
}

std::vector<Backend> Backends() {
  std::vector<Backend> backends = {
      {"loopback", "", "loopback"},
      // The same-host fabric twice: into memory peers map, and into private memory that only
      // the kernel's cross-memory copy reaches.
      {"shmem", "", "shmem", true},
      {"shmem", "", "shmem_cross_memory", false},
      {"ofi", "shm", "ofi_shm"},
      {"ofi", "tcp;ofi_rxm", "ofi_tcp"},
      // Each endpoint on a libfabric endpoint of its own: what a provider with 4 bytes of CQ
      // data gets (TENSORVERBS_OFI_SHARED_ENDPOINT=off).
      {"ofi", "tcp;ofi_rxm", "ofi_tcp_own_endpoints", false, false}};
  // On a host with an active RDMA port this runs on the NIC; elsewhere it skips with the reason.
  for (const std::string& b : BackendNames()) {
    if (b == "ibverbs") backends.push_back({"ibverbs", "", "ibverbs"});
  }
  return backends;
}

INSTANTIATE_TEST_SUITE_P(Backends, FabricConformanceTest, ::testing::ValuesIn(Backends()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace tensorverbs::fabric
