// A two-task job written against the installed public API alone. Task 1 sends a float32
// vector in step 1; task 0 receives it, checks every element and sends back its sum; task 1
// checks the sum. `consumer ports` prints two free TCP ports for the cluster spec.
//
//   consumer ports
//   consumer CLUSTER TASK PROTOCOL
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "tensorverbs/tensorverbs.h"

namespace {

constexpr int kElements = 100000;

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::perror("socket");
    std::exit(2);
  }
  close(fd);
  return ntohs(addr.sin_port);
}

int Fail(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "consumer: %s: %s\n", what.c_str(), status.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "ports") {
    std::printf("%d %d\n", FreePort(), FreePort());
    return 0;
  }
  if (argc != 4) {
    std::fprintf(stderr, "usage: consumer ports | consumer CLUSTER TASK PROTOCOL\n");
    return 2;
  }
  absl::StatusOr<tensorverbs::ClusterSpec> cluster = tensorverbs::ClusterSpec::Parse(argv[1]);
  if (!cluster.ok()) return Fail("cluster", cluster.status());
  tensorverbs::TaskOptions options;
  options.cluster = *cluster;
  options.job = "worker";
  options.task = std::atoi(argv[2]);
  options.protocol = argv[3];
  options.recv_timeout = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<tensorverbs::Task>> task = tensorverbs::Task::Start(options);
  if (!task.ok()) return Fail("start", task.status());
  if (absl::Status s = (*task)->WaitForPeers(absl::Seconds(60)); !s.ok()) return Fail("peers", s);
  absl::StatusOr<std::unique_ptr<tensorverbs::Step>> step = (*task)->BeginStep(1);
  if (!step.ok()) return Fail("step", step.status());

  if (options.task == 1) {
    absl::StatusOr<tensorverbs::Tensor> x =
        (*task)->Empty(tensorverbs::DataType::kFloat32, tensorverbs::TensorShape::Of({kElements}));
    if (!x.ok()) return Fail("empty", x.status());
    for (int i = 0; i < kElements; ++i) x->flat<float>()[i] = static_cast<float>(i % 7);
    if (absl::Status s = (*step)->Send("worker:0", "x", *x); !s.ok()) return Fail("send", s);
    absl::StatusOr<tensorverbs::Tensor> sum = (*step)->Recv("worker:0", "sum", absl::Seconds(60));
    if (!sum.ok()) return Fail("recv sum", sum.status());
    double want = 0;
    for (int i = 0; i < kElements; ++i) want += i % 7;
    if (sum->dtype() != tensorverbs::DataType::kFloat64 || sum->flat<double>()[0] != want) {
      std::fprintf(stderr, "consumer: wrong sum %s\n", sum->DebugString().c_str());
      return 1;
    }
  } else {
    absl::StatusOr<tensorverbs::Tensor> x = (*step)->Recv("/job:worker/replica:0/task:1", "x");
    if (!x.ok()) return Fail("recv x", x.status());
    if (x->dtype() != tensorverbs::DataType::kFloat32 || x->NumElements() != kElements) {
      std::fprintf(stderr, "consumer: got %s\n", x->DebugString().c_str());
      return 1;
    }
    double total = 0;
    for (int i = 0; i < kElements; ++i) {
      if (x->flat<float>()[i] != static_cast<float>(i % 7)) {
        std::fprintf(stderr, "consumer: element %d is %f\n", i, x->flat<float>()[i]);
        return 1;
      }
      total += x->flat<float>()[i];
    }
    tensorverbs::Tensor sum =
        tensorverbs::Tensor::Make(tensorverbs::DataType::kFloat64, tensorverbs::TensorShape());
    sum.flat<double>()[0] = total;
    if (absl::Status s = (*step)->Send("worker:1", "sum", sum); !s.ok()) return Fail("send", s);
    if (absl::Status s = (*step)->WaitUntilSendsTaken(absl::Seconds(60)); !s.ok()) {
      return Fail("sum not taken", s);
    }
  }
  const tensorverbs::TaskStats stats = (*task)->stats();
  std::printf("task %d (tensorverbs %s, %s): ok, %lld tensors received, %lld bytes copied\n",
              options.task, tensorverbs::Version(), (*task)->protocol().c_str(),
              static_cast<long long>(stats.tensors), static_cast<long long>(stats.copied_bytes));
  return 0;
}
