// PickFreePorts (tensorverbs/placement.h). Two pickers that run at once in one network namespace
// (ctest -j, several ranks of one job) must not hand out the same port, and a port freed after
// the pick must not be taken by the kernel for an outgoing connection before the task binds it:
// the first is what the abstract-socket reservation is for, the second why the ports come from
// outside the ephemeral range.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/common/mutex.h"
#include "tensorverbs/placement.h"

namespace tensorverbs {
namespace {

// Below this are the well-known and commonly configured service ports.
constexpr int kLowestPort = 10000;
constexpr int kAttempts = 5000;

struct PortRange {
  int first;
  int last;
  int size() const { return last >= first ? last - first + 1 : 0; }
};

PortRange EphemeralRange() {
  PortRange range{32768, 60999};
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    int lo = 0, hi = 0;
    if (std::fscanf(f, "%d %d", &lo, &hi) == 2 && lo > 0 && hi >= lo) range = {lo, hi};
    std::fclose(f);
  }
  return range;
}

// The reservations of this process: open for its life, closed by the kernel at exit.
struct Reservations {
  Mutex mu;
  std::vector<int> fds ABSL_GUARDED_BY(mu);
};
Reservations& TheReservations() {
  static auto* reservations = new Reservations();
  return *reservations;
}

// The descriptor that holds "tensorverbs/port/<port>" for this process, or -1 when another
// picker (or an earlier pick of this process) holds it.
int Reserve(int port) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string name = absl::StrCat("tensorverbs/port/", port);
  std::memcpy(addr.sun_path + 1, name.data(), name.size());  // sun_path[0] == 0: abstract
  const socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Keeps a reservation for the rest of the process's life.
void Keep(int fd) {
  Reservations& r = TheReservations();
  MutexLock lock(&r.mu);
  r.fds.push_back(fd);
}

// True when nothing is bound to `port` of `ip` now (a listener on 0.0.0.0 counts too).
bool Bindable(const in_addr& ip, int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr = ip;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

}  // namespace

absl::StatusOr<std::vector<int>> PickFreePorts(int count, absl::string_view host) {
  in_addr ip{};
  const std::string host_text(host);
  if (inet_pton(AF_INET, host_text.c_str(), &ip) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot pick ports on '", host, "': not an IPv4 address of this host"));
  }
  const PortRange ephemeral = EphemeralRange();
  const PortRange below{kLowestPort, ephemeral.first - 1};
  const PortRange above{std::max(ephemeral.last + 1, kLowestPort), 65535};
  const int choices = below.size() + above.size();
  if (choices == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot pick ports: the ephemeral range ", ephemeral.first, "-", ephemeral.last,
        " (/proc/sys/net/ipv4/ip_local_port_range) leaves none from ", kLowestPort, " up"));
  }
  std::random_device device;
  std::mt19937 rng(device() ^ static_cast<uint32_t>(getpid()));
  std::uniform_int_distribution<int> pick(0, choices - 1);
  std::vector<int> ports;
  for (int attempt = 0; attempt < kAttempts && static_cast<int>(ports.size()) < count; ++attempt) {
    const int i = pick(rng);
    const int port = i < below.size() ? below.first + i : above.first + (i - below.size());
    const int reservation = Reserve(port);
    if (reservation < 0) continue;  // another picker has it, or this process picked it before
    if (!Bindable(ip, port)) {
      close(reservation);  // in use: nothing to keep it from
      continue;
    }
    Keep(reservation);
    ports.push_back(port);
  }
  if (static_cast<int>(ports.size()) < count) {
    return absl::UnavailableError(absl::StrCat("cannot pick ", count, " free ports on ", host,
                                               ": found ", ports.size(), " in ", kAttempts,
                                               " tries"));
  }
  return ports;
}

}  // namespace tensorverbs
