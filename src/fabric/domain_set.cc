#include "src/fabric/domain_set.h"

#include <utility>

namespace tensorverbs::fabric {

DomainSet::DomainSet(std::vector<Domain*> members) : members_(std::move(members)) {}

absl::StatusOr<size_t> DomainSet::Poll(absl::Span<Completion> out) {
  size_t n = 0;
  const size_t count = members_.size();
  for (size_t k = 0; k < count && n < out.size(); ++k) {
    absl::StatusOr<size_t> got = members_[(next_ + k) % count]->Poll(out.subspan(n));
    if (!got.ok()) return got.status();
    n += *got;
  }
  next_ = (next_ + 1) % count;
  return n;
}

absl::Status DomainSet::Wait(absl::Duration timeout) {
  return SleepOn(absl::MakeConstSpan(members_), timeout);
}

void DomainSet::Interrupt() {
  // Any member's wake-up ends the shared sleep; each member's own Wait (outside the set) needs
  // its own.
  for (Domain* d : members_) d->Interrupt();
}

absl::StatusOr<bool> DomainSet::PrepareToSleep(std::vector<pollfd>* fds, absl::Duration* timeout) {
  ends_.clear();
  first_fd_ = fds->size();
  bool may_sleep = true;
  for (Domain* d : members_) {
    absl::StatusOr<bool> ok = d->PrepareToSleep(fds, timeout);
    ends_.push_back(fds->size());
    if (!ok.ok()) {
      // The members that prepared must still finish: as if none slept.
      size_t begin = first_fd_;
      for (size_t i = 0; i < ends_.size(); ++i) {
        for (size_t j = begin; j < ends_[i]; ++j) (*fds)[j].revents = 0;
        members_[i]->FinishSleep(absl::MakeConstSpan(fds->data() + begin, ends_[i] - begin));
        begin = ends_[i];
      }
      fds->resize(first_fd_);
      ends_.clear();
      return ok.status();
    }
    may_sleep &= *ok;
  }
  return may_sleep;
}

void DomainSet::FinishSleep(absl::Span<const pollfd> fds) {
  size_t begin = 0;
  for (size_t i = 0; i < ends_.size(); ++i) {
    const size_t end = ends_[i] - first_fd_;
    members_[i]->FinishSleep(fds.subspan(begin, end - begin));
    begin = end;
  }
  ends_.clear();
}

}  // namespace tensorverbs::fabric
