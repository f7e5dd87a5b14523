#include "src/fabric/shmem/wire.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace tensorverbs::fabric::shmem {

std::string ReplyText(uint32_t status) {
  switch (status) {
    case kNoSuchEndpoint:
      return "no such endpoint (it was closed)";
    case kEndpointTaken:
      return "the endpoint is already connected to another peer";
    case kNoSuchRegion:
      return "the key names no registered region (deregistered?)";
    case kNotShared:
      return "the region is not in shared memory";
    case kNoAccess:
      return "the region allows no remote access";
    case kNotConnected:
      return "ask for the endpoint first";
    case kNotDevice:
      return "the region is not device memory";
    default:
      return absl::StrCat("status ", status);
  }
}

std::string SocketName(uint64_t uid) {
  return absl::StrCat("tensorverbs-shmem-", absl::Hex(uid, absl::kZeroPad16));
}

sockaddr_un SocketAddress(uint64_t uid, socklen_t* len) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string name = SocketName(uid);
  // Abstract namespace: sun_path[0] is NUL, so nothing appears in any file system.
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return addr;
}

void SetTimeouts(int fd) {
  const timeval tv = absl::ToTimeval(kSocketTimeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

int PidfdOpen(pid_t pid) { return static_cast<int>(syscall(SYS_pidfd_open, pid, 0)); }

absl::StatusOr<uint64_t> CheckPeerMemory(int fd, uint64_t needed, absl::string_view what) {
  struct stat st {};
  const int seals = fcntl(fd, F_GET_SEALS);
  if (fstat(fd, &st) != 0 || seals < 0 || (seals & F_SEAL_SHRINK) == 0 || !S_ISREG(st.st_mode)) {
    return absl::DataLossError(
        absl::StrCat("shmem: the peer's ", what, " is not sealed shared memory"));
  }
  if (static_cast<uint64_t>(st.st_size) < needed) {
    return absl::DataLossError(absl::StrCat("shmem: the peer's ", what, " has ", st.st_size,
                                            " bytes where ", needed, " were announced"));
  }
  return static_cast<uint64_t>(st.st_size);
}

}  // namespace tensorverbs::fabric::shmem
