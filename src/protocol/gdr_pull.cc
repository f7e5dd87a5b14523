#include "src/protocol/gdr_pull.h"

#include <cstring>
#include <iterator>
#include <optional>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "src/common/logging.h"
#include "src/protocol/channel.h"
#include "src/protocol/receiving_side.h"

namespace tensorverbs::protocol {

GdrPull::GdrPull(ReceivingSide* side, uint32_t index, RemoteTensorRef ref, Tensor dest,
                 absl::Time deadline, Done done)
    : side_(side),
      channel_(side->channel()),
      index_(index),
      ref_(std::move(ref)),
      dest_(std::move(dest)),
      deadline_(deadline),
      done_(std::move(done)) {}

// A namespace of its own: the unity build compiles this file with the other machines'.
namespace pull_machine {

using State = GdrPull::State;
using Event = GdrPull::Event;

constexpr const char* kStateNames[] = {"queued", "reading", "done"};
constexpr const char* kEventNames[] = {"Issue", "ReadDone", "Close"};
static_assert(std::size(kStateNames) == GdrPull::kStates);
static_assert(std::size(kEventNames) == GdrPull::kEvents);

// The pull's machine, row by row (state_table.h).
constexpr StateRow<State, Event> kPullRows[] = {
    {State::kQueued, Event::kIssue, "reads posted", State::kReading, ""},
    {State::kQueued, Event::kIssue,
     "nothing to read (refused, ended, an unfit destination, no read posted)", State::kDone,
     "release the tensor at the sender"},
    {State::kQueued, Event::kClose, "", State::kDone, "end the recv"},
    {State::kReading, Event::kReadDone, "the last read", State::kDone,
     "release the tensor at the sender, deliver"},
    {State::kReading, Event::kClose, "", State::kDone, "end the recv, quarantine the destination"},
};

constexpr StateTable kPullTable("GdrPull", kStateNames, kEventNames, State::kQueued, kPullRows);

}  // namespace pull_machine

using pull_machine::kPullTable;

StateTableView PullStateTable() { return kPullTable.View(); }

void GdrPull::TransitionTo(State next, Event event) {
  kPullTable.Move(&state_, event, next, [&] {
    return absl::StrCat("read of a tensor from task ", channel_->peer_task());
  });
}

void GdrPull::Closed() {
  if (state_ != State::kDone) TransitionTo(State::kDone, Event::kClose);
}

void GdrPull::End(const absl::Status& status) {
  if (done_ == nullptr) return;
  Done done = std::move(done_);
  done_ = nullptr;
  std::move(done)(status);
}

void GdrPull::FinishUnread(std::optional<absl::Status> status) {
  // Nothing was read, and nothing will be: the sender is told at once to drop the tensor rather
  // than holding it until its lease ends.
  absl::Status release = PostRelease();
  End(status.has_value() ? *status : release);
  TransitionTo(State::kDone, Event::kIssue);
  side_->FinishPull(index_);  // nothing was posted: nothing can land
  if (!release.ok()) channel_->Close(ReleaseFailed(channel_, release));
}

void GdrPull::Issue() {
  if (finished()) {
    FinishUnread(absl::OkStatus());  // ended (deadline) before it was issued
    return;
  }
  ChannelEnv* env = channel_->env();
  const uint64_t bytes = ref_.bytes;
  if (!dest_.IsInitialized()) {
    FinishUnread(std::nullopt);  // the receiver refused the tensor (too large, no memory)
    return;
  }
  if (bytes != dest_.TotalBytes()) {
    FinishUnread(
        absl::InvalidArgumentError("the destination does not match the lent tensor's size"));
    return;
  }
  if (bytes == 0) {
    // Nothing to read (a sender lends only larger tensors, but the answer is the peer's word):
    // no read would ever complete.
    FinishUnread(std::nullopt);
    return;
  }
  absl::StatusOr<const fabric::MemoryRegion*> region =
      env->memory->FindRegistered(dest_.data(), bytes);
  if (!region.ok()) {
    FinishUnread(region.status());
    return;
  }
  void* target = dest_.data();
  if (*region == nullptr) {
    // An unregistered destination: read into a registered proxy and copy.
    const fabric::MemoryRegion* staging_region = nullptr;
    absl::StatusOr<Tensor> staging = env->memory->AllocateStaging(bytes, &staging_region);
    if (!staging.ok()) {
      FinishUnread(absl::InternalError("no registered memory to read the tensor into"));
      return;
    }
    staging_ = *std::move(staging);
    region = staging_region;
    target = staging_.data();
  }
  fabric::Endpoint* endpoint = channel_->endpoint();
  const uint64_t context = MakeContext(OpTag::kRead, index_);
  absl::Status s;
  std::tie(reads_left_, s) = PostInPieces(bytes, [&](uint64_t offset, uint64_t len, bool) {
    return endpoint->PostRead(
        fabric::LocalBuffer{*region, static_cast<uint8_t*>(target) + offset, len},
        fabric::RemoteBuffer{ref_.key, ref_.addr + offset, len}, context);
  });
  if (reads_left_ > 0) TransitionTo(State::kReading, Event::kIssue);
  if (s.ok()) return;
  if (reads_left_ == 0) {
    FinishUnread(absl::InvalidArgumentError(absl::StrCat(
        "task ", channel_->peer_task(), " lent a tensor that cannot be read: ", s.message())));
    return;
  }
  // The reads already posted still complete.
  channel_->Close(absl::UnavailableError(
      absl::StrCat("a read from task ", channel_->peer_task(), " failed midway: ", s.message())));
}

void GdrPull::OnReadDone() {
  if (--reads_left_ > 0) return;
  ChannelEnv* env = channel_->env();
  absl::Status release = PostRelease();
  if (staging_.IsInitialized()) {
    std::memcpy(dest_.data(), staging_.data(), ref_.bytes);
    env->CountCopy(ref_.bytes);
  }
  env->stats->content_bytes.fetch_add(static_cast<int64_t>(ref_.bytes), std::memory_order_relaxed);
  End(absl::OkStatus());
  TransitionTo(State::kDone, Event::kReadDone);
  side_->FinishPull(index_);
  if (!release.ok()) channel_->Close(ReleaseFailed(channel_, release));
}

absl::Status GdrPull::PostRelease() {
  // The sender may release the tensor now: a zero-byte write whose immediate names it.
  MessageBuffer* mb = channel_->message_buffer();
  return channel_->endpoint()->PostWriteWithImm(mb->EmptyLocalSource(), mb->EmptyRemoteTarget(),
                                                ref_.tensor_key, MakeContext(OpTag::kAck, 0));
}

absl::Status GdrPull::ReleaseFailed(const Channel* channel, const absl::Status& status) {
  return absl::UnavailableError(absl::StrCat("releasing a tensor of task ", channel->peer_task(),
                                             " failed: ", status.message()));
}

std::vector<Tensor> GdrPull::TakeMemory() {
  std::vector<Tensor> memory;
  if (dest_.IsInitialized()) memory.push_back(std::move(dest_));
  if (staging_.IsInitialized()) memory.push_back(std::move(staging_));
  dest_.Clear();
  staging_.Clear();
  return memory;
}

}  // namespace tensorverbs::protocol
