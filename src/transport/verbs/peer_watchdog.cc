#include "src/transport/verbs/peer_watchdog.h"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "proto/verbs.grpc.pb.h"
#include "src/common/logging.h"
#include "src/common/process_limits.h"

namespace tensorverbs::verbs {

struct PeerWatchdog::Probe {
  protocol::PeerChannels::Probe peer;
  grpc::ClientContext context;
  proto::CheckChannelRequest request;
  proto::CheckChannelResponse response;
  grpc::Status status;
  absl::Time sent;
  absl::Time deadline;
  absl::Time answered;  // when its callback ran: late past the deadline, this task was starved
};

namespace {

// How long before its answer the peer's loop last polled and found nothing, if it said.
std::optional<absl::Duration> IdlePollAge(const proto::CheckChannelResponse& response) {
  if (!response.has_idle_poll_age_us()) return std::nullopt;
  return absl::Microseconds(response.idle_poll_age_us());
}

}  // namespace

absl::Status PeerWatchdog::Silence(const Probe& probe, absl::string_view what) const {
  // How late past its deadline the verdict reached this task, where that is long enough to say:
  // a task starved of CPU hears its own deadlines late.
  const absl::Duration late = probe.answered - probe.deadline;
  return absl::UnavailableError(absl::StrCat(
      "task ", probe.peer.task, " at ", probe.peer.address, " ", what,
      " (no reply within TENSORVERBS_PEER_TIMEOUT_MS=", absl::ToInt64Milliseconds(peer_timeout_),
      "): ", probe.status.error_message(),
      late >= absl::Milliseconds(100)
          ? absl::StrCat("; this task heard the deadline ",
                         absl::FormatDuration(absl::Trunc(late, absl::Milliseconds(1))), " late")
          : std::string(),
      OverloadHint()));
}

PeerWatchdog::PeerWatchdog(std::string self, absl::Duration peer_timeout,
                           protocol::ProgressEngine* engine, protocol::PeerChannels* channels,
                           protocol::ChannelTable* table, VerbsStubs* stubs,
                           std::atomic<int64_t>* probes_sent)
    : self_(std::move(self)),
      peer_timeout_(peer_timeout),
      engine_(engine),
      channels_(channels),
      table_(table),
      stubs_(stubs),
      probes_sent_(probes_sent) {}

PeerWatchdog::~PeerWatchdog() { Stop(); }

void PeerWatchdog::Start() {
  thread_ = std::thread([this] { Loop(); });
}

void PeerWatchdog::Stop() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
    for (const std::shared_ptr<Probe>& probe : round_) probe->context.TryCancel();
  }
  if (thread_.joinable()) thread_.join();
}

void PeerWatchdog::Loop() {
  const absl::Duration interval =
      std::clamp(peer_timeout_ / 4, absl::Milliseconds(25), absl::Seconds(5));
  while (true) {
    {
      MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; },
                               interval)) {
        return;
      }
    }
    // Waited for in slices of the round, so that a loop which stopped turning is reported
    // while it keeps this waiting (up to 5 s: a loop busy with large copies may be slow to
    // answer without being stuck).
    absl::StatusOr<std::vector<protocol::PeerChannels::Probe>> peers =
        engine_->AskLoop<std::vector<protocol::PeerChannels::Probe>>(
            [this] { return channels_->PendingPeers(); }, absl::Seconds(5), interval,
            [this] {
              if (std::optional<std::string> stalled = engine_->StallReport(peer_timeout_)) {
                LOG(ERROR) << "task " << self_ << ": " << *stalled;
              }
            });
    if (absl::IsCancelled(peers.status())) return;
    if (!peers.ok() || peers->empty()) continue;
    ProbeRound(*peers, peer_timeout_, /*last=*/false);
  }
}

void PeerWatchdog::LastRound(absl::Duration timeout) {
  absl::StatusOr<std::vector<protocol::PeerChannels::Probe>> peers =
      engine_->AskLoop<std::vector<protocol::PeerChannels::Probe>>(
          [this] { return channels_->PendingPeers(/*spare_heard=*/false); }, timeout);
  if (!peers.ok() || peers->empty()) return;
  ProbeRound(*peers, std::min(timeout, peer_timeout_), /*last=*/true);
}

void PeerWatchdog::ProbeRound(const std::vector<protocol::PeerChannels::Probe>& peers,
                              absl::Duration timeout, bool last) {
  std::vector<std::shared_ptr<Probe>> round;
  {
    MutexLock lock(&mu_);
    if (stop_ && !last) return;
    for (const protocol::PeerChannels::Probe& peer : peers) {
      auto probe = std::make_shared<Probe>();
      probe->peer = peer;
      probe->sent = absl::Now();
      probe->deadline = probe->sent + timeout;
      probe->context.set_deadline(absl::ToChronoTime(probe->deadline));
      probe->context.set_wait_for_ready(true);
      probe->request.set_task_name(self_);
      // A channel still being set up asks only whether the peer answers (verbs.proto).
      probe->request.set_reachable_only(peer.connecting);
      if (peer.accepting) {
        probe->request.set_owned_channel_id(peer.peer_channel_id);
      } else {
        probe->request.set_channel_id(peer.channel_id);
      }
      round.push_back(probe);
    }
    round_ = round;
    outstanding_ = static_cast<int>(round.size());
    probes_sent_->fetch_add(static_cast<int64_t>(round.size()), std::memory_order_relaxed);
  }
  for (const std::shared_ptr<Probe>& probe : round) {
    std::shared_ptr<proto::VerbsService::Stub> stub =
        stubs_->Get(probe->peer.task, probe->peer.address);
    stub->async()->CheckChannel(&probe->context, &probe->request, &probe->response,
                                [this, probe](grpc::Status status) {
                                  probe->status = std::move(status);
                                  probe->answered = absl::Now();
                                  MutexLock lock(&mu_);
                                  --outstanding_;
                                });
  }
  {
    MutexLock lock(&mu_);
    mu_.Await([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return outstanding_ == 0; });
    round_.clear();
    if (stop_ && !last) return;
  }
  // Outside the lock: a verdict logs and posts to the progress thread.
  for (const std::shared_ptr<Probe>& probe : round) Judge(*probe);
}

void PeerWatchdog::Judge(const Probe& probe) {
  const protocol::PeerChannels::Probe& peer = probe.peer;
  absl::Status verdict;
  // An idle accepted channel whose owner's end is gone, or one whose owner closed its end as
  // routine (given back idle, replaced), is closed as routine: the owner's own close was the
  // news, and an acceptor whose idle time started a little later than its owner's would
  // otherwise count the give-back as an error. One probed for that alone that its owner keeps is
  // asked again after another idle period, not every round; silence, from an owner that may only be
  // slow, leaves it as it is.
  const bool routine = (peer.idle || (peer.accepting && probe.response.closed_as_routine())) &&
                       probe.status.ok() && !probe.response.open();
  if (peer.idle_only && !routine) {
    if (!probe.status.ok()) return;
    const uint64_t id = peer.channel_id;
    engine_->Post([this, id] {
      if (protocol::Channel* c = table_->Find(id)) c->RestartIdle();
    });
    return;
  }
  if (peer.connecting) {
    // The peer does not know the channel yet, so only silence is a verdict: a peer that never
    // comes up fails the recvs waiting for the channel within the peer timeout, not at the
    // connect timeout.
    if (!probe.status.ok()) {
      verdict = Silence(probe, "could not be reached to set up the channel");
    }
  } else if (!probe.status.ok()) {
    verdict = Silence(probe, "stopped answering");
  } else if (probe.response.incarnation() != peer.incarnation) {
    verdict = absl::AbortedError(absl::StrFormat(
        "task %s restarted (incarnation %016x, now %016x): its tensors of the old incarnation "
        "are gone",
        peer.task, peer.incarnation, probe.response.incarnation()));
  } else if (!probe.response.open()) {
    verdict =
        absl::Status(routine ? absl::StatusCode::kCancelled : absl::StatusCode::kUnavailable,
                     absl::StrCat("task ", peer.task,
                                  " closed its end of the channel: ", probe.response.reason()));
  } else if (peer.awaited.has_value() &&
             protocol::PeerChannels::MessageLost(*peer.awaited, probe.response.messages_received(),
                                                 IdlePollAge(probe.response), probe.sent,
                                                 peer_timeout_ / 2)) {
    // Both ends stand, and the peer answers, but a message of this end never reached it.
    verdict = absl::UnavailableError(absl::StrCat(
        "task ", peer.task, " acknowledged no control message for ",
        absl::FormatDuration(absl::Trunc(absl::Now() - peer.awaited->since, absl::Milliseconds(1))),
        " (TENSORVERBS_PEER_TIMEOUT_MS=", absl::ToInt64Milliseconds(peer_timeout_),
        ") though its loop found nothing more to do: the fabric path to it lost them; the next "
        "recv sets the channel up again"));
  }
  if (verdict.ok()) return;
  // Only silence says the peer is gone; a restart or a closed end says it is alive.
  const bool gone = !peer.connecting && !probe.status.ok();
  if (peer.accepting && !gone) {
    // Its owner dropped the channel (and set up another, or will): routine.
    VLOG(1) << "grpc+verbs: send channel: " << verdict.message();
  } else {
    LOG(WARNING) << "grpc+verbs: " << (peer.accepting ? "send channel: " : "") << verdict.message();
  }
  const uint64_t id = peer.channel_id;
  const bool accepting = peer.accepting;
  const std::string task = peer.task;
  engine_->Post([this, id, verdict, accepting, gone, task]() mutable {
    if (protocol::Channel* c = table_->Find(id)) c->Close(verdict);
    if (accepting && gone) channels_->PeerGone(task);
  });
}

}  // namespace tensorverbs::verbs
