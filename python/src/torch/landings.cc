#include "python/src/torch/landings.h"

#include <iterator>
#include <string>

namespace tensorverbs::torch_backend {
namespace {

using InState = InPlaceLanding::State;
using InEvent = InPlaceLanding::Event;

constexpr const char* kInStates[] = {"lent", "released", "landed", "failed, held", "done"};
constexpr const char* kInEvents[] = {"Released", "RecvEnded"};
constexpr StateRow<InState, InEvent> kInRows[] = {
    {InState::kLent, InEvent::kReleased, "", InState::kReleased,
     "drop the release's hold on the work: the recv goes on"},
    {InState::kLent, InEvent::kRecvEnded, "it succeeded", InState::kLanded, "complete the work"},
    {InState::kLent, InEvent::kRecvEnded, "it failed", InState::kFailedHeld,
     "keep the failure, watch for the release"},
    {InState::kReleased, InEvent::kRecvEnded, "", InState::kDone,
     "complete the work (with its message or its error)"},
    {InState::kLanded, InEvent::kReleased, "", InState::kDone,
     "drop the release's hold on the work"},
    {InState::kFailedHeld, InEvent::kReleased, "", InState::kDone,
     "complete the work with the failure"},
};
constexpr StateTable kInPlaceTable("InPlaceLanding", kInStates, kInEvents, InState::kLent, kInRows);

using CoState = CollectiveLanding::State;
using CoEvent = CollectiveLanding::Event;

constexpr const char* kCoStates[] = {"waiting", "settled"};
constexpr const char* kCoEvents[] = {"Landed", "Released"};
constexpr StateRow<CoState, CoEvent> kCoRows[] = {
    {CoState::kWaiting, CoEvent::kLanded, "", CoState::kSettled, "count the destination settled"},
    {CoState::kWaiting, CoEvent::kReleased, "", CoState::kSettled, "count the destination settled"},
    {CoState::kSettled, CoEvent::kLanded, "", CoState::kSettled, "nothing"},
    {CoState::kSettled, CoEvent::kReleased, "", CoState::kSettled, "nothing"},
};
constexpr StateTable kCollectiveTable("CollectiveLanding", kCoStates, kCoEvents, CoState::kWaiting,
                                      kCoRows);

}  // namespace

void InPlaceLanding::MoveTo(State next, Event event) {
  kInPlaceTable.Move(&state_, event, next, [] { return std::string("a torch recv's landing"); });
}

InPlaceLanding::Action InPlaceLanding::Released() {
  std::lock_guard<std::mutex> lock(mu_);
  switch (state_) {
    case State::kLent:
      MoveTo(State::kReleased, Event::kReleased);
      return Action::kDrop;
    case State::kFailedHeld:
      MoveTo(State::kDone, Event::kReleased);
      return Action::kFail;
    default:
      MoveTo(State::kDone, Event::kReleased);  // from kLanded; any other is no row
      return Action::kDrop;
  }
}

InPlaceLanding::Action InPlaceLanding::RecvEnded(const absl::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ != State::kLent) {
    MoveTo(State::kDone, Event::kRecvEnded);  // from kReleased; any other is no row
    return Action::kLand;
  }
  if (status.ok()) {
    MoveTo(State::kLanded, Event::kRecvEnded);
    return Action::kLand;
  }
  failure_ = status;
  MoveTo(State::kFailedHeld, Event::kRecvEnded);
  return Action::kWatch;
}

absl::Status InPlaceLanding::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

InPlaceLanding::State InPlaceLanding::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

bool CollectiveLanding::Settle(Event event) {
  std::lock_guard<std::mutex> lock(mu_);
  const bool first = state_ == State::kWaiting;
  kCollectiveTable.Move(&state_, event, State::kSettled,
                        [] { return std::string("a collective's landing"); });
  return first;
}

StateTableView InPlaceLandingTable() { return kInPlaceTable.View(); }
StateTableView CollectiveLandingTable() { return kCollectiveTable.View(); }

}  // namespace tensorverbs::torch_backend
