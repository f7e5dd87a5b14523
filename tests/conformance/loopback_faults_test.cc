// The loopback fabric's fault injection, which the protocol tests rely on.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "src/fabric/loopback/loopback.h"

namespace tensorverbs::fabric {
namespace {

class LoopbackFaultsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    a_ = *OpenDomain("loopback", DomainOptions());
    b_ = *OpenDomain("loopback", DomainOptions());
    ea_ = *a_->CreateEndpoint();
    eb_ = *b_->CreateEndpoint();
    ASSERT_TRUE(ea_->Connect(eb_->LocalAddress()).ok());
    ASSERT_TRUE(eb_->Connect(ea_->LocalAddress()).ok());
    src_.assign(4096, 'x');
    dst_.assign(4096, 0);
    src_mr_ = *a_->RegisterMemory(src_.data(), src_.size(), kAccessLocal);
    dst_mr_ = *b_->RegisterMemory(dst_.data(), dst_.size(), kAccessRemoteWrite | kAccessRemoteRead);
  }

  absl::Status Write(uint32_t imm, size_t len = 64) {
    return ea_->PostWriteWithImm({src_mr_.get(), src_.data(), len},
                                 {dst_mr_->PackRemoteKey(), reinterpret_cast<uint64_t>(dst_.data()), len},
                                 imm, imm);
  }
  std::vector<Completion> Drain(Domain& d) {
    std::vector<Completion> out;
    Completion batch[16];
    size_t n;
    while ((n = *d.Poll(absl::MakeSpan(batch))) > 0) out.insert(out.end(), batch, batch + n);
    return out;
  }
  std::vector<uint32_t> Imms(Domain& d) {
    std::vector<uint32_t> out;
    for (const Completion& c : Drain(d)) out.push_back(c.imm);
    return out;
  }

  std::unique_ptr<Domain> a_, b_;
  std::unique_ptr<Endpoint> ea_, eb_;
  std::string src_, dst_;
  std::unique_ptr<MemoryRegion> src_mr_, dst_mr_;
};

TEST_F(LoopbackFaultsTest, FailNthPostAndRegistration) {
  loopback::SetFaults(a_.get(), {.fail_post_nth = 2, .fail_register_nth = 1});
  EXPECT_TRUE(Write(1).ok());
  EXPECT_EQ(Write(2).code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(Write(3).ok());
  EXPECT_EQ(Imms(*b_), (std::vector<uint32_t>{1, 3}));
  std::string more(100, 'y');
  EXPECT_EQ(a_->RegisterMemory(more.data(), more.size(), kAccessLocal).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(a_->RegisterMemory(more.data(), more.size(), kAccessLocal).ok());
}

TEST_F(LoopbackFaultsTest, ErrorCompletionDoesNothing) {
  loopback::SetFaults(a_.get(), {.error_completion_nth = 1});
  ASSERT_TRUE(Write(1).ok());
  std::vector<Completion> local = Drain(*a_);
  ASSERT_EQ(local.size(), 1u);
  EXPECT_EQ(local[0].status.code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(Drain(*b_).empty());
  EXPECT_EQ(dst_[0], 0) << "nothing landed";
}

TEST_F(LoopbackFaultsTest, DropDuplicateAndCorruptImmediates) {
  loopback::SetFaults(a_.get(), {.drop_imm_nth = 1, .duplicate_imm_nth = 2, .corrupt_write_nth = 3});
  ASSERT_TRUE(Write(10).ok());
  EXPECT_EQ(dst_[0], 'x') << "a dropped immediate still lands its bytes";
  ASSERT_TRUE(Write(20).ok());
  std::memset(dst_.data(), 0, dst_.size());
  ASSERT_TRUE(Write(30, 64).ok());
  EXPECT_EQ(Imms(*b_), (std::vector<uint32_t>{20, 20, 30}));
  EXPECT_NE(std::memcmp(dst_.data(), src_.data(), 64), 0) << "the third write was corrupted";
  EXPECT_EQ(Drain(*a_).size(), 3u) << "local completions are unaffected";
}

TEST_F(LoopbackFaultsTest, DelayReorderAndStall) {
  loopback::SetFaults(b_.get(), {.delay_polls = 2});
  ASSERT_TRUE(Write(1).ok());
  Completion c[4];
  EXPECT_EQ(*b_->Poll(absl::MakeSpan(c)), 0u);
  EXPECT_EQ(*b_->Poll(absl::MakeSpan(c)), 0u);
  EXPECT_EQ(*b_->Poll(absl::MakeSpan(c)), 1u);

  loopback::SetFaults(b_.get(), {.reverse_order = true});
  for (uint32_t i = 1; i <= 3; ++i) ASSERT_TRUE(Write(i).ok());
  EXPECT_EQ(Imms(*b_), (std::vector<uint32_t>{3, 2, 1}));

  loopback::SetFaults(b_.get(), {.stalled = true});
  ASSERT_TRUE(Write(9).ok());
  EXPECT_TRUE(Drain(*b_).empty());
  loopback::SetFaults(b_.get(), {});
  EXPECT_EQ(Imms(*b_), (std::vector<uint32_t>{9}));
}

TEST_F(LoopbackFaultsTest, AccessRightsAndUnknownPeers) {
  // src_ is registered for local access only: reading it remotely is refused.
  std::string local(64, 0);
  auto local_mr = *b_->RegisterMemory(local.data(), local.size(), kAccessLocal);
  EXPECT_EQ(eb_->PostRead({local_mr.get(), local.data(), 64},
                          {src_mr_->PackRemoteKey(), reinterpret_cast<uint64_t>(src_.data()), 64}, 1)
                .code(),
            absl::StatusCode::kPermissionDenied);
  auto lonely = *a_->CreateEndpoint();
  EXPECT_EQ(lonely->Connect("loopback:999999:1").code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(lonely->PostWrite({}, {dst_mr_->PackRemoteKey(), reinterpret_cast<uint64_t>(dst_.data()), 0}, 1).code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace tensorverbs::fabric
