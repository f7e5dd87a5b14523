// What the same-host fabric promises beyond the fabric contract (fabric_conformance_test runs
// that on it): which path a write takes, access rights enforced where the writer stands,
// one peer per endpoint, no regions for strangers, and queued work failing when a peer leaves.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/common/shared_memory.h"
#include "src/fabric/fabric.h"
#include "src/fabric/shmem/shmem.h"

namespace tensorverbs::fabric {
namespace {

using ::testing::HasSubstr;

class ShmemFabricTest : public ::testing::Test {
 protected:
  void SetUp() override {
    a_ = *OpenDomain("shmem", DomainOptions());
    b_ = *OpenDomain("shmem", DomainOptions());
    ea_ = *a_->CreateEndpoint();
    eb_ = *b_->CreateEndpoint();
    ASSERT_TRUE(ea_->Connect(eb_->LocalAddress()).ok());
    ASSERT_TRUE(eb_->Connect(ea_->LocalAddress()).ok());
    src_ = *SharedMemory::Create(1 << 20, "test-src");
    dst_ = *SharedMemory::Create(1 << 20, "test-dst");
    src_mr_ = *a_->RegisterMemory(src_->data(), src_->size(), kAccessLocal);
  }

  RemoteBuffer Remote(const MemoryRegion& mr) {
    return RemoteBuffer{mr.PackRemoteKey(), reinterpret_cast<uint64_t>(mr.base()), mr.length()};
  }
  LocalBuffer Local(size_t n) { return LocalBuffer{src_mr_.get(), src_->data(), n}; }

  // Polls `d` until `n` completions arrived or `timeout` passed.
  std::vector<Completion> PollFor(Domain& d, size_t n, absl::Duration timeout = absl::Seconds(20)) {
    std::vector<Completion> got;
    const absl::Time deadline = absl::Now() + timeout;
    Completion batch[64];
    while (got.size() < n && absl::Now() < deadline) {
      absl::StatusOr<size_t> k = d.Poll(absl::MakeSpan(batch));
      EXPECT_TRUE(k.ok()) << k.status();
      if (!k.ok()) break;
      got.insert(got.end(), batch, batch + *k);
    }
    return got;
  }

  std::unique_ptr<Domain> a_, b_;
  std::unique_ptr<Endpoint> ea_, eb_;
  std::unique_ptr<SharedMemory> src_, dst_;
  std::unique_ptr<MemoryRegion> src_mr_;
};

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

TEST_F(ShmemFabricTest, AccessRightsAreEnforcedOnTheWritersSide) {
  auto read_only = *b_->RegisterMemory(dst_->data(), dst_->size(), kAccessRemoteRead);
  absl::Status s = ea_->PostWrite(Local(64), Remote(*read_only), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  std::strcpy(static_cast<char*>(dst_->data()), "readable");
  auto sink_mr = *a_->RegisterMemory(src_->data(), src_->size(), kAccessLocal);
  ASSERT_TRUE(ea_->PostRead({sink_mr.get(), src_->data(), 9}, Remote(*read_only), 2).ok());
  std::vector<Completion> done = PollFor(*a_, 1);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_TRUE(done[0].status.ok()) << done[0].status;
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

}  // namespace
}  // namespace tensorverbs::fabric
