// Descriptors between processes of one host, over a connected Unix socket (SCM_RIGHTS), and who
// is on the other end of one (SO_PEERCRED). The same-host fabric's descriptor server and the
// torch backend's same-host groups hand memfds to their peers this way. Any thread; each call is
// one system call on the caller's socket.
#ifndef TENSORVERBS_COMMON_UNIX_SOCKET_H_
#define TENSORVERBS_COMMON_UNIX_SOCKET_H_

#include <sys/socket.h>
#include <sys/types.h>

#include <cstddef>

namespace tensorverbs {

// Sends `msg` with up to four descriptors (none: `fds` may be null).
bool SendWithFds(int sock, const void* msg, size_t len, const int* fds, int nfds, int flags = 0);
// Receives one message of exactly `len` bytes and the descriptors that came with it (closed if
// the caller does not want that many). Returns the byte count, 0 on EOF, -1 on error.
ssize_t RecvWithFds(int sock, void* msg, size_t len, int* fds, int max_fds, int* nfds);
// The process and user on the other end of a connected Unix socket; false if unknown.
bool PeerCredentials(int sock, ucred* cred);

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_UNIX_SOCKET_H_
