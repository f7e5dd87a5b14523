// Small helpers over HOST:PORT strings and socket addresses, shared by the cluster spec (is a
// task's address on this host?) and the fabrics (which interface holds a task's address?).
// Plain functions, callable from any thread; AnyResolvedAddress resolves names and may block
// on DNS, so it belongs at set-up, never on a progress or gRPC thread.
#ifndef TENSORVERBS_COMMON_NET_ADDRESS_H_
#define TENSORVERBS_COMMON_NET_ADDRESS_H_

#include <sys/socket.h>

#include "absl/functional/function_ref.h"
#include "absl/strings/string_view.h"

namespace tensorverbs {

// The host of "HOST:PORT" ("[v6]:PORT" gives "v6"); the whole string where it has no port.
absl::string_view HostOf(absl::string_view address);

// Whether two socket addresses name the same IPv4 or IPv6 address, whatever their ports.
bool SameIp(const sockaddr* a, const sockaddr* b);

// Calls `match` with each address `host` (a name or a literal) resolves to, until it returns
// true; whether one did. False where `host` does not resolve.
bool AnyResolvedAddress(absl::string_view host, absl::FunctionRef<bool(const sockaddr*)> match);

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_NET_ADDRESS_H_
