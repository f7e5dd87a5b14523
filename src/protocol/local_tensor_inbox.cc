#include "src/protocol/local_tensor_inbox.h"

#include <utility>

#include "src/protocol/channel.h"
#include "src/protocol/channel_env.h"
#include "src/protocol/channel_table.h"

namespace tensorverbs::protocol {

RecvDoneCallback LocalTensorInbox::Open(uint64_t channel_id, uint32_t index, uint64_t serial) {
  const uint64_t ticket = next_ticket_++;
  waiting_.emplace(ticket, Waiting{channel_id, serial, index});
  return [this, ticket](const absl::Status& status, const Tensor& tensor, bool is_dead) {
    Arrive(ticket, status, tensor, is_dead);
  };
}

void LocalTensorInbox::Arrive(uint64_t ticket, const absl::Status& status, const Tensor& tensor,
                              bool is_dead) {
  const bool first = arrivals_.Push(Arrival{ticket, status, tensor, is_dead});
  // Never inline, even on the progress thread: the callback may run inside the response's own
  // Start (the tensor was already sent), or inside a cancel.
  if (first) env_->host->Post([this] { Drain(); });
}

void LocalTensorInbox::Drain() {
  arrivals_.Drain([this](Arrival& a) {
    auto it = waiting_.find(a.ticket);
    if (it == waiting_.end()) return;
    const Waiting w = it->second;
    waiting_.erase(it);
    if (SendingSide* side = env_->channels->FindSending(w.channel_id)) {
      side->OnLocalTensor(w.serial, w.index, a.status, a.tensor, a.is_dead);
    }
  });
}

}  // namespace tensorverbs::protocol
