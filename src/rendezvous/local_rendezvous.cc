#include "src/rendezvous/local_rendezvous.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tensorverbs {

LocalRendezvous::~LocalRendezvous() {
  StartAbort(absl::CancelledError("rendezvous destroyed while a recv was pending"));
}

absl::Status LocalRendezvous::Send(const ParsedKey& key, const Tensor& value, bool is_dead) {
  RecvDoneCallback done;
  {
    MutexLock lock(&mu_);
    if (!status_.ok()) return status_;
    auto it = table_.find(key.full_key);
    if (it == table_.end()) {
      table_.emplace(key.full_key, Value{value, is_dead});
      return absl::OkStatus();
    }
    if (std::holds_alternative<Value>(it->second)) {
      return absl::AlreadyExistsError(
          absl::StrCat("duplicate send of rendezvous key '", key.full_key,
                       "': the previous value has not been received yet"));
    }
    Waiter& waiter = std::get<Waiter>(it->second);
    done = std::move(waiter.done);
    waiter_keys_.erase(waiter.token);
    table_.erase(it);
  }
  std::move(done)(absl::OkStatus(), value, is_dead);
  return absl::OkStatus();
}

uint64_t LocalRendezvous::RecvAsync(const ParsedKey& key, RecvDoneCallback done) {
  absl::Status error;
  Value value;
  {
    MutexLock lock(&mu_);
    if (!status_.ok()) {
      error = status_;
    } else {
      auto it = table_.find(key.full_key);
      if (it == table_.end()) {
        uint64_t token = next_token_++;
        table_.emplace(key.full_key, Waiter{token, std::move(done)});
        waiter_keys_.emplace(token, key.full_key);
        return token;
      }
      if (std::holds_alternative<Waiter>(it->second)) {
        error = absl::AlreadyExistsError(absl::StrCat(
            "duplicate recv of rendezvous key '", key.full_key, "': a recv is already waiting"));
      } else {
        value = std::move(std::get<Value>(it->second));
        table_.erase(it);
      }
    }
  }
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
    done = std::move(std::get<Waiter>(it->second).done);
    table_.erase(it);
    waiter_keys_.erase(k);
  }
  std::move(done)(status, Tensor(), false);
  return true;
}

void LocalRendezvous::StartAbort(const absl::Status& status) {
  std::vector<RecvDoneCallback> waiters;
  absl::Status abort_status = status.ok() ? absl::CancelledError("rendezvous aborted") : status;
  {
    MutexLock lock(&mu_);
    if (status_.ok()) status_ = abort_status;
    abort_status = status_;
    for (auto& [key, item] : table_) {
      if (auto* w = std::get_if<Waiter>(&item)) waiters.push_back(std::move(w->done));
    }
    table_.clear();
    waiter_keys_.clear();
  }
  for (RecvDoneCallback& done : waiters) std::move(done)(abort_status, Tensor(), false);
}

absl::Status LocalRendezvous::status() const {
  MutexLock lock(&mu_);
  return status_;
}

size_t LocalRendezvous::NumPendingSends() const {
  MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [key, item] : table_) n += std::holds_alternative<Value>(item);
  return n;
}

size_t LocalRendezvous::NumWaiters() const {
  MutexLock lock(&mu_);
  return waiter_keys_.size();
}

}  // namespace tensorverbs
