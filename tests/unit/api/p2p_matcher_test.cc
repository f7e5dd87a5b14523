// P2pMatcher (python/src/torch/p2p_matcher.h): the torch backend's point-to-point matching, with
// the network recvs played by hand in chosen orders.
#include "python/src/torch/p2p_matcher.h"

#include <map>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::torch_backend {
namespace {

// The network: records every posted recv, completes them when a test says so.
class FakeNetwork {
 public:
  P2pMatcher::PostRecv Poster() {
    return [this](int src, int64_t tag, int64_t n, size_t, P2pMatcher::NetworkDone done) {
      posted_[{src, tag, n}] = std::move(done);
    };
  }
  bool Posted(int src, int64_t tag, int64_t n) const { return posted_.count({src, tag, n}) > 0; }
  size_t size() const { return posted_.size(); }
  // Message n of (src, tag) arrives, holding the value `v`.
  void Arrive(int src, int64_t tag, int64_t n, int64_t v) {
    Tensor t = Tensor::Make(DataType::kInt64, TensorShape::Of({1}));
    *t.flat<int64_t>() = v;
    Complete(src, tag, n, t);
  }
  void Complete(int src, int64_t tag, int64_t n, absl::StatusOr<Tensor> message) {
    auto it = posted_.find({src, tag, n});
    ASSERT_NE(it, posted_.end()) << "message " << n << " of (" << src << ", " << tag
                                 << ") was never asked for";
    P2pMatcher::NetworkDone done = std::move(it->second);
    posted_.erase(it);
    done(std::move(message));
  }

 private:
  std::map<std::tuple<int, int64_t, int64_t>, P2pMatcher::NetworkDone> posted_;
};

// What the recvs got, in the order they completed: (recv index, value or -1 on error, src).
struct Got {
  std::vector<std::tuple<int, int64_t, int>> order;
  P2pMatcher::Delivery For(int index) {
    return [this, index](absl::StatusOr<Tensor> m, int src) {
      order.emplace_back(index, m.ok() ? *m->flat<int64_t>() : -1, src);
    };
  }
};

TEST(P2pMatcherTest, MessagesOfOneStreamArriveInTheOrderSentWhateverTheNetworkOrder) {
  FakeNetwork net;
  auto matcher = std::make_shared<P2pMatcher>(2, 0, net.Poster());
  Got got;
  for (int i = 0; i < 3; ++i) matcher->Recv(1, 5, 8, got.For(i));
  ASSERT_EQ(net.size(), 3u);
  net.Arrive(1, 5, 2, 102);
  net.Arrive(1, 5, 1, 101);
  EXPECT_TRUE(got.order.empty());  // message 0 has not come
  net.Arrive(1, 5, 0, 100);
  EXPECT_EQ(got.order,
            (std::vector<std::tuple<int, int64_t, int>>{{0, 100, 1}, {1, 101, 1}, {2, 102, 1}}));
}

TEST(P2pMatcherTest, TagsAreSeparateStreams) {
  FakeNetwork net;
  auto matcher = std::make_shared<P2pMatcher>(2, 1, net.Poster());
  Got got;
  matcher->Recv(0, 1, 8, got.For(0));
  matcher->Recv(0, 2, 8, got.For(1));
  ASSERT_TRUE(net.Posted(0, 1, 0));
  ASSERT_TRUE(net.Posted(0, 2, 0));
  net.Arrive(0, 2, 0, 20);
  net.Arrive(0, 1, 0, 10);
  EXPECT_EQ(got.order, (std::vector<std::tuple<int, int64_t, int>>{{1, 20, 0}, {0, 10, 0}}));
}

TEST(P2pMatcherTest, AnySourceTakesTheFirstArrivalAndKeepsTheOthersForLaterRecvs) {
  FakeNetwork net;
  auto matcher = std::make_shared<P2pMatcher>(4, 0, net.Poster());
  Got got;
  matcher->RecvAny(0, 8, got.For(0));
  ASSERT_TRUE(net.Posted(1, 0, 0));
  ASSERT_TRUE(net.Posted(2, 0, 0));
  ASSERT_TRUE(net.Posted(3, 0, 0));
  net.Arrive(2, 0, 0, 200);
  ASSERT_EQ(got.order.size(), 1u);
  EXPECT_EQ(got.order[0], std::make_tuple(0, 200, 2));
  // Rank 3's message comes with no recv waiting: kept, then taken by the next recv from 3.
  net.Arrive(3, 0, 0, 300);
  EXPECT_EQ(matcher->kept(), 1);
  matcher->Recv(3, 0, 8, got.For(1));
  EXPECT_EQ(got.order.back(), std::make_tuple(1, 300, 3));
  EXPECT_EQ(matcher->kept(), 0);
  // Rank 1's first message is still asked for; a directed recv from 1 waits on it, not on a
  // second one.
  matcher->Recv(1, 0, 8, got.For(2));
  EXPECT_FALSE(net.Posted(1, 0, 1));
  net.Arrive(1, 0, 0, 100);
  EXPECT_EQ(got.order.back(), std::make_tuple(2, 100, 1));
}

TEST(P2pMatcherTest, TheOldestWaitingRecvThatAcceptsTheSourceGetsTheMessage) {
  FakeNetwork net;
  auto matcher = std::make_shared<P2pMatcher>(3, 0, net.Poster());
  Got got;
  matcher->RecvAny(4, 8, got.For(0));  // older: any source
  matcher->Recv(1, 4, 8, got.For(1));  // younger: from rank 1
  net.Arrive(1, 4, 0, 10);             // goes to the older
  ASSERT_EQ(got.order.size(), 1u);
  EXPECT_EQ(got.order[0], std::make_tuple(0, 10, 1));
  ASSERT_TRUE(net.Posted(1, 4, 1));
  net.Arrive(1, 4, 1, 11);
  EXPECT_EQ(got.order.back(), std::make_tuple(1, 11, 1));
}

TEST(P2pMatcherTest, AFailedNetworkRecvReachesItsWaiterAndFailFailsTheRestOnce) {
  FakeNetwork net;
  auto matcher = std::make_shared<P2pMatcher>(2, 0, net.Poster());
  Got got;
  matcher->Recv(1, 0, 8, got.For(0));
  matcher->Recv(1, 0, 8, got.For(1));
  net.Complete(1, 0, 0, absl::UnavailableError("peer gone"));
  ASSERT_EQ(got.order.size(), 1u);
  EXPECT_EQ(got.order[0], std::make_tuple(0, -1, 1));
  matcher->Fail(absl::CancelledError("group destroyed"));
  ASSERT_EQ(got.order.size(), 2u);
  EXPECT_EQ(got.order[1], std::make_tuple(1, -1, 1));
  // A late arrival after Fail reaches no one; a later recv fails at once.
  net.Arrive(1, 0, 1, 7);
  matcher->Recv(1, 0, 8, got.For(2));
  ASSERT_EQ(got.order.size(), 3u);
  EXPECT_EQ(got.order[2], std::make_tuple(2, -1, 1));
}

TEST(P2pMatcherTest, APostThatCompletesInsideTheCallDeliversWithoutDeadlock) {
  auto matcher = std::make_shared<P2pMatcher>(
      2, 0, [](int src, int64_t tag, int64_t n, size_t, P2pMatcher::NetworkDone done) {
        Tensor t = Tensor::Make(DataType::kInt64, TensorShape::Of({1}));
        *t.flat<int64_t>() = 1000 + n;
        done(t);  // inside Recv, as a transport may do
      });
  Got got;
  matcher->Recv(1, 0, 8, got.For(0));
  matcher->RecvAny(0, 8, got.For(1));
  ASSERT_EQ(got.order.size(), 2u);
  EXPECT_EQ(got.order[0], std::make_tuple(0, 1000, 1));
  EXPECT_EQ(got.order[1], std::make_tuple(1, 1001, 1));
}

}  // namespace
}  // namespace tensorverbs::torch_backend
