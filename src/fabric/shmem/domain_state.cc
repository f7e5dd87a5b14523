#include "src/fabric/shmem/domain_state.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "src/common/logging.h"

namespace tensorverbs::fabric::shmem {
namespace {

constexpr size_t kMaxClients = 4096;  // connections one descriptor server takes at once

}  // namespace

DomainState::~DomainState() {
  if (server.joinable()) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(stop_fd, &one, sizeof(one));
    server.join();
  }
  for (int fd : {listen_fd, bell_fd, stop_fd}) {
    if (fd >= 0) close(fd);
  }
  MutexLock lock(&mu);
  for (auto& [id, r] : regions) {
    if (r.fd >= 0) close(r.fd);
  }
}

void DomainState::Ring() {
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(bell_fd, &one, sizeof(one));
}

// The descriptor server: answers each connected peer's requests until it hangs up, then marks
// the endpoint it connected to as having lost its peer and wakes the progress thread.
void DomainState::Serve() {
  struct Client {
    int fd;
    std::shared_ptr<EndpointShared> endpoint;  // after kHello
  };
  std::vector<Client> clients;
  std::vector<pollfd> fds;
  while (true) {
    fds.clear();
    fds.push_back({stop_fd, POLLIN, 0});
    fds.push_back({listen_fd, static_cast<short>(clients.size() < kMaxClients ? POLLIN : 0), 0});
    for (const Client& c : clients) fds.push_back({c.fd, POLLIN, 0});
    if (poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      LOG(ERROR) << "shmem: the descriptor server stops: poll: " << std::strerror(errno);
      break;
    }
    if (fds[0].revents) break;
    std::vector<size_t> gone;
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      Client& c = clients[i - 2];
      Request request{};
      int extra[4];
      int nextra = 0;
      const ssize_t n = RecvWithFds(c.fd, &request, sizeof(request), extra, 4, &nextra);
      for (int k = 0; k < nextra; ++k) close(extra[k]);
      if (n == static_cast<ssize_t>(sizeof(request)) && request.magic == kRequestMagic) {
        if (Answer(c.fd, request, &c.endpoint)) continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
        continue;
      } else if (n > 0) {
        LOG(WARNING) << "shmem: a peer sent a malformed request; closing its connection";
      }
      gone.push_back(i - 2);
    }
    for (auto it = gone.rbegin(); it != gone.rend(); ++it) {
      Client& c = clients[*it];
      {
        MutexLock lock(&mu);
        if (c.endpoint != nullptr && c.endpoint->client_fd == c.fd) c.endpoint->client_fd = -1;
        close(c.fd);
      }
      if (c.endpoint != nullptr) {
        c.endpoint->peer_gone.store(true, std::memory_order_release);
        Ring();
      }
      clients.erase(clients.begin() + static_cast<ptrdiff_t>(*it));
    }
    if (fds[1].revents & POLLIN) {
      const int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) {
        // Abstract sockets have no file permissions: only processes of our own user (who could
        // ptrace us anyway) may connect.
        ucred cred{};
        if (!PeerCredentials(fd, &cred) || cred.uid != geteuid()) {
          LOG(WARNING) << "shmem: refused a connection from pid " << cred.pid << " of user "
                       << cred.uid << " (only user " << geteuid() << " may connect)";
          close(fd);
        } else {
          clients.push_back({fd, nullptr});
        }
      }
    }
  }
  MutexLock lock(&mu);
  for (Client& c : clients) {
    if (c.endpoint != nullptr && c.endpoint->client_fd == c.fd) c.endpoint->client_fd = -1;
    close(c.fd);
  }
}

bool DomainState::Answer(int client, const Request& request,
                         std::shared_ptr<EndpointShared>* hello) {
  Reply reply{};
  reply.magic = kReplyMagic;
  reply.status = kOk;
  reply.type = request.type;
  reply.id = request.id;
  DeviceRegionReply device_reply{};
  // Descriptors to send, each our own duplicate (closed below): a deregistration on another
  // thread may close the region's descriptor, and its number be reused, while we send.
  int fds[2] = {-1, -1};
  int nfds = 0;
  if (request.type == kHello) {
    MutexLock lock(&mu);
    auto it = endpoints.find(request.id);
    if (*hello != nullptr) {
      reply.status = kEndpointTaken;
    } else if (it == endpoints.end()) {
      reply.status = kNoSuchEndpoint;
    } else if (it->second->claimed.exchange(true)) {
      reply.status = kEndpointTaken;
    } else {
      const std::shared_ptr<EndpointShared>& ep = it->second;
      *hello = ep;
      ep->client_fd = client;
      reply.size = ep->ring->size();
      reply.capacity = kRingCapacity;
      fds[nfds++] = fcntl(ep->ring->fd(), F_DUPFD_CLOEXEC, 0);
      fds[nfds++] = fcntl(bell_fd, F_DUPFD_CLOEXEC, 0);
    }
  } else if (request.type == kRegion || request.type == kDeviceRegion) {
    // Regions are handed out only on a connection that named one of our endpoints first: a
    // memfd for host memory, the exported handle for device memory.
    const bool device = request.type == kDeviceRegion;
    MutexLock lock(&mu);
    auto it = regions.find(request.id);
    if (*hello == nullptr) {
      reply.status = kNotConnected;
    } else if (it == regions.end()) {
      reply.status = kNoSuchRegion;
    } else if (device ? it->second.device < 0 : it->second.fd < 0) {
      reply.status = device ? kNotDevice : kNotShared;
    } else if ((it->second.access & (kAccessRemoteWrite | kAccessRemoteRead)) == 0 &&
               (device || (*hello)->lent_for_reading.count(request.id) == 0)) {
      reply.status = kNoAccess;
    } else if (device) {
      reply.size = it->second.length;
      reply.access = it->second.access;
      device_reply.device = static_cast<uint32_t>(it->second.device);
      device_reply.handle_size = static_cast<uint32_t>(it->second.handle.size());
      std::memcpy(device_reply.handle, it->second.handle.data(), it->second.handle.size());
    } else {
      reply.size = it->second.file_size;
      // A region lent for a shared write only is read-only to the peer it was lent to.
      reply.access = (it->second.access & (kAccessRemoteWrite | kAccessRemoteRead)) != 0
                         ? it->second.access
                         : static_cast<uint32_t>(kAccessRemoteRead);
      // Read-only access: a read-only descriptor, so the peer cannot map it writable.
      fds[nfds++] =
          (reply.access & kAccessRemoteWrite)
              ? fcntl(it->second.fd, F_DUPFD_CLOEXEC, 0)
              : open(absl::StrCat("/proc/self/fd/", it->second.fd).c_str(), O_RDONLY | O_CLOEXEC);
    }
  } else {
    reply.status = kNoSuchRegion;
  }
  for (int i = 0; i < nfds; ++i) {
    if (fds[i] < 0) reply.status = kNoAccess;  // out of descriptors, or no /proc
  }
  const int sent = reply.status == kOk ? nfds : 0;
  // A device region's handle follows the reply (its requester expects that length, answered
  // or refused).
  const void* message = &reply;
  size_t length = sizeof(reply);
  if (request.type == kDeviceRegion) {
    device_reply.reply = reply;
    message = &device_reply;
    length = sizeof(device_reply);
  }
  // Never blocks: a peer that does not read its replies loses its own connection.
  const bool ok = SendWithFds(client, message, length, fds, sent, MSG_DONTWAIT);
  if (!ok) VLOG(1) << "shmem: a reply to a peer failed: " << std::strerror(errno);
  for (int i = 0; i < nfds; ++i) {
    if (fds[i] >= 0) close(fds[i]);
  }
  return ok;
}

}  // namespace tensorverbs::fabric::shmem
