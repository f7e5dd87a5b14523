// The fixture of the same-host fabric's own tests (shmem_fabric_test.cc, shmem_device_test.cc):
// two connected shmem domains with shared source and destination buffers, helpers that poll for
// completions, and raw access to a domain's descriptor server for the tests that play a
// stranger. Tests run it on their own thread; nothing here is shared between tests.
#ifndef TENSORVERBS_TESTS_CONFORMANCE_SHMEM_FIXTURE_H_
#define TENSORVERBS_TESTS_CONFORMANCE_SHMEM_FIXTURE_H_

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/common/shared_memory.h"
#include "src/fabric/fabric.h"
#include "src/fabric/shmem/shmem.h"
#include "src/fabric/shmem/wire.h"

namespace tensorverbs::fabric::shmem_testing {

// A thread that polls `d` until Stop (or its destructor, on every way out of a test), handing
// each completion to `on_completion` on that thread: the peer's progress thread in a test.
class PollingThread {
 public:
  PollingThread(Domain& d, std::function<void(const Completion&)> on_completion)
      : thread_([this, &d, handle = std::move(on_completion)] {
          Completion batch[16];
          while (!stop_.load()) {
            absl::StatusOr<size_t> k = d.Poll(absl::MakeSpan(batch));
            if (!k.ok()) return;
            for (size_t i = 0; i < *k; ++i) handle(batch[i]);
          }
        }) {}
  PollingThread(const PollingThread&) = delete;
  PollingThread& operator=(const PollingThread&) = delete;
  ~PollingThread() { Stop(); }
  void Stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::atomic<bool> stop_{false};  // before thread_, which reads it from its start
  std::thread thread_;
};

class ShmemFabricTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_NO_FATAL_FAILURE(Open(DomainOptions())); }

  // Two connected domains with `options`, and shared buffers `src_` (registered on a) and `dst_`.
  void Open(const DomainOptions& options) {
    a_ = *OpenDomain("shmem", options);
    b_ = *OpenDomain("shmem", options);
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

  // Waits for one completion on `d` and checks that it succeeded.
  void ExpectOneOk(Domain& d) {
    std::vector<Completion> done = PollFor(d, 1);
    ASSERT_EQ(done.size(), 1u);
    EXPECT_TRUE(done[0].status.ok()) << done[0].status;
  }
  // Waits for a write with immediate of `n` bytes from a to complete there and arrive at b.
  void ExpectWriteLanded(size_t n) {
    ASSERT_NO_FATAL_FAILURE(ExpectOneOk(*a_));
    std::vector<Completion> arrived = PollFor(*b_, 1);
    ASSERT_EQ(arrived.size(), 1u);
    EXPECT_EQ(arrived[0].byte_len, n);
  }

  // A process of our user that speaks to `endpoint`'s domain's descriptor server directly,
  // without the fabric: connected, or -1.
  static int ConnectRaw(const Endpoint& endpoint) {
    std::vector<std::string> parts = absl::StrSplit(endpoint.LocalAddress(), ':');
    uint64_t uid = 0;
    if (parts.size() != 3 || !absl::SimpleHexAtoi(parts[1], &uid)) return -1;
    const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    socklen_t len;
    sockaddr_un addr = shmem::SocketAddress(uid, &len);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
      close(fd);
      return -1;
    }
    return fd;
  }
  static uint64_t EndpointId(const Endpoint& endpoint) {
    std::vector<std::string> parts = absl::StrSplit(endpoint.LocalAddress(), ':');
    uint64_t id = 0;
    return parts.size() == 3 && absl::SimpleAtoi(parts[2], &id) ? id : 0;
  }
  static shmem::PackedKey KeyOf(const MemoryRegion& mr) {
    shmem::PackedKey key;
    std::memcpy(&key, mr.PackRemoteKey().data(), sizeof(key));
    return key;
  }
  // One request on a raw connection: the reply, and the descriptors that came with it in `fds`.
  static shmem::Reply AskRaw(int fd, shmem::RequestType type, uint64_t id, int* fds, int* nfds) {
    shmem::Request request{shmem::kRequestMagic, type, id};
    shmem::Reply reply{};
    *nfds = 0;
    if (!shmem::SendWithFds(fd, &request, sizeof(request), nullptr, 0) ||
        shmem::RecvWithFds(fd, &reply, sizeof(reply), fds, 2, nfds) != sizeof(reply)) {
      reply.status = ~0u;
    }
    return reply;
  }

  std::unique_ptr<Domain> a_, b_;
  std::unique_ptr<Endpoint> ea_, eb_;
  std::unique_ptr<SharedMemory> src_, dst_;
  std::unique_ptr<MemoryRegion> src_mr_;
};

}  // namespace tensorverbs::fabric::shmem_testing

#endif  // TENSORVERBS_TESTS_CONFORMANCE_SHMEM_FIXTURE_H_
