#include "src/fabric/loopback/loopback.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/common/mutex.h"
#include "src/common/sanitizers.h"
#include "src/common/status_macros.h"
#include "src/fabric/endpoint_base.h"

namespace tensorverbs::fabric::loopback {
namespace {

std::atomic<uint64_t> next_id{1};

struct Region {
  uint64_t base;
  uint64_t length;
  uint32_t access;
  uint64_t endpoint = 0;  // RegisterMemoryFor: the only local endpoint whose peer may use it
};

struct PendingCompletion {
  Completion completion;
  int polls_left;
};

class LoopbackEndpoint;

// What other domains' endpoints reach: the regions and the completion queue.
struct DomainState {
  const uint64_t id = next_id.fetch_add(1);
  Mutex mu;
  std::map<uint64_t, Region> regions ABSL_GUARDED_BY(mu);  // key -> region
  // A vector compacted by Poll, not a deque, which would allocate a node every few completions.
  std::vector<PendingCompletion> queue ABSL_GUARDED_BY(mu);
  Faults faults ABSL_GUARDED_BY(mu);
  int posts ABSL_GUARDED_BY(mu) = 0;
  int registrations ABSL_GUARDED_BY(mu) = 0;
  int ops ABSL_GUARDED_BY(mu) = 0;
  int imms ABSL_GUARDED_BY(mu) = 0;
  int writes_with_imm ABSL_GUARDED_BY(mu) = 0;
  bool closed ABSL_GUARDED_BY(mu) = false;
  // The doorbell a sleeping domain polls (PrepareToSleep): rung by Interrupt, by fault changes,
  // and by each completion pushed while the domain is armed to sleep.
  const int bell = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  bool armed ABSL_GUARDED_BY(mu) = false;
  // Set once this domain's writes had an immediate delivered twice: from then on a peer may
  // take a completion for a write still to come and read its target while it is copied.
  bool duplicated_an_imm ABSL_GUARDED_BY(mu) = false;

  ~DomainState() {
    if (bell >= 0) close(bell);
  }

  void Push(const Completion& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    queue.push_back({c, faults.delay_polls});
    if (armed) Ring();
  }
  void Ring() const {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t w = write(bell, &one, sizeof(one));
  }
};

// Endpoint identity shared with peers; `owner` is cleared when the endpoint goes away.
struct EndpointState {
  const uint64_t id = next_id.fetch_add(1);
  std::shared_ptr<DomainState> domain;
  Endpoint* owner ABSL_GUARDED_BY(domain->mu) = nullptr;
};

Mutex registry_mu;
std::map<std::string, std::weak_ptr<EndpointState>>& Registry() {
  static auto* registry = new std::map<std::string, std::weak_ptr<EndpointState>>();
  return *registry;
}

RemoteKey PackKey(uint64_t key, uint64_t base, uint64_t length) {
  char out[24];
  std::memcpy(&out[0], &key, 8);
  std::memcpy(&out[8], &base, 8);
  std::memcpy(&out[16], &length, 8);
  return RemoteKey(absl::string_view(out, sizeof(out)));
}

class LoopbackRegion final : public MemoryRegion {
 public:
  LoopbackRegion(std::shared_ptr<DomainState> domain, uint64_t key, void* base, size_t length)
      : MemoryRegion(base, length), domain_(std::move(domain)), key_(key) {}
  ~LoopbackRegion() override {
    MutexLock lock(&domain_->mu);
    domain_->regions.erase(key_);
  }
  RemoteKey PackRemoteKey() const override {
    return PackKey(key_, reinterpret_cast<uint64_t>(base()), length());
  }

 private:
  std::shared_ptr<DomainState> domain_;
  const uint64_t key_;
};

class LoopbackEndpoint final : public EndpointBase {
 public:
  explicit LoopbackEndpoint(std::shared_ptr<DomainState> domain)
      : state_(std::make_shared<EndpointState>()) {
    state_->domain = std::move(domain);
    {
      MutexLock lock(&state_->domain->mu);
      state_->owner = this;
    }
    MutexLock lock(&registry_mu);
    Registry()[LocalAddress()] = state_;
  }

  ~LoopbackEndpoint() override {
    {
      MutexLock lock(&registry_mu);
      Registry().erase(LocalAddress());
    }
    MutexLock lock(&state_->domain->mu);
    state_->owner = nullptr;
    // Completions for this endpoint can no longer be delivered.
    auto& q = state_->domain->queue;
    for (auto it = q.begin(); it != q.end();) {
      it = it->completion.endpoint == this ? q.erase(it) : std::next(it);
    }
  }

  std::string LocalAddress() const override {
    return absl::StrCat("loopback:", state_->domain->id, ":", state_->id);
  }
  uint64_t id() const { return state_->id; }

  absl::Status Connect(absl::string_view peer_address) override {
    MutexLock lock(&registry_mu);
    auto it = Registry().find(std::string(peer_address));
    if (it == Registry().end() || it->second.expired()) {
      return absl::UnavailableError(
          absl::StrCat("loopback: no endpoint at address '", peer_address, "'"));
    }
    peer_ = it->second;
    return absl::OkStatus();
  }

  size_t Outstanding() const override {
    MutexLock lock(&state_->domain->mu);
    size_t n = 0;
    for (const auto& p : state_->domain->queue) {
      n += p.completion.endpoint == this && p.completion.kind != CompletionKind::kRemoteWriteImm;
    }
    return n;
  }

 private:
  absl::Status Post(CompletionKind kind, bool with_imm, uint32_t imm, const LocalBuffer& local,
                    const RemoteBuffer& remote, uint64_t context) override {
    DomainState& self = *state_->domain;
    {
      MutexLock lock(&self.mu);
      if (++self.posts == self.faults.fail_post_nth) {
        return absl::UnavailableError(
            absl::StrCat("loopback: injected failure of post ", self.posts));
      }
    }
    if (remote.key.size() != 24) {
      return absl::InvalidArgumentError("loopback: malformed remote key");
    }
    uint64_t key, key_base, key_length;
    std::memcpy(&key, remote.key.data(), 8);
    std::memcpy(&key_base, remote.key.data() + 8, 8);
    std::memcpy(&key_length, remote.key.data() + 16, 8);
    RETURN_IF_ERROR(CheckRanges("loopback", local, remote, key_base, key_length));
    std::shared_ptr<EndpointState> peer = peer_.lock();
    if (peer == nullptr) {
      return absl::UnavailableError("loopback: endpoint is not connected or its peer is gone");
    }
    DomainState& target = *peer->domain;
    bool error_completion, drop_imm, duplicate_imm, corrupt, unordered;
    {
      MutexLock lock(&self.mu);
      int op = ++self.ops;
      error_completion = op == self.faults.error_completion_nth;
      int wimm = with_imm ? ++self.writes_with_imm : 0;
      drop_imm = with_imm && wimm == self.faults.drop_imm_nth;
      duplicate_imm = with_imm && wimm == self.faults.duplicate_imm_nth;
      corrupt = with_imm && wimm == self.faults.corrupt_write_nth;
      unordered = self.duplicated_an_imm;
      if (duplicate_imm) self.duplicated_an_imm = true;
    }
    Completion done;
    done.kind = kind;
    done.endpoint = this;
    done.context = context;
    if (error_completion) {
      done.status = absl::InternalError("loopback: injected error completion");
    } else {
      // The target's lock keeps the region registered while the bytes move.
      MutexLock lock(&target.mu);
      if (peer->owner == nullptr || target.closed) {
        return absl::UnavailableError("loopback: the peer endpoint is closed");
      }
      auto r = target.regions.find(key);
      if (r == target.regions.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("loopback: remote key ", key, " is not registered on the peer"));
      }
      const Region& region = r->second;
      if (region.base != key_base || region.length != key_length) {
        return absl::InvalidArgumentError(
            "loopback: remote key does not match the registered region");
      }
      if (region.endpoint != 0 && region.endpoint != peer->id) {
        return absl::PermissionDeniedError(absl::StrCat(
            "loopback: remote key ", key, " was registered for another endpoint's peer"));
      }
      const uint32_t needed =
          kind == CompletionKind::kRead ? kAccessRemoteRead : kAccessRemoteWrite;
      if ((region.access & needed) == 0) {
        return absl::PermissionDeniedError(
            "loopback: the remote region does not allow this access");
      }
      auto* remote_ptr = reinterpret_cast<char*>(remote.addr);
      if (local.length > 0) {
        if (kind == CompletionKind::kRead) {
          std::memcpy(local.addr, remote_ptr, local.length);
        } else {
          // After an injected duplicate the copy stands for a DMA write racing the peer's read
          // by design (see sanitizers.h); TSan is told to look away only then.
          ScopedTsanIgnoreAccesses dma(unordered);
          std::memcpy(remote_ptr, local.addr, local.length);
          if (corrupt) remote_ptr[local.length / 2] ^= 0x5A;
        }
      }
      if (with_imm && !drop_imm) {
        Completion arrived;
        arrived.kind = CompletionKind::kRemoteWriteImm;
        arrived.endpoint = peer->owner;
        arrived.imm = imm;
        arrived.byte_len = local.length;
        target.Push(arrived);
        if (duplicate_imm) target.Push(arrived);
      }
    }
    MutexLock lock(&self.mu);
    self.Push(done);
    return absl::OkStatus();
  }

  std::shared_ptr<EndpointState> state_;
  std::weak_ptr<EndpointState> peer_;
};

class LoopbackDomain final : public Domain {
 public:
  explicit LoopbackDomain(const DomainOptions& options) : state_(std::make_shared<DomainState>()) {
    caps_.backend = "loopback";
    caps_.provider = "loopback";
    caps_.family = "loopback";
    caps_.max_message_size = uint64_t{1} << 40;
    caps_.virtual_addressing = true;
    caps_.queue_depth = options.queue_depth;
    caps_.channel_keys = true;
    caps_.endpoint_bound_keys = true;
  }
  ~LoopbackDomain() override {
    MutexLock lock(&state_->mu);
    state_->closed = true;
  }

  const Capabilities& capabilities() const override { return caps_; }

  absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemory(void* addr, size_t length,
                                                               uint32_t access) override {
    return Register(addr, length, access, 0);
  }

  absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemoryFor(Endpoint& endpoint, void* addr,
                                                                  size_t length,
                                                                  uint32_t access) override {
    return Register(addr, length, access, static_cast<LoopbackEndpoint&>(endpoint).id());
  }

  absl::StatusOr<std::unique_ptr<Endpoint>> CreateEndpoint() override {
    return std::unique_ptr<Endpoint>(new LoopbackEndpoint(state_));
  }

  absl::StatusOr<std::unique_ptr<MemoryRegion>> Register(void* addr, size_t length, uint32_t access,
                                                         uint64_t endpoint) {
    if (addr == nullptr || length == 0) {
      return absl::InvalidArgumentError("loopback: cannot register an empty range");
    }
    uint64_t key = next_id.fetch_add(1);
    absl::Duration delay;
    {
      MutexLock lock(&state_->mu);
      if (state_->faults.slow_registrations > 0) {
        --state_->faults.slow_registrations;
        delay = state_->faults.register_delay;
      }
    }
    absl::SleepFor(delay);
    MutexLock lock(&state_->mu);
    if (++state_->registrations == state_->faults.fail_register_nth) {
      return absl::ResourceExhaustedError("loopback: injected registration failure");
    }
    state_->regions[key] = Region{reinterpret_cast<uint64_t>(addr), length, access, endpoint};
    return std::unique_ptr<MemoryRegion>(new LoopbackRegion(state_, key, addr, length));
  }

  absl::StatusOr<size_t> Poll(absl::Span<Completion> out) override {
    MutexLock lock(&state_->mu);
    if (state_->faults.stalled) return 0;
    // Ready completions go out in queue order; delayed ones stay, in order, at the front.
    size_t ready = 0;
    size_t kept = 0;
    std::vector<PendingCompletion>& queue = state_->queue;
    for (PendingCompletion& pending : queue) {
      if (ready == out.size()) {
        queue[kept++] = pending;
        continue;
      }
      if (pending.polls_left > 0) {
        --pending.polls_left;
        queue[kept++] = pending;
        continue;
      }
      out[ready++] = pending.completion;
    }
    queue.resize(kept);
    if (state_->faults.reverse_order) std::reverse(out.begin(), out.begin() + ready);
    return ready;
  }

  absl::Status Wait(absl::Duration timeout) override {
    Domain* self = this;
    return SleepOn(absl::MakeConstSpan(&self, 1), timeout);
  }

  absl::StatusOr<bool> PrepareToSleep(std::vector<pollfd>* fds, absl::Duration* timeout) override {
    (void)timeout;
    DomainState& st = *state_;
    if (st.bell < 0) return absl::UnavailableError("loopback: no eventfd for the doorbell");
    MutexLock lock(&st.mu);
    // Delayed completions become ready only through Poll calls, so they end the sleep too.
    if (!st.queue.empty() && !st.faults.stalled) return false;
    st.armed = true;
    fds->push_back(pollfd{st.bell, POLLIN, 0});
    return true;
  }

  void FinishSleep(absl::Span<const pollfd> fds) override {
    DomainState& st = *state_;
    {
      MutexLock lock(&st.mu);
      st.armed = false;
    }
    if (!fds.empty() && fds[0].revents != 0) {
      uint64_t value;
      [[maybe_unused]] ssize_t r = read(st.bell, &value, sizeof(value));
    }
  }

  void Interrupt() override { state_->Ring(); }

  void SetFaults(const Faults& faults) {
    MutexLock lock(&state_->mu);
    state_->faults = faults;
    state_->posts = state_->registrations = state_->ops = state_->imms = state_->writes_with_imm =
        0;
    // A stall that ends makes the queue pollable: a sleeper looks again.
    state_->Ring();
  }

 private:
  Capabilities caps_;
  std::shared_ptr<DomainState> state_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Domain>> OpenLoopbackDomain(const DomainOptions& options) {
  return std::unique_ptr<Domain>(new LoopbackDomain(options));
}

void SetFaults(Domain* domain, const Faults& faults) {
  static_cast<LoopbackDomain*>(domain)->SetFaults(faults);
}

}  // namespace tensorverbs::fabric::loopback
