#include "src/common/net_address.h"

#include <netdb.h>
#include <netinet/in.h>

#include <cstring>
#include <string>

#include "absl/strings/match.h"

namespace tensorverbs {

absl::string_view HostOf(absl::string_view address) {
  absl::string_view host = address;
  const size_t colon = host.rfind(':');
  // A colon inside brackets belongs to an IPv6 host, not to a port.
  if (colon != absl::string_view::npos && (host.front() != '[' || host[colon - 1] == ']')) {
    host = host.substr(0, colon);
  }
  if (absl::StartsWith(host, "[") && absl::EndsWith(host, "]")) {
    host = host.substr(1, host.size() - 2);
  }
  return host;
}

bool SameIp(const sockaddr* a, const sockaddr* b) {
  if (a == nullptr || b == nullptr || a->sa_family != b->sa_family) return false;
  if (a->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in*>(b)->sin_addr.s_addr;
  }
  if (a->sa_family == AF_INET6) {
    return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr,
                       &reinterpret_cast<const sockaddr_in6*>(b)->sin6_addr, sizeof(in6_addr)) == 0;
  }
  return false;
}

bool AnyResolvedAddress(absl::string_view host, absl::FunctionRef<bool(const sockaddr*)> match) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string host_text(host);
  if (getaddrinfo(host_text.c_str(), nullptr, &hints, &found) != 0) return false;
  bool matched = false;
  for (const addrinfo* a = found; a != nullptr && !matched; a = a->ai_next) {
    matched = match(a->ai_addr);
  }
  freeaddrinfo(found);
  return matched;
}

}  // namespace tensorverbs
