#include "python/src/torch/p2p_matcher.h"

#include <vector>

namespace tensorverbs::torch_backend {

P2pMatcher::P2pMatcher(int size, int self, PostRecv post)
    : size_(size), self_(self), post_(std::move(post)) {}

P2pMatcher::Stream& P2pMatcher::StreamOf(int src, int64_t tag) { return streams_[{src, tag}]; }

void P2pMatcher::PostNeeded(int src, int64_t tag, size_t bytes, std::deque<Post>* to_post) {
  int64_t accepting = 0;
  for (const Waiter& w : waiters_[tag]) accepting += (w.src == src || w.src == -1) ? 1 : 0;
  Stream& stream = StreamOf(src, tag);
  while (stream.posted - stream.delivered < accepting) {
    const int64_t n = stream.posted++;
    to_post->push_back(Post{n, bytes,
                            [self = shared_from_this(), src, tag, n](absl::StatusOr<Tensor> m) {
                              self->Arrived(src, tag, n, std::move(m));
                            },
                            Tensor()});
  }
}

void P2pMatcher::Start(int src, int64_t tag, std::deque<Post>& to_post) {
  for (Post& p : to_post) post_(src, tag, p.n, p.bytes, std::move(p.into), std::move(p.done));
}

void P2pMatcher::Recv(int src, int64_t tag, size_t bytes, Delivery done, Tensor into) {
  std::deque<Post> to_post;
  absl::StatusOr<Tensor> now = absl::UnknownError("unset");
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.ok()) {
      now = failed_;
    } else if (Stream& stream = StreamOf(src, tag); !stream.ready.empty()) {
      now = std::move(stream.ready.front());
      stream.ready.pop_front();
      --kept_;
    } else {
      std::deque<Waiter>& waiting = waiters_[tag];
      // With only recvs from known ranks waiting, the stream's messages go to its waiters in
      // order, so this one gets message `delivered` + (its waiters ahead of it).
      int64_t ahead = 0;
      bool any_source = false;
      for (const Waiter& w : waiting) {
        any_source = any_source || w.src == -1;
        ahead += w.src == src ? 1 : 0;
      }
      waiting.push_back(Waiter{src, std::move(done)});
      PostNeeded(src, tag, bytes, &to_post);
      done = nullptr;
      if (!any_source && !to_post.empty() && to_post.back().n == stream.delivered + ahead) {
        to_post.back().into = std::move(into);
      }
    }
  }
  if (done) {
    done(std::move(now), src);
    return;
  }
  Start(src, tag, to_post);
}

void P2pMatcher::RecvAny(int64_t tag, size_t bytes, Delivery done) {
  std::vector<std::pair<int, std::deque<Post>>> to_post;
  absl::StatusOr<Tensor> now = absl::UnknownError("unset");
  int from = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.ok()) {
      now = failed_;
    } else {
      for (int src = 0; src < size_ && from < 0; ++src) {
        if (src == self_) continue;
        Stream& stream = StreamOf(src, tag);
        if (!stream.ready.empty()) {
          now = std::move(stream.ready.front());
          stream.ready.pop_front();
          --kept_;
          from = src;
        }
      }
      if (from < 0) {
        waiters_[tag].push_back(Waiter{-1, std::move(done)});
        done = nullptr;
        for (int src = 0; src < size_; ++src) {
          if (src == self_) continue;
          to_post.emplace_back(src, std::deque<Post>());
          PostNeeded(src, tag, bytes, &to_post.back().second);
        }
      }
    }
  }
  if (done) {
    done(std::move(now), from);
    return;
  }
  for (auto& [src, posts] : to_post) Start(src, tag, posts);
}

void P2pMatcher::Arrived(int src, int64_t tag, int64_t n, absl::StatusOr<Tensor> message) {
  std::vector<std::pair<Delivery, absl::StatusOr<Tensor>>> deliveries;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_.ok()) return;  // its waiter, if any, had the failure already
    Stream& stream = StreamOf(src, tag);
    stream.early.emplace(n, std::move(message));
    // Hand on every message that is next in order.
    for (auto it = stream.early.find(stream.delivered); it != stream.early.end();
         it = stream.early.find(stream.delivered)) {
      absl::StatusOr<Tensor> next = std::move(it->second);
      stream.early.erase(it);
      ++stream.delivered;
      std::deque<Waiter>& waiting = waiters_[tag];
      auto w = waiting.begin();
      while (w != waiting.end() && w->src != src && w->src != -1) ++w;
      if (w == waiting.end()) {
        stream.ready.push_back(std::move(next));
        ++kept_;
      } else {
        deliveries.emplace_back(std::move(w->done), std::move(next));
        waiting.erase(w);
      }
    }
  }
  for (auto& [done, next] : deliveries) done(std::move(next), src);
}

void P2pMatcher::Fail(const absl::Status& status) {
  std::vector<Waiter> waiting;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.ok()) failed_ = status;
    for (auto& [tag, list] : waiters_) {
      for (Waiter& w : list) waiting.push_back(std::move(w));
    }
    waiters_.clear();
    streams_.clear();
    kept_ = 0;
  }
  for (Waiter& w : waiting) w.done(status, w.src);
}

int64_t P2pMatcher::kept() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kept_;
}

}  // namespace tensorverbs::torch_backend
