#include "src/common/unix_socket.h"

#include <errno.h>
#include <unistd.h>

#include <cstring>

namespace tensorverbs {

bool SendWithFds(int sock, const void* msg, size_t len, const int* fds, int nfds, int flags) {
  iovec iov{const_cast<void*>(msg), len};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))] = {};
  if (nfds > 0) {
    mh.msg_control = control;
    mh.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
    cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
    std::memcpy(CMSG_DATA(c), fds, nfds * sizeof(int));
  }
  return sendmsg(sock, &mh, MSG_NOSIGNAL | flags) == static_cast<ssize_t>(len);
}

ssize_t RecvWithFds(int sock, void* msg, size_t len, int* fds, int max_fds, int* nfds) {
  iovec iov{msg, len};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))] = {};
  mh.msg_control = control;
  mh.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  *nfds = 0;
  if (n < 0) return n;  // the control buffer holds nothing of this call
  for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c != nullptr; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const int count = static_cast<int>((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
    for (int i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      if (*nfds < max_fds) {
        fds[(*nfds)++] = fd;
      } else {
        close(fd);
      }
    }
  }
  if (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
    for (int i = 0; i < *nfds; ++i) close(fds[i]);
    *nfds = 0;
    errno = EMSGSIZE;
    return -1;
  }
  return n;
}

bool PeerCredentials(int sock, ucred* cred) {
  socklen_t len = sizeof(*cred);
  return getsockopt(sock, SOL_SOCKET, SO_PEERCRED, cred, &len) == 0;
}

}  // namespace tensorverbs
