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
    return
        [this](int src, int64_t tag, int64_t n, size_t, Tensor into, P2pMatcher::NetworkDone done) {
          posted_[{src, tag, n}] = std::move(done);
          into_[{src, tag, n}] = into.data();
        };
  }
  bool Posted(int src, int64_t tag, int64_t n) const { return posted_.count({src, tag, n}) > 0; }
  // The memory the network recv of message n of (src, tag) was to land in (null: none).
  const void* Into(int src, int64_t tag, int64_t n) const {
    auto it = into_.find({src, tag, n});
    return it == into_.end() ? nullptr : it->second;
  }
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
  std::map<std::tuple<int, int64_t, int64_t>, const void*> into_;
};

// A recv's own memory for its message to land in.
Tensor Memory() { return Tensor::Make(DataType::kInt64, TensorShape::Of({1})); }

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

// A recv's memory goes with a network recv only when that recv's message is certainly the
// recv's own: not past a recv from any source that waits on the tag, not onto a network recv
// an earlier recv started, not when the message was already kept.
TEST(P2pMatcherTest, ARecvsMemoryGoesWithTheNetworkRecvOfItsOwnMessageOnly) {
  FakeNetwork net;
  auto matcher = std::make_shared<P2pMatcher>(3, 0, net.Poster());
  Got got;
  const Tensor a = Memory(), b = Memory(), c = Memory(), d = Memory(), e = Memory();
  // Two recvs from rank 1: messages 0 and 1, each into its own recv's memory.
  matcher->Recv(1, 0, 8, got.For(0), a);
  matcher->Recv(1, 0, 8, got.For(1), b);
  EXPECT_EQ(net.Into(1, 0, 0), a.data());
  EXPECT_EQ(net.Into(1, 0, 1), b.data());
  net.Arrive(1, 0, 1, 11);
  net.Arrive(1, 0, 0, 10);
  EXPECT_EQ(got.order, (std::vector<std::tuple<int, int64_t, int>>{{0, 10, 1}, {1, 11, 1}}));
  // A recv from any source waits on tag 3: it may take rank 1's next message.
  matcher->RecvAny(3, 8, got.For(2));
  matcher->Recv(1, 3, 8, got.For(3), c);
  ASSERT_TRUE(net.Posted(1, 3, 1));
  EXPECT_EQ(net.Into(1, 3, 0), nullptr);
  EXPECT_EQ(net.Into(1, 3, 1), nullptr);
  // Rank 2 answers the recv from any source; rank 1's message 0 of tag 4 stays asked for, so a
  // recv from rank 1 waits on that network recv, started without memory of its own.
  matcher->RecvAny(4, 8, got.For(4));
  net.Arrive(2, 4, 0, 20);
  matcher->Recv(1, 4, 8, got.For(5), d);
  EXPECT_FALSE(net.Posted(1, 4, 1));
  EXPECT_EQ(net.Into(1, 4, 0), nullptr);
  net.Arrive(1, 4, 0, 40);
  EXPECT_EQ(got.order.back(), std::make_tuple(5, 40, 1));
  // A message kept before its recv came needs no network recv at all.
  net.Arrive(2, 3, 0, 30);  // the recv from any source on tag 3 takes it
  net.Arrive(1, 3, 0, 31);  // kept
  net.Arrive(1, 3, 1, 32);  // the recv from rank 1 on tag 3
  EXPECT_EQ(got.order.back(), std::make_tuple(3, 31, 1));
  EXPECT_EQ(matcher->kept(), 1);
  matcher->Recv(1, 3, 8, got.For(6), e);
  EXPECT_EQ(got.order.back(), std::make_tuple(6, 32, 1));
  EXPECT_FALSE(net.Posted(1, 3, 2));
}

TEST(P2pMatcherTest, APostThatCompletesInsideTheCallDeliversWithoutDeadlock) {
  auto matcher = std::make_shared<P2pMatcher>(
      2, 0, [](int src, int64_t tag, int64_t n, size_t, Tensor, P2pMatcher::NetworkDone done) {
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
