// The fixture of the ibverbs backend's tests against FakeNic: a domain opened on the software
// NIC, two connected endpoints, a source and a destination registered; and connected pairs as
// channels have them. Single-threaded, like the fake.
#ifndef TENSORVERBS_TESTS_UNIT_FABRIC_IBVERBS_FAKE_NIC_FIXTURE_H_
#define TENSORVERBS_TESTS_UNIT_FABRIC_IBVERBS_FAKE_NIC_FIXTURE_H_

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "src/fabric/fabric.h"
#include "src/fabric/ibverbs/ibverbs.h"
#include "tests/unit/fabric/fake_nic.h"

namespace tensorverbs::testing {

using fabric::Completion;
using fabric::Domain;
using fabric::DomainOptions;
using fabric::Endpoint;
using fabric::kAccessLocal;
using fabric::kAccessRemoteRead;
using fabric::kAccessRemoteWrite;
using fabric::MemoryRegion;
using fabric::RemoteBuffer;

// Endpoints as a channel has them: a connected pair.
inline std::pair<std::unique_ptr<Endpoint>, std::unique_ptr<Endpoint>> ConnectedPair(
    Domain& domain) {
  std::unique_ptr<Endpoint> x = *domain.CreateEndpoint();
  std::unique_ptr<Endpoint> y = *domain.CreateEndpoint();
  EXPECT_TRUE(x->Connect(y->LocalAddress()).ok());
  EXPECT_TRUE(y->Connect(x->LocalAddress()).ok());
  return {std::move(x), std::move(y)};
}

class IbverbsFakeNicTest : public ::testing::Test {
 protected:
  void SetUp() override { FakeNic::Get().Reset(); }

  void Open(RdmaConfig config = RdmaConfig(), DomainOptions options = DomainOptions()) {
    absl::StatusOr<std::unique_ptr<Domain>> d = fabric::ibverbs::OpenIbverbsDomain(options, config);
    ASSERT_TRUE(d.ok()) << d.status();
    domain_ = *std::move(d);
    a_ = *domain_->CreateEndpoint();
    b_ = *domain_->CreateEndpoint();
    ASSERT_TRUE(a_->Connect(b_->LocalAddress()).ok());
    ASSERT_TRUE(b_->Connect(a_->LocalAddress()).ok());
    src_.assign(1 << 16, 'a');
    dst_.assign(1 << 16, 0);
    src_mr_ = *domain_->RegisterMemory(src_.data(), src_.size(), kAccessLocal);
    dst_mr_ =
        *domain_->RegisterMemory(dst_.data(), dst_.size(), kAccessRemoteWrite | kAccessRemoteRead);
  }
  RemoteBuffer Dst(size_t offset, size_t len) {
    return {dst_mr_->PackRemoteKey(), reinterpret_cast<uint64_t>(dst_.data()) + offset, len};
  }
  std::vector<Completion> Drain() {
    std::vector<Completion> out;
    Completion c[16];
    for (int i = 0; i < 1000; ++i) {
      size_t n = *domain_->Poll(absl::MakeSpan(c));
      if (n == 0 && i > 2) break;
      out.insert(out.end(), c, c + n);
    }
    return out;
  }

  // Posts `each` writes from each of `channels` new channels, nothing polled between, and returns
  // how many the device took at once (the rest wait in their endpoints' queues for room in a
  // shared CQ); then drains them all.
  size_t SendsTakenAtOnce(int channels, int each) {
    std::vector<std::pair<std::unique_ptr<Endpoint>, std::unique_ptr<Endpoint>>> pairs;
    for (int i = 0; i < channels; ++i) pairs.push_back(ConnectedPair(*domain_));
    const int before = FakeNic::Get().sends_posted;
    for (auto& [x, y] : pairs) {
      for (int i = 0; i < each; ++i) {
        EXPECT_TRUE(
            x->PostWriteWithImm({src_mr_.get(), src_.data(), 16}, Dst(16 * i, 16), 1, i).ok());
      }
    }
    const size_t taken = static_cast<size_t>(FakeNic::Get().sends_posted - before);
    (void)Drain();
    return taken;
  }

  std::unique_ptr<Domain> domain_;
  std::unique_ptr<Endpoint> a_, b_;
  std::string src_, dst_;
  std::unique_ptr<MemoryRegion> src_mr_, dst_mr_;
};

}  // namespace tensorverbs::testing

#endif  // TENSORVERBS_TESTS_UNIT_FABRIC_IBVERBS_FAKE_NIC_FIXTURE_H_
