#include "src/rendezvous/local_rendezvous.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tensorverbs {

RecvDoneCallback EndTraceAfter(RecvTrace trace, RecvDoneCallback done) {
  if (!trace.active()) return done;
  return [trace = std::move(trace), done = std::move(done)](const absl::Status& s, const Tensor& t,
                                                            bool dead) mutable {
    std::move(done)(s, t, dead);
    trace.End(s, t.IsInitialized() ? t.TotalBytes() : 0);
  };
}

LocalRendezvous::LocalRendezvous(KeyTable* keys, StepSizeHint* sizes) : keys_(keys), sizes_(sizes) {
  if (sizes_ == nullptr) return;
  MutexLock lock(&mu_);
  table_.reserve(sizes_->items());
  waiter_keys_.reserve(sizes_->waiters());
}

LocalRendezvous::~LocalRendezvous() {
  StartAbort(absl::CancelledError("rendezvous destroyed while a recv was pending"));
  if (sizes_ != nullptr) {
    MutexLock lock(&mu_);
    // A step that saw nothing (one created twice in a race, then dropped) says nothing about
    // the next step's size.
    if (most_items_ > 0) sizes_->Record(most_items_, most_waiters_);
  }
}

absl::Status LocalRendezvous::Send(const ParsedKey& key, const Tensor& value, bool is_dead) {
  return Send(Intern(key), value, is_dead);
}

absl::Status LocalRendezvous::Send(KeyRef key, const Tensor& value, bool is_dead) {
  RecvDoneCallback done;
  {
    MutexLock lock(&mu_);
    if (!status_.ok()) return status_;
    const absl::string_view name = key->key.full_key;
    auto it = table_.find(name);
    if (it == table_.end()) {
      table_.emplace(name, Item{std::move(key), Value{value, is_dead}});
      ++values_;
      most_items_ = std::max(most_items_, table_.size());
      return absl::OkStatus();
    }
    if (std::holds_alternative<Value>(it->second.what)) {
      return absl::AlreadyExistsError(
          absl::StrCat("duplicate send of rendezvous key '", name,
                       "': the previous value has not been received yet"));
    }
    Waiter& waiter = std::get<Waiter>(it->second.what);
    done = std::move(waiter.done);
    waiter_keys_.erase(waiter.token);
    table_.erase(it);
  }
  std::move(done)(absl::OkStatus(), value, is_dead);
  return absl::OkStatus();
}

uint64_t LocalRendezvous::RecvAsync(const ParsedKey& key, RecvDoneCallback done) {
  return RecvAsync(Intern(key), std::move(done));
}

uint64_t LocalRendezvous::RecvAsync(KeyRef key, RecvDoneCallback done) {
  absl::Status error;
  Value value;
  std::vector<std::shared_ptr<Event>> taken;
  {
    MutexLock lock(&mu_);
    if (!status_.ok()) {
      error = status_;
    } else {
      const absl::string_view name = key->key.full_key;
      auto it = table_.find(name);
      if (it == table_.end()) {
        uint64_t token = next_token_++;
        table_.emplace(name, Item{std::move(key), Waiter{token, std::move(done)}});
        waiter_keys_.emplace(token, name);
        most_items_ = std::max(most_items_, table_.size());
        most_waiters_ = std::max(most_waiters_, waiter_keys_.size());
        return token;
      }
      if (std::holds_alternative<Waiter>(it->second.what)) {
        error = absl::AlreadyExistsError(absl::StrCat("duplicate recv of rendezvous key '", name,
                                                      "': a recv is already waiting"));
      } else {
        value = std::move(std::get<Value>(it->second.what));
        table_.erase(it);
        if (--values_ == 0) taken.swap(sends_taken_);
      }
    }
  }
  for (const std::shared_ptr<Event>& event : taken) event->Notify();
  if (!error.ok()) {
    std::move(done)(error, Tensor(), false);
  } else {
    std::move(done)(absl::OkStatus(), value.tensor, value.is_dead);
  }
  return 0;
}

bool LocalRendezvous::CancelRecv(uint64_t token, const absl::Status& status) {
  RecvDoneCallback done;
  {
    MutexLock lock(&mu_);
    auto k = waiter_keys_.find(token);
    if (k == waiter_keys_.end()) return false;
    auto it = table_.find(k->second);
    done = std::move(std::get<Waiter>(it->second.what).done);
    waiter_keys_.erase(k);
    table_.erase(it);  // last: the view `k` held pointed into this item's key
  }
  std::move(done)(status, Tensor(), false);
  return true;
}

void LocalRendezvous::StartAbort(const absl::Status& status) {
  std::vector<RecvDoneCallback> waiters;
  std::vector<std::shared_ptr<Event>> taken;
  absl::Status abort_status = status.ok() ? absl::CancelledError("rendezvous aborted") : status;
  {
    MutexLock lock(&mu_);
    if (status_.ok()) status_ = abort_status;
    abort_status = status_;
    for (auto& [key, item] : table_) {
      if (auto* w = std::get_if<Waiter>(&item.what)) waiters.push_back(std::move(w->done));
    }
    waiter_keys_.clear();  // first: its views point into the table's keys
    table_.clear();
    values_ = 0;
    taken.swap(sends_taken_);
  }
  for (const std::shared_ptr<Event>& event : taken) event->Notify();
  for (RecvDoneCallback& done : waiters) std::move(done)(abort_status, Tensor(), false);
}

absl::Status LocalRendezvous::status() const {
  MutexLock lock(&mu_);
  return status_;
}

size_t LocalRendezvous::NumPendingSends() const {
  MutexLock lock(&mu_);
  return values_;
}

void LocalRendezvous::NotifyWhenSendsTaken(std::shared_ptr<Event> event) {
  {
    MutexLock lock(&mu_);
    if (values_ > 0) {
      sends_taken_.push_back(std::move(event));
      return;
    }
  }
  event->Notify();
}

size_t LocalRendezvous::NumWaiters() const {
  MutexLock lock(&mu_);
  return waiter_keys_.size();
}

}  // namespace tensorverbs
