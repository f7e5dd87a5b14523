// Channel::Snapshot and Channel::trace_track: what `tensorverbs stats` and the recv trace show
// of a channel, kept apart from the state machines in channel.cc.
#include <atomic>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "src/common/trace.h"
#include "src/protocol/channel.h"
#include "src/protocol/memory_mgr.h"

namespace tensorverbs::protocol {

ChannelSnapshot Channel::Snapshot() const {
  AssertOwnerThread();
  ChannelSnapshot s;
  s.peer_task = peer_task_;
  s.receives = receiving_ != nullptr;
  s.state = state_ == State::kConnecting ? "connecting"
            : state_ == State::kReady    ? "ready"
                                         : "closed";
  if (env_->domain != nullptr) {
    const fabric::Capabilities& caps = env_->domain->capabilities();
    s.fabric = absl::StrCat(caps.backend, " (", caps.provider, ")");
  }
  s.description = Describe();
  auto add = [&s](const char* name, int64_t value) { s.counters.emplace_back(name, value); };
  auto get = [](const std::atomic<int64_t>& a) { return a.load(std::memory_order_relaxed); };
  const ChannelCounters& c = counters_;
  if (s.receives) {
    add("tensors_received", get(c.tensors_received));
    add("bytes_received", get(c.bytes_received));
    add("recv_errors", get(c.recv_errors));
    for (int code = 1; code < ChannelCounters::kCodes; ++code) {
      const int64_t n = get(c.recv_errors_by_code[code]);
      if (n > 0) {
        s.counters.emplace_back(
            absl::StrCat("recv_errors_", absl::AsciiStrToLower(absl::StatusCodeToString(
                                             static_cast<absl::StatusCode>(code)))),
            n);
      }
    }
    add("requests", get(c.requests));
    add("re_requests", get(c.re_requests));
    add("proxies", get(c.proxies));
    add("pending_recvs", static_cast<int64_t>(receiving_->held_indexes()));
  } else {
    add("tensors_sent", get(c.tensors_sent));
    add("bytes_sent", get(c.bytes_sent));
    add("meta_responses", get(c.meta_responses));
    add("errors_sent", get(c.errors_sent));
    add("responses_pending", static_cast<int64_t>(sending_->responses()));
  }
  add("control_messages", mb_ ? static_cast<int64_t>(mb_->messages_sent()) : 0);
  add("control_slots", mb_ ? static_cast<int64_t>(mb_->sent()) : 0);
  add("slot_waits", mb_ ? static_cast<int64_t>(mb_->slot_waits()) : 0);
  // With channel keys each channel's peer writes through registrations of its own; otherwise
  // through the task's shared ones (counted once, per task).
  if (env_->memory != nullptr && env_->memory->channel_keys() && endpoint_ != nullptr) {
    const auto [registrations, bytes] = env_->memory->EndpointRegistrations(endpoint_.get());
    add("registrations", registrations);
    add("registered_bytes", bytes);
  }
  return s;
}

uint64_t Channel::trace_track() {
  if (trace_track_ == 0 && TraceEnabled()) {
    trace_track_ = TraceTrack(
        absl::StrCat(env_->worker != nullptr ? env_->worker->task_name : "", " <- ", peer_task_,
                     " (", VerbsModeProtocol(env_->options.mode), " channel ", id_, ")"));
  }
  return trace_track_;
}

}  // namespace tensorverbs::protocol
