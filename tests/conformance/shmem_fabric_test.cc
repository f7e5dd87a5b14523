// What the same-host fabric promises beyond the fabric contract (fabric_conformance_test runs
// that on it): which path a write takes, access rights enforced where the writer stands,
// one peer per endpoint, no regions for strangers, and queued work failing when a peer leaves.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/common/shared_memory.h"
#include "src/fabric/fabric.h"
#include "src/fabric/shmem/peer_mappings.h"
#include "src/fabric/shmem/shared_writes.h"
#include "src/fabric/shmem/shmem.h"
#include "src/fabric/shmem/wire.h"
#include "tests/conformance/shmem_fixture.h"

namespace tensorverbs::fabric {
namespace {

using shmem_testing::ShmemFabricTest;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST_F(ShmemFabricTest, SharedMemoryIsWrittenThroughAMappingAndPrivateMemoryByTheKernel) {
  auto shared_mr = *b_->RegisterMemory(dst_->data(), dst_->size(), kAccessRemoteWrite);
  void* priv = mmap(nullptr, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  auto private_mr = *b_->RegisterMemory(priv, 1 << 20, kAccessRemoteWrite);
  std::memset(src_->data(), 0x3C, 65536);
  shmem::CopyCounters& c = shmem::Counters();
  const uint64_t mapped = c.mapped_bytes.load(), cross = c.cross_memory_bytes.load();
  const uint64_t regions = c.regions_mapped.load();
  ASSERT_TRUE(ea_->PostWriteWithImm(Local(65536), Remote(*shared_mr), 1, 1).ok());
  ASSERT_TRUE(ea_->PostWriteWithImm(Local(65536), Remote(*shared_mr), 2, 2).ok());
  ASSERT_TRUE(ea_->PostWriteWithImm(Local(4096), Remote(*private_mr), 3, 3).ok());
  ASSERT_EQ(PollFor(*a_, 3).size(), 3u);
  std::vector<Completion> arrived = PollFor(*b_, 3);
  ASSERT_EQ(arrived.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(arrived[i].imm, static_cast<uint32_t>(i + 1));
  EXPECT_EQ(arrived[0].byte_len, 65536u);
  EXPECT_EQ(static_cast<unsigned char*>(dst_->data())[65535], 0x3C);
  EXPECT_EQ(static_cast<unsigned char*>(priv)[4095], 0x3C);
  EXPECT_EQ(c.mapped_bytes.load() - mapped, 2u * 65536);
  EXPECT_EQ(c.cross_memory_bytes.load() - cross, 4096u);
  EXPECT_EQ(c.regions_mapped.load() - regions, 1u) << "mapped once, on first use";
  private_mr.reset();
  munmap(priv, 1 << 20);
}

// A peer's region is mapped whole but populated by window (shmem::kWindowBytes): each write
// makes the page tables of the windows it touches, once, so a large pool costs its peers what
// they write of it.
TEST_F(ShmemFabricTest, APeersRegionIsPopulatedOnlyInTheWindowsWrittenAndEachOnce) {
  constexpr size_t kRegion = 4 * shmem::kWindowBytes + 4096;  // five windows, the last short
  std::unique_ptr<SharedMemory> big = *SharedMemory::Create(kRegion, "test-big");
  auto mr = *b_->RegisterMemory(big->data(), big->size(), kAccessRemoteWrite);
  std::memset(src_->data(), 0x5A, 65536);
  shmem::CopyCounters& c = shmem::Counters();
  const uint64_t windows = c.windows_populated.load(), bytes = c.bytes_populated.load();
  auto write_at = [&](uint64_t offset, size_t n, uint32_t imm) {
    RemoteBuffer target = Remote(*mr);
    target.addr += offset;
    target.length = n;
    ASSERT_TRUE(ea_->PostWriteWithImm(Local(n), target, imm, imm).ok());
    ASSERT_EQ(PollFor(*a_, 1).size(), 1u);
    ASSERT_EQ(PollFor(*b_, 1).size(), 1u);
  };
  auto* base = static_cast<unsigned char*>(big->data());
  // Inside the third window: that window alone.
  ASSERT_NO_FATAL_FAILURE(write_at(2 * shmem::kWindowBytes + 100, 4096, 1));
  EXPECT_EQ(c.windows_populated.load() - windows, 1u);
  EXPECT_EQ(c.bytes_populated.load() - bytes, shmem::kWindowBytes);
  // Again in it, and across the first two: the third is not made again.
  ASSERT_NO_FATAL_FAILURE(write_at(2 * shmem::kWindowBytes + 8192, 4096, 2));
  ASSERT_NO_FATAL_FAILURE(write_at(shmem::kWindowBytes - 1000, 65536, 3));
  EXPECT_EQ(c.windows_populated.load() - windows, 3u);
  // The short last window, at the region's end.
  ASSERT_NO_FATAL_FAILURE(write_at(kRegion - 4096, 4096, 4));
  EXPECT_EQ(c.windows_populated.load() - windows, 4u);
  EXPECT_EQ(c.bytes_populated.load() - bytes, 3 * shmem::kWindowBytes + 4096);
  for (uint64_t at : {2 * shmem::kWindowBytes + 100, 2 * shmem::kWindowBytes + 8192 + 4095,
                      shmem::kWindowBytes - 1000, shmem::kWindowBytes + 64535, kRegion - 1}) {
    EXPECT_EQ(base[at], 0x5A) << "at " << at;
  }
  EXPECT_EQ(base[3 * shmem::kWindowBytes + 5], 0) << "never written";
  mr.reset();
}

// The windows an endpoint keeps populated are bounded (DomainOptions::peer_window_bytes): past
// it, a window not touched since the sweep last passed it gives its page tables back (a clock
// sweep: recently used windows stay longer), and a later
// write into it populates it again. The bytes are the peer's and stay: what was written before
// a window was given back is still there, and writes after land whole.
TEST_F(ShmemFabricTest, PopulatedWindowsStayWithinTheBudgetAndAReleasedOneIsMadeAgain) {
  DomainOptions options;
  options.peer_window_bytes = 2 * shmem::kWindowBytes;
  ASSERT_NO_FATAL_FAILURE(Open(options));
  constexpr size_t kRegion = 4 * shmem::kWindowBytes;
  std::unique_ptr<SharedMemory> big = *SharedMemory::Create(kRegion, "test-windows");
  auto mr = *b_->RegisterMemory(big->data(), big->size(), kAccessRemoteWrite);
  shmem::CopyCounters& c = shmem::Counters();
  const uint64_t made = c.windows_populated.load(), released = c.windows_released.load();
  auto* base = static_cast<unsigned char*>(big->data());
  auto write_window = [&](uint64_t window, unsigned char value, uint32_t imm) {
    std::memset(src_->data(), value, 4096);
    RemoteBuffer target = Remote(*mr);
    target.addr += window * shmem::kWindowBytes + 100;
    target.length = 4096;
    ASSERT_TRUE(ea_->PostWriteWithImm(Local(4096), target, imm, imm).ok());
    ASSERT_NO_FATAL_FAILURE(ExpectWriteLanded(4096));
  };
  ASSERT_NO_FATAL_FAILURE(write_window(0, 0x11, 1));
  ASSERT_NO_FATAL_FAILURE(write_window(1, 0x22, 2));
  EXPECT_EQ(c.windows_released.load() - released, 0u) << "within the budget";
  ASSERT_NO_FATAL_FAILURE(write_window(0, 0x33, 3));
  ASSERT_NO_FATAL_FAILURE(write_window(2, 0x44, 4));
  EXPECT_EQ(c.windows_released.load() - released, 1u);
  ASSERT_NO_FATAL_FAILURE(write_window(3, 0x55, 5));
  EXPECT_EQ(c.windows_released.load() - released, 2u);
  ASSERT_NO_FATAL_FAILURE(write_window(1, 0x66, 6));  // given back before: made again
  EXPECT_EQ(c.windows_released.load() - released, 3u);
  EXPECT_EQ(c.windows_populated.load() - made, 5u) << "windows 0, 1, 2, 3, then 1 again";
  EXPECT_EQ(base[100], 0x33);
  EXPECT_EQ(base[shmem::kWindowBytes + 100 + 4095], 0x66);
  EXPECT_EQ(base[2 * shmem::kWindowBytes + 100], 0x44);
  EXPECT_EQ(base[3 * shmem::kWindowBytes + 100 + 4095], 0x55);
  mr.reset();
}

TEST_F(ShmemFabricTest, LargeWritesAndReadsSharedWithCopyThreadsLandExactly) {
  DomainOptions options;
  options.copy_threads = 2;
  ASSERT_NO_FATAL_FAILURE(Open(options));
  const size_t n = (size_t{16} << 20) + 4097;  // above the sharing threshold, pages and a bit
  auto src = *SharedMemory::Create(n, "test-big-src");
  auto dst = *SharedMemory::Create(n, "test-big-dst");
  auto src_mr = *a_->RegisterMemory(src->data(), n, kAccessLocal);
  auto dst_mr = *b_->RegisterMemory(dst->data(), n, kAccessRemoteWrite | kAccessRemoteRead);
  auto* s = static_cast<unsigned char*>(src->data());
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<unsigned char>(i * 131 + (i >> 12));
  ASSERT_TRUE(ea_->PostWriteWithImm({src_mr.get(), src->data(), n}, Remote(*dst_mr), 5, 1).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectWriteLanded(n));
  EXPECT_EQ(std::memcmp(dst->data(), src->data(), n), 0);
  // And back: a read of the whole region into the source, cleared first.
  std::memset(src->data(), 0, n);
  ASSERT_TRUE(ea_->PostRead({src_mr.get(), src->data(), n}, Remote(*dst_mr), 2).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectOneOk(*a_));
  EXPECT_EQ(std::memcmp(dst->data(), src->data(), n), 0);
  // A count out of range is refused when the domain opens.
  options.copy_threads = 65;
  absl::StatusOr<std::unique_ptr<Domain>> refused = OpenDomain("shmem", options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("copy threads"));
}

// A write from 512 KiB is offered to the peer to share: its progress thread, polling on
// another thread here, copies parts of it into its own memory.
TEST_F(ShmemFabricTest, WritesSharedWithAPollingPeerLandExactly) {
  const size_t n = (size_t{1} << 20) - 12345;  // parts, the last one shorter
  const size_t at = 777;                       // into the middle of the peer's region
  auto dst = *SharedMemory::Create(2 << 20, "test-share-dst");
  auto dst_mr = *b_->RegisterMemory(dst->data(), dst->size(), kAccessRemoteWrite);
  std::atomic<uint32_t> arrived{0};
  shmem_testing::PollingThread peer(*b_, [&](const Completion& c) { arrived.store(c.imm); });
  shmem::CopyCounters& c = shmem::Counters();
  const uint64_t offered = c.shared_write_ops.load(), helped = c.shared_write_helped_ops.load();
  const uint64_t copied = c.shared_write_bytes_copied.load();
  auto* s = static_cast<unsigned char*>(src_->data());
  auto* d = static_cast<unsigned char*>(dst->data());
  // Until the peer has taken part in a few (it usually does in each); every one exact.
  uint32_t writes = 0;
  for (; writes < 2000 && c.shared_write_helped_ops.load() - helped < 5; ++writes) {
    for (size_t i = 0; i < n; ++i) s[i] = static_cast<unsigned char>(i * 7 + writes);
    RemoteBuffer remote = Remote(*dst_mr);
    remote.addr += at;
    ASSERT_TRUE(ea_->PostWriteWithImm(Local(n), remote, writes + 1, writes).ok());
    std::vector<Completion> done = PollFor(*a_, 1);
    ASSERT_EQ(done.size(), 1u);
    ASSERT_TRUE(done[0].status.ok()) << done[0].status;
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (arrived.load() != writes + 1 && absl::Now() < deadline) std::this_thread::yield();
    ASSERT_EQ(arrived.load(), writes + 1);
    ASSERT_EQ(std::memcmp(d + at, s, n), 0) << "write " << writes;
    ASSERT_EQ(d[at - 1], 0);
    ASSERT_EQ(d[at + n], 0) << "nothing past the write";
  }
  peer.Stop();
  EXPECT_EQ(c.shared_write_ops.load() - offered, writes) << "every write was offered";
  EXPECT_GE(c.shared_write_helped_ops.load() - helped, 5u);
  EXPECT_GT(c.shared_write_bytes_copied.load(), copied);
}

// A reader that claims a part of a shared write and then stalls (its thread preempted for long,
// or stuck) costs the writer the operation timeout, no more: that write fails naming the
// stall, its endpoint breaks, no immediate for it arrives, and the domain goes on.
std::atomic<bool> stall_next_claim{false};
std::atomic<bool> stalled{false};
void StallOnce() {
  if (stall_next_claim.exchange(false)) {
    stalled.store(true);
    absl::SleepFor(absl::Seconds(2));
  }
}

TEST_F(ShmemFabricTest, AReaderThatClaimsAPartAndStallsFailsThatWriteAfterTheOpTimeout) {
  DomainOptions options;
  options.op_timeout = absl::Milliseconds(300);
  ASSERT_NO_FATAL_FAILURE(Open(options));
  const size_t n = size_t{1} << 20;
  auto dst = *SharedMemory::Create(2 << 20, "test-stall-dst");
  auto dst_mr = *b_->RegisterMemory(dst->data(), dst->size(), kAccessRemoteWrite);
  std::atomic<uint32_t> arrived{0};
  shmem_testing::PollingThread peer(*b_, [&](const Completion& c) {
    if (c.status.ok()) arrived.fetch_add(1);
  });
  stalled.store(false);
  shmem::SetClaimHookForTesting(&StallOnce);
  absl::Cleanup unhook = [] { shmem::SetClaimHookForTesting(nullptr); };
  stall_next_claim.store(true);
  std::memset(src_->data(), 0x6B, n);
  // Until the peer claims a part of one (it usually does of the first).
  uint32_t ok_writes = 0;
  absl::Status failed;
  for (uint32_t i = 0; i < 2000 && failed.ok(); ++i) {
    ASSERT_TRUE(ea_->PostWriteWithImm(Local(n), Remote(*dst_mr), i + 1, i).ok());
    std::vector<Completion> done = PollFor(*a_, 1, absl::Seconds(20));
    ASSERT_EQ(done.size(), 1u);
    if (done[0].status.ok()) {
      ++ok_writes;
    } else {
      failed = done[0].status;
    }
  }
  ASSERT_TRUE(stalled.load()) << "the peer never claimed a part in 2000 writes";
  EXPECT_EQ(failed.code(), absl::StatusCode::kDeadlineExceeded) << failed;
  EXPECT_THAT(std::string(failed.message()),
              HasSubstr("claimed part of a shared write and did not finish it within 300ms"));
  // The endpoint is broken: what is posted on it now fails too, naming the same cause.
  absl::Status after = ea_->PostWrite(Local(64), Remote(*dst_mr), 99);
  if (after.ok()) {
    std::vector<Completion> done = PollFor(*a_, 1, absl::Seconds(20));
    ASSERT_EQ(done.size(), 1u);
    after = done[0].status;
  }
  EXPECT_FALSE(after.ok());
  // Once the reader wakes, it finishes its part; no immediate of the failed write arrives.
  absl::SleepFor(absl::Seconds(2.5));
  EXPECT_EQ(arrived.load(), ok_writes);
  peer.Stop();
  // Another endpoint pair of the same domains still writes.
  auto a2 = *a_->CreateEndpoint();
  auto b2 = *b_->CreateEndpoint();
  ASSERT_TRUE(a2->Connect(b2->LocalAddress()).ok());
  ASSERT_TRUE(b2->Connect(a2->LocalAddress()).ok());
  std::memset(dst->data(), 0, 4096);
  ASSERT_TRUE(a2->PostWriteWithImm(Local(4096), Remote(*dst_mr), 7, 7).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectOneOk(*a_));
  std::vector<Completion> landed = PollFor(*b_, 1);
  ASSERT_EQ(landed.size(), 1u);
  EXPECT_TRUE(landed[0].status.ok()) << landed[0].status;
  EXPECT_EQ(landed[0].imm, 7u);
  EXPECT_EQ(static_cast<unsigned char*>(dst->data())[4095], 0x6B);
}

TEST_F(ShmemFabricTest, WithoutPeerCopyNoWriteIsShared) {
  DomainOptions options;
  options.peer_copy = false;
  ASSERT_NO_FATAL_FAILURE(Open(options));
  auto dst_mr = *b_->RegisterMemory(dst_->data(), dst_->size(), kAccessRemoteWrite);
  shmem::CopyCounters& c = shmem::Counters();
  const uint64_t offered = c.shared_write_ops.load();
  std::memset(src_->data(), 0x42, src_->size());
  ASSERT_TRUE(ea_->PostWriteWithImm(Local(src_->size()), Remote(*dst_mr), 1, 1).ok());
  ASSERT_EQ(PollFor(*a_, 1).size(), 1u);
  ASSERT_EQ(PollFor(*b_, 1).size(), 1u);
  EXPECT_EQ(static_cast<unsigned char*>(dst_->data())[src_->size() - 1], 0x42);
  EXPECT_EQ(c.shared_write_ops.load(), offered);
}

// The source of a shared write is lent to the writer's peer alone, and read-only; and the
// reader takes part only in a write that lands in its own remotely writable memory and comes
// from inside the key the writer gave.
TEST_F(ShmemFabricTest, ASharedWriteLendsItsSourceReadOnlyToThatPeerAndIsCheckedByIt) {
  // `writer` writes to b; its peer, as a's descriptor server sees it, is the raw connection.
  auto writer = *a_->CreateEndpoint();
  auto target = *b_->CreateEndpoint();
  ASSERT_TRUE(writer->Connect(target->LocalAddress()).ok());
  const int raw = ConnectRaw(*writer);
  ASSERT_GE(raw, 0);
  int fds[2];
  int nfds = 0;
  shmem::Reply hello = AskRaw(raw, shmem::kHello, EndpointId(*writer), fds, &nfds);
  ASSERT_EQ(hello.status, shmem::kOk);
  ASSERT_EQ(nfds, 2);
  void* ring_memory = mmap(nullptr, hello.size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
  close(fds[0]);
  close(fds[1]);
  ASSERT_NE(ring_memory, MAP_FAILED);
  auto* ring = static_cast<shmem::RingHeader*>(ring_memory);
  const uint64_t src_region = KeyOf(*src_mr_).region;
  EXPECT_EQ(AskRaw(raw, shmem::kRegion, src_region, fds, &nfds).status, shmem::kNoAccess)
      << "a region without remote access, before any shared write";

  auto dst_mr = *b_->RegisterMemory(dst_->data(), dst_->size(), kAccessRemoteWrite);
  std::memset(src_->data(), 0x17, src_->size());
  ASSERT_TRUE(writer->PostWrite(Local(src_->size()), Remote(*dst_mr), 1).ok());
  ASSERT_EQ(PollFor(*a_, 1).size(), 1u);
  EXPECT_EQ(static_cast<unsigned char*>(dst_->data())[12345], 0x17);

  shmem::Reply lent = AskRaw(raw, shmem::kRegion, src_region, fds, &nfds);
  ASSERT_EQ(lent.status, shmem::kOk) << "lent to the writer's peer";
  ASSERT_EQ(nfds, 1);
  EXPECT_EQ(lent.access, static_cast<uint32_t>(kAccessRemoteRead));
  EXPECT_EQ(fcntl(fds[0], F_GETFL) & O_ACCMODE, O_RDONLY);
  EXPECT_EQ(mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0), MAP_FAILED);
  close(fds[0]);
  // Another endpoint's peer is refused it.
  auto other = *a_->CreateEndpoint();
  const int stranger = ConnectRaw(*other);
  ASSERT_GE(stranger, 0);
  ASSERT_EQ(AskRaw(stranger, shmem::kHello, EndpointId(*other), fds, &nfds).status, shmem::kOk);
  for (int i = 0; i < nfds; ++i) close(fds[i]);
  EXPECT_EQ(AskRaw(stranger, shmem::kRegion, src_region, fds, &nfds).status, shmem::kNoAccess);
  close(stranger);

  // Now the raw peer offers `writer`'s domain shared writes through its ring: from b's region
  // (mappable by a, which is connected to b) into a's memory.
  auto from = *SharedMemory::Create(1 << 20, "test-share-from");
  std::memset(from->data(), 0x5E, from->size());
  auto from_mr = *b_->RegisterMemory(from->data(), from->size(), kAccessRemoteWrite);
  auto into = *SharedMemory::Create(2 << 20, "test-share-into");
  auto into_mr = *a_->RegisterMemory(into->data(), into->size(), kAccessRemoteWrite);
  auto local_only = *a_->RegisterMemory(src_->data(), src_->size(), kAccessLocal);
  shmem::SharedWrite& w = ring->share;
  uint64_t seq = 100;
  auto offer = [&](const MemoryRegion& dst, uint64_t dst_addr, uint64_t length) {
    const shmem::PackedKey key = KeyOf(*from_mr);
    std::memcpy(w.src_key, &key, sizeof(key));
    w.src_addr = key.base;
    w.dst_region = KeyOf(dst).region;
    w.dst_addr = dst_addr;
    w.length = length;
    w.part = static_cast<uint32_t>(length / 8);
    w.parts = static_cast<uint32_t>((length + w.part - 1) / w.part);
    w.streaming = 0;
    w.done = 0;
    shmem::Atomic(w.state).store(++seq << 32, std::memory_order_release);
    Completion batch[4];
    for (int i = 0; i < 20; ++i) (void)a_->Poll(absl::MakeSpan(batch));
    return shmem::Atomic(w.state).load() & 0xffffffffu;  // parts claimed
  };
  const uint64_t into_base = reinterpret_cast<uint64_t>(into->data());
  EXPECT_EQ(offer(*local_only, reinterpret_cast<uint64_t>(src_->data()), 1 << 20), 0u)
      << "not remotely writable: refused";
  EXPECT_EQ(static_cast<unsigned char*>(src_->data())[0], 0x17);
  EXPECT_EQ(offer(*into_mr, into_base + (1 << 20) + 4096, 1 << 20), 0u) << "past its end";
  EXPECT_EQ(offer(*into_mr, into_base - 4096, 1 << 20), 0u) << "before its start";
  EXPECT_EQ(offer(*into_mr, into_base, size_t{2} << 20), 0u) << "more than the source key";
  EXPECT_EQ(static_cast<unsigned char*>(into->data())[0], 0);
  EXPECT_EQ(offer(*into_mr, into_base + 4096, 1 << 20), 8u) << "a sound one: every part taken";
  EXPECT_EQ(shmem::Atomic(w.done).load(), 8u);
  EXPECT_EQ(static_cast<unsigned char*>(into->data())[4096], 0x5E);
  EXPECT_EQ(static_cast<unsigned char*>(into->data())[4096 + (1 << 20) - 1], 0x5E);
  EXPECT_EQ(static_cast<unsigned char*>(into->data())[4095], 0);
  munmap(ring_memory, hello.size);
  close(raw);
}

TEST_F(ShmemFabricTest, AccessRightsAreEnforcedOnTheWritersSide) {
  auto read_only = *b_->RegisterMemory(dst_->data(), dst_->size(), kAccessRemoteRead);
  absl::Status s = ea_->PostWrite(Local(64), Remote(*read_only), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  std::strcpy(static_cast<char*>(dst_->data()), "readable");
  auto sink_mr = *a_->RegisterMemory(src_->data(), src_->size(), kAccessLocal);
  ASSERT_TRUE(ea_->PostRead({sink_mr.get(), src_->data(), 9}, Remote(*read_only), 2).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectOneOk(*a_));
  EXPECT_STREQ(static_cast<char*>(src_->data()), "readable");
  auto local_only = *b_->RegisterMemory(dst_->data(), 4096, kAccessLocal);
  EXPECT_EQ(ea_->PostRead(Local(8), Remote(*local_only), 3).code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(ShmemFabricTest, ARegionDeregisteredBeforeItsFirstUseIsAnErrorCompletion) {
  auto mr = *b_->RegisterMemory(dst_->data(), dst_->size(), kAccessRemoteWrite);
  const RemoteBuffer stale = Remote(*mr);
  mr.reset();
  ASSERT_TRUE(ea_->PostWriteWithImm(Local(64), stale, 9, 1).ok());
  std::vector<Completion> done = PollFor(*a_, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_FALSE(done[0].status.ok());
  EXPECT_THAT(std::string(done[0].status.message()), HasSubstr("no registered region"));
  EXPECT_TRUE(PollFor(*b_, 1, absl::Milliseconds(100)).empty())
      << "no immediate for a write that did not happen";
}

TEST_F(ShmemFabricTest, AnEndpointTakesOnePeer) {
  auto intruder = *a_->CreateEndpoint();
  absl::Status s = intruder->Connect(eb_->LocalAddress());
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("already connected"));
  EXPECT_EQ(ea_->Connect(eb_->LocalAddress()).code(), absl::StatusCode::kFailedPrecondition)
      << "nor connects twice";
  auto stray = *a_->CreateEndpoint();
  EXPECT_EQ(stray->Connect("shmem:00000000000000ff:1").code(), absl::StatusCode::kUnavailable)
      << "no such domain";
  EXPECT_EQ(stray->Connect("ofi:garbage").code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ShmemFabricTest, AStrangerThatSkipsTheHandshakeGetsNoRegion) {
  auto mr = *b_->RegisterMemory(dst_->data(), dst_->size(), kAccessRemoteWrite);
  std::vector<std::string> parts = absl::StrSplit(eb_->LocalAddress(), ':');
  ASSERT_EQ(parts.size(), 3u);
  const std::string name = absl::StrCat("tensorverbs-shmem-", parts[1]);
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr),
                    static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size())),
            0);
  // The key says which region; a request for it before naming an endpoint must be refused.
  uint64_t region = 0;
  std::memcpy(&region, mr->PackRemoteKey().data() + 16, sizeof(region));
  struct {
    uint32_t magic = 0x31515654;
    uint32_t type = 2;
    uint64_t id;
  } request;
  request.id = region;
  ASSERT_EQ(send(fd, &request, sizeof(request), 0), static_cast<ssize_t>(sizeof(request)));
  char reply[64];
  char control[CMSG_SPACE(4 * sizeof(int))];
  iovec iov{reply, sizeof(reply)};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control;
  mh.msg_controllen = sizeof(control);
  const ssize_t n = recvmsg(fd, &mh, 0);
  ASSERT_GE(n, 8);
  uint32_t status;
  std::memcpy(&status, reply + 4, sizeof(status));
  EXPECT_NE(status, 0u) << "refused";
  EXPECT_EQ(CMSG_FIRSTHDR(&mh), nullptr) << "and no descriptor came with the refusal";
  // Garbage ends the stranger's connection; the domain serves on.
  ASSERT_EQ(send(fd, "garbage", 7, 0), 7);
  EXPECT_EQ(recv(fd, reply, sizeof(reply), 0), 0) << "hung up";
  close(fd);
  std::memset(src_->data(), 1, 64);
  ASSERT_TRUE(ea_->PostWriteWithImm(Local(64), Remote(*mr), 5, 1).ok());
  ASSERT_EQ(PollFor(*b_, 1).size(), 1u);
}

TEST_F(ShmemFabricTest, WritesQueuedBehindAFullRingFailWhenThePeerLeaves) {
  auto mr = *b_->RegisterMemory(dst_->data(), dst_->size(), kAccessRemoteWrite);
  // b never polls: its ring fills, and what does not fit waits in a's queue.
  const size_t depth = a_->capabilities().queue_depth;
  const size_t posts = depth + 10;
  for (size_t i = 0; i < posts; ++i) {
    ASSERT_TRUE(ea_->PostWriteWithImm(Local(8), Remote(*mr), static_cast<uint32_t>(i), i).ok());
  }
  EXPECT_EQ(PollFor(*a_, depth).size(), depth);
  EXPECT_EQ(ea_->Outstanding(), 10u) << "queued behind the full ring";
  eb_.reset();  // the peer leaves; its ring is never drained
  std::vector<Completion> rest = PollFor(*a_, 10);
  ASSERT_EQ(rest.size(), 10u) << "every queued write completes";
  for (const Completion& c : rest) {
    EXPECT_EQ(c.status.code(), absl::StatusCode::kUnavailable) << c.status;
    EXPECT_THAT(std::string(c.status.message()), HasSubstr("is gone"));
  }
  EXPECT_EQ(ea_->PostWrite(Local(8), Remote(*mr), 99).code(), absl::StatusCode::kUnavailable);
}

TEST_F(ShmemFabricTest, APeerThatNeverConnectedBackIsStillSeenLeaving) {
  auto one_way = *a_->CreateEndpoint();
  auto target = *b_->CreateEndpoint();
  ASSERT_TRUE(one_way->Connect(target->LocalAddress()).ok());  // and never the other way
  auto mr = *b_->RegisterMemory(dst_->data(), dst_->size(), kAccessRemoteWrite);
  ASSERT_TRUE(one_way->PostWrite(Local(64), Remote(*mr), 1).ok());
  ASSERT_EQ(PollFor(*a_, 1).size(), 1u);
  target.reset();
  // The next Poll that looks at connections (at most every 10 ms) or a Wait notices.
  absl::Status s;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    (void)a_->Wait(absl::Milliseconds(20));
    PollFor(*a_, 1, absl::Milliseconds(20));
    s = one_way->PostWrite(Local(64), Remote(*mr), 2);
    if (!s.ok()) break;
  }
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("is gone"));
}

// A peer that left is seen once: from then on its hung-up connection no longer ends every Wait
// at once, so a loop whose channel to it has not closed yet still sleeps instead of spinning.
TEST_F(ShmemFabricTest, AWaitSleepsAgainOnceAPeerThatLeftHasBeenSeen) {
  auto mr = *b_->RegisterMemory(dst_->data(), dst_->size(), kAccessRemoteWrite);
  eb_.reset();
  absl::Status s;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    (void)a_->Wait(absl::Milliseconds(20));
    PollFor(*a_, 1, absl::Milliseconds(1));
    s = ea_->PostWrite(Local(64), Remote(*mr), 1);
    if (!s.ok()) break;
  }
  ASSERT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  // The leaving may also ring a's doorbell once (its descriptor server's notice, which can come
  // after the failed post under load): one Wait may end early for that, not every one.
  int quick = 0;
  for (int i = 0; i < 5; ++i) {
    const absl::Time start = absl::Now();
    ASSERT_TRUE(a_->Wait(absl::Milliseconds(20)).ok());
    if (absl::Now() - start < absl::Milliseconds(10)) ++quick;
    PollFor(*a_, 1, absl::Milliseconds(1));
  }
  EXPECT_LE(quick, 1) << "Waits that ended at once, for a hang-up already seen";
}

}  // namespace
}  // namespace tensorverbs::fabric
