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
    for (size_t lane = 0; lane < lanes_connected_; ++lane) {
      absl::StrAppend(&s.fabric, lane == 0 ? ", lanes on " : ", ", env_->lanes[lane].source);
    }
  }
  s.description = Describe();
  auto add = [&s](Counter key, int64_t value) { AddCounter(&s.counters, key, value); };
  auto get = [](const std::atomic<int64_t>& a) { return a.load(std::memory_order_relaxed); };
  const ChannelCounters& c = counters_;
  if (s.receives) {
    add(Counter::kTensorsReceived, get(c.tensors_received));
    add(Counter::kBytesReceived, get(c.bytes_received));
    add(Counter::kRecvErrors, get(c.recv_errors));
    for (int code = 1; code < ChannelCounters::kCodes; ++code) {
      const int64_t n = get(c.recv_errors_by_code[code]);
      if (n > 0) {
        s.counters.emplace_back(
            absl::StrCat("recv_errors_", absl::AsciiStrToLower(absl::StatusCodeToString(
                                             static_cast<absl::StatusCode>(code)))),
            n);
      }
    }
    add(Counter::kRequests, get(c.requests));
    add(Counter::kReRequests, get(c.re_requests));
    add(Counter::kProxies, get(c.proxies));
    add(Counter::kPendingRecvs, static_cast<int64_t>(receiving_->held_indexes()));
  } else {
    add(Counter::kTensorsSent, get(c.tensors_sent));
    add(Counter::kBytesSent, get(c.bytes_sent));
    add(Counter::kMetaResponses, get(c.meta_responses));
    add(Counter::kErrorsSent, get(c.errors_sent));
    add(Counter::kResponsesPending, static_cast<int64_t>(sending_->responses()));
  }
  add(Counter::kControlMessages, mb_ ? static_cast<int64_t>(mb_->messages_sent()) : 0);
  add(Counter::kControlSlots, mb_ ? static_cast<int64_t>(mb_->sent()) : 0);
  add(Counter::kSlotWaits, mb_ ? static_cast<int64_t>(mb_->slot_waits()) : 0);
  // Per lane, where the channel has several: bytes a sender posted on each, segments that
  // landed on each at a receiver.
  if (lanes_connected_ > 0) {
    for (size_t lane = 0; lane <= lanes_connected_; ++lane) {
      s.counters.emplace_back(
          absl::StrCat("lane", lane, s.receives ? "_segments_received" : "_bytes_sent"),
          get(s.receives ? c.lane_segments_received[lane] : c.lane_bytes_sent[lane]));
    }
  }
  // With channel keys each channel's peer writes through registrations of its own; otherwise
  // through the task's shared ones (counted once, per task).
  if (env_->memory != nullptr && env_->memory->channel_keys() && endpoint_ != nullptr) {
    const auto [registrations, bytes] = env_->memory->EndpointRegistrations(endpoint_.get());
    add(Counter::kRegistrations, registrations);
    add(Counter::kRegisteredBytes, bytes);
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
