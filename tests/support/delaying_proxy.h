// DelayingProxy: a TCP forwarder on 127.0.0.1 that holds each new connection for a fixed time
// before it reaches its target, then passes bytes both ways untouched. It stands for a peer
// that is alive but slow to answer a new connection (a loaded host, hundreds of tasks on few
// cores), which a test cannot get from a real server on demand. The first `freeze` connections
// stop relaying once the server's first bytes (its HTTP/2 SETTINGS) went through: a connection
// that was set up and then went silent, as one to a peer starved of CPU does. Created and
// destroyed on the
// test's thread; it runs one accepting thread and one thread per connection, all joined by the
// destructor.
#ifndef TENSORVERBS_TESTS_SUPPORT_DELAYING_PROXY_H_
#define TENSORVERBS_TESTS_SUPPORT_DELAYING_PROXY_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tensorverbs::testing {

class DelayingProxy {
 public:
  static absl::StatusOr<std::unique_ptr<DelayingProxy>> Start(int target_port, absl::Duration delay,
                                                              int freeze = 0) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return absl::InternalError(absl::StrCat("socket: errno ", errno));
    sockaddr_in addr = Loopback(0);
    socklen_t len = sizeof(addr);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(fd, 64) != 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      const int err = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat("bind/listen on 127.0.0.1: errno ", err));
    }
    auto proxy = std::unique_ptr<DelayingProxy>(
        new DelayingProxy(fd, ntohs(addr.sin_port), target_port, delay, freeze));
    proxy->acceptor_ = std::thread([p = proxy.get()] { p->AcceptLoop(); });
    return proxy;
  }

  ~DelayingProxy() {
    stopping_.store(true);
    ::shutdown(listen_fd_, SHUT_RDWR);  // wakes accept()
    acceptor_.join();
    ::close(listen_fd_);
    std::vector<std::thread> connections;
    {
      absl::MutexLock lock(&mu_);
      connections.swap(connections_);
    }
    for (std::thread& t : connections) t.join();
  }

  int port() const { return port_; }
  int connections_seen() const { return seen_.load(); }

 private:
  DelayingProxy(int fd, int port, int target_port, absl::Duration delay, int freeze)
      : listen_fd_(fd), port_(port), target_port_(target_port), delay_(delay), freeze_(freeze) {}

  static sockaddr_in Loopback(int port) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    return addr;
  }

  void AcceptLoop() {
    while (!stopping_.load()) {
      const int client = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;  // shut down
      }
      const bool freeze = seen_.fetch_add(1) < freeze_;
      absl::MutexLock lock(&mu_);
      connections_.emplace_back([this, client, freeze] { Serve(client, freeze); });
    }
  }

  // Holds the connection, then relays until either side closes or the proxy stops. Polls in
  // short slices so the destructor never waits on a quiet connection.
  void Serve(int client, bool freeze) {
    const absl::Time until = absl::Now() + delay_;
    while (!stopping_.load() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
    const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in target = Loopback(target_port_);
    if (stopping_.load() || server < 0 ||
        ::connect(server, reinterpret_cast<sockaddr*>(&target), sizeof(target)) != 0) {
      if (server >= 0) ::close(server);
      ::close(client);
      return;
    }
    char buf[16384];
    pollfd fds[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
    bool frozen = false;
    while (!stopping_.load()) {
      if (frozen) {  // hold both sockets open, relay nothing, until the proxy stops
        absl::SleepFor(absl::Milliseconds(10));
        continue;
      }
      if (::poll(fds, 2, 50) < 0 && errno != EINTR) break;
      bool done = false;
      for (int i = 0; i < 2 && !done; ++i) {
        if (fds[i].revents == 0) continue;
        const ssize_t n = ::read(fds[i].fd, buf, sizeof(buf));
        if (n <= 0) {
          done = true;
          break;
        }
        for (ssize_t off = 0; off < n && !done;) {
          const ssize_t w = ::send(fds[1 - i].fd, buf + off, n - off, MSG_NOSIGNAL);
          if (w <= 0) done = true;
          off += w;
        }
        if (freeze && i == 1) frozen = true;
      }
      if (done) break;
    }
    ::close(server);
    ::close(client);
  }

  const int listen_fd_;
  const int port_;
  const int target_port_;
  const absl::Duration delay_;
  const int freeze_;
  std::atomic<bool> stopping_{false};
  std::atomic<int> seen_{0};
  std::thread acceptor_;
  absl::Mutex mu_;
  std::vector<std::thread> connections_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tensorverbs::testing

#endif  // TENSORVERBS_TESTS_SUPPORT_DELAYING_PROXY_H_
