// The loopback fabric: an in-process backend with the same semantics as the RDMA ones, and
// deterministic fault injection for tests.
//
// Every loopback domain in the process is reachable from every other; an endpoint address is
// "loopback:<domain>:<endpoint>". Registered regions have keys and bounds that are checked on
// every access; a write copies the bytes into the target's memory at post time and queues the
// target's immediate completion; a read copies back. Completions are delivered by Poll, so
// ordering and timing faults can be injected between posting and delivery.
//
// Thread-safety: as every Domain (one thread at a time per domain); different domains may be
// polled from different threads. SetFaults may be called from any thread.
#ifndef TENSORVERBS_FABRIC_LOOPBACK_LOOPBACK_H_
#define TENSORVERBS_FABRIC_LOOPBACK_LOOPBACK_H_

#include <memory>

#include "absl/time/time.h"
#include "src/fabric/fabric.h"

namespace tensorverbs::fabric::loopback {

// Faults applied to operations posted from (and completions delivered by) one domain. Counters
// are 1-based ("the nth"); 0 disables a fault. Each counted fault fires once.
struct Faults {
  int fail_post_nth = 0;          // the nth Post* returns Unavailable and does nothing
  int fail_register_nth = 0;      // the nth RegisterMemory returns ResourceExhausted
  int error_completion_nth = 0;   // the nth operation does nothing and completes with an error
  int drop_imm_nth = 0;           // the nth write with immediate lands but its immediate is lost
  int duplicate_imm_nth = 0;      // the nth immediate is delivered twice
  int corrupt_write_nth = 0;      // the nth write with immediate lands with one byte flipped
  int delay_polls = 0;            // completions wait this many Poll calls before delivery
  bool reverse_order = false;     // each Poll delivers what is ready in reverse order
  bool stalled = false;           // Poll delivers nothing while set
  // The next `slow_registrations` registrations each take `register_delay`, as on a busy host
  // whose page faults are slow.
  int slow_registrations = 0;
  absl::Duration register_delay = absl::ZeroDuration();
};

absl::StatusOr<std::unique_ptr<Domain>> OpenLoopbackDomain(const DomainOptions& options);

// `domain` must come from OpenLoopbackDomain. Replaces the domain's faults and resets counters.
void SetFaults(Domain* domain, const Faults& faults);

}  // namespace tensorverbs::fabric::loopback

#endif  // TENSORVERBS_FABRIC_LOOPBACK_LOOPBACK_H_
