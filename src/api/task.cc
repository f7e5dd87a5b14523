// The public Task and Step (include/tensorverbs/task.h) over the server and its rendezvous.
#include "tensorverbs/task.h"

#include <pthread.h>

#include <cstdlib>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/common/logging.h"
#include "src/common/mutex.h"
#include "src/common/recurrence_filter.h"
#include "src/common/status_macros.h"
#include "src/rendezvous/remote_rendezvous.h"
#include "src/server/server.h"
#include "src/tensor/adopted_memory.h"
#include "src/tensor/allocator.h"
#include "tensorverbs/device_name.h"

namespace tensorverbs {

// A task's device as keys name it: parsed once, with its full name.
struct TaskDeviceName {
  DeviceName device;
  std::string full_name;  // device.FullName()
  std::string task_name;  // device.TaskName()
};
using TaskDeviceRef = std::shared_ptr<const TaskDeviceName>;

namespace {

// The CPU device of a task named "/job:J/replica:0/task:T" or "J:T".
absl::StatusOr<DeviceName> ParseTaskDevice(absl::string_view task) {
  if (absl::StartsWith(task, "/job:")) {
    absl::StatusOr<DeviceName> d = DeviceName::Parse(absl::StrCat(task, "/device:CPU:0"));
    if (d.ok()) return d;
  } else {
    std::pair<absl::string_view, absl::string_view> parts = absl::StrSplit(task, ':');
    int index = 0;
    if (!parts.first.empty() && absl::SimpleAtoi(parts.second, &index) && index >= 0) {
      return *DeviceName::Parse(CpuDeviceName(parts.first, index));
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("'", task, "' is not a task name: give /job:J/replica:0/task:T or J:T"));
}

TaskDeviceRef MakeTaskDevice(DeviceName device) {
  auto d = std::make_shared<TaskDeviceName>();
  d->full_name = device.FullName();
  d->task_name = device.TaskName();
  d->device = std::move(device);
  return d;
}

}  // namespace

// Keys by the peer and name a caller gave, and the peers' devices by the names callers give
// them. A training loop names the same tensors every step, and building a key (the peer's
// device, the key text) costs more than the rest of a small tensor's recv; so a name seen
// twice keeps its key. Names used once (torch.distributed numbers every message) are built from
// the peer's device, which is parsed once, and never enter the cache. A recv's entry remembers
// the peer incarnation it was made with and is made again when the peer restarted. Any thread.
class KeyCache {
 public:
  struct Entry {
    std::string peer_name;     // /job:J/replica:0/task:T
    uint64_t incarnation = 0;  // the recv's source; 0 for a send's key
    ParsedKey key;
  };
  // The cache's index of a send's (`recv` false) or recv's key of `name` with `peer`.
  static std::string Index(bool recv, absl::string_view peer, absl::string_view name) {
    return absl::StrCat(recv ? "r" : "s", peer, "\n", name);
  }
  std::shared_ptr<const Entry> Find(const std::string& index) {
    MutexLock lock(&mu_);
    auto it = entries_.find(index);
    return it == entries_.end() ? nullptr : it->second;
  }
  // Keeps a copy of `key` under `index` if that was asked for before.
  void Remember(const std::string& index, absl::string_view peer_name, uint64_t incarnation,
                const ParsedKey& key) {
    MutexLock lock(&mu_);
    if (!seen_.SeenBefore(index)) return;
    auto entry = std::make_shared<Entry>();
    entry->peer_name = std::string(peer_name);
    entry->incarnation = incarnation;
    entry->key = key;
    // Bounded, so names that change every step cannot grow it without end.
    if (entries_.size() >= kMaxEntries) entries_.clear();
    entries_[index] = std::move(entry);
  }
  // The CPU device of the task a caller names `task`, parsed once.
  absl::StatusOr<TaskDeviceRef> Device(absl::string_view task) {
    {
      MutexLock lock(&mu_);
      if (auto it = devices_.find(task); it != devices_.end()) return it->second;
    }
    ASSIGN_OR_RETURN(DeviceName device, ParseTaskDevice(task));
    TaskDeviceRef ref = MakeTaskDevice(std::move(device));
    MutexLock lock(&mu_);
    if (devices_.size() >= kMaxDevices) devices_.clear();
    devices_.emplace(std::string(task), ref);
    return ref;
  }

 private:
  static constexpr size_t kMaxEntries = 1 << 16;
  static constexpr size_t kMaxDevices = 1 << 12;
  Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const Entry>> entries_ ABSL_GUARDED_BY(mu_);
  RecurrenceFilter seen_ ABSL_GUARDED_BY(mu_){kMaxEntries};
  absl::flat_hash_map<std::string, TaskDeviceRef> devices_ ABSL_GUARDED_BY(mu_);
};

// Task::Stop's shutdown, run on a thread of its own so that the caller waits for it only up to
// the stop timeout.
struct StopState {
  Mutex mu;
  bool started ABSL_GUARDED_BY(mu) = false;
  bool abandoned ABSL_GUARDED_BY(mu) = false;  // a caller gave up on it and said so
  Notification done;
};

struct Task::Impl {
  std::unique_ptr<Server> server;
  std::string name;
  std::string protocol;
  absl::Duration stop_timeout;
  TaskDeviceRef device;  // this task's CPU device
  KeyCache keys;
  const std::shared_ptr<StopState> stop = std::make_shared<StopState>();
};

struct Step::Impl {
  std::shared_ptr<Task::Impl> task;
  std::shared_ptr<RemoteRendezvous> rendezvous;
  int64_t id = 0;
};

namespace {

// Tasks whose last reference went while tensors from their pools (host or GPU) were still
// referenced: stopped, but kept (with their pool's memory) until those tensors are gone, so no
// Tensor ever points at unmapped memory. A reaper thread, running only while some task is
// parked, looks at their pools every kReapEvery (and when woken: a task parked, started or
// gone) and destroys a task once its pools have been idle at two looks kIdleFor apart, so a
// tensor freed and another taken at once (a pool reused by a late callback) does not count. It
// runs apart from the callers, so a parked task whose destruction blocks (a callback of it that
// never returns) holds the reaper, never a Task::Start or a ~Task. Once the process has begun
// to exit, parked tasks are left as they are: destroying a server then would race the static
// destructors.
constexpr absl::Duration kReapEvery = absl::Milliseconds(50);
constexpr absl::Duration kIdleFor = absl::Milliseconds(10);
struct Parked {
  struct Entry {
    Task::Impl* task = nullptr;
    std::optional<absl::Time> idle_since;  // the first of the looks in a row that saw it idle
  };
  Mutex mu;
  std::vector<Entry> tasks ABSL_GUARDED_BY(mu);
  bool reaper_running ABSL_GUARDED_BY(mu) = false;
  bool wake ABSL_GUARDED_BY(mu) = false;
  bool exiting ABSL_GUARDED_BY(mu) = false;

  // Has the reaper look now, starting it if a task is parked and it is not running.
  void WakeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
};
Parked& parked() {
  static Parked* p = [] {
    std::atexit([] {
      MutexLock lock(&parked().mu);
      parked().exiting = true;
    });
    return new Parked();  // never destroyed: tensors may go during exit
  }();
  return *p;
}

bool PoolInUse(const Task::Impl& impl) { return impl.server->PoolsInUse(); }

void Reaper() {
  pthread_setname_np(pthread_self(), "tv-reaper");
  Parked& all = parked();
  all.mu.Lock();
  while (!all.tasks.empty() && !all.exiting) {
    all.mu.AwaitWithTimeout([&all]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(all.mu) { return all.wake; },
                            kReapEvery);
    all.wake = false;
    if (all.exiting) break;
    std::vector<Task::Impl*> done;
    const absl::Time now = absl::Now();
    for (auto it = all.tasks.begin(); it != all.tasks.end();) {
      if (PoolInUse(*it->task)) {
        it->idle_since.reset();
      } else if (!it->idle_since.has_value()) {
        it->idle_since = now;
      }
      if (it->idle_since.has_value() && now - *it->idle_since >= kIdleFor) {
        done.push_back(it->task);
        it = all.tasks.erase(it);
      } else {
        ++it;
      }
    }
    if (done.empty()) continue;
    all.mu.Unlock();
    for (Task::Impl* p : done) delete p;  // outside the lock: ~Server joins threads
    all.mu.Lock();
  }
  all.reaper_running = false;
  all.mu.Unlock();
}

void Parked::WakeLocked() {
  wake = true;
  if (reaper_running || tasks.empty() || exiting) return;
  try {
    std::thread(Reaper).detach();  // it waits for `mu`, held here
    reaper_running = true;
  } catch (const std::system_error& e) {
    // Parked tasks then wait for the next task to start or go, which tries again.
    LOG(ERROR) << "could not start the thread that frees parked tasks: " << e.what();
  }
}

void WakeReaper() {
  MutexLock lock(&parked().mu);
  parked().WakeLocked();
}

// The deleter of a task: its last reference went, whoever held it (the Task, a Step, Stop's
// thread). By then the server has stopped, as Stop's thread holds a reference until it has, so
// whether a pool is in use is final but for tensors the caller still holds. Deciding here, not
// where the Task goes, is what keeps a Step or a stop still running from dropping a task whose
// pool a tensor uses. On one of the task's own threads (a callback that ends its Step or Task)
// it goes on a thread of its own: ~Server joins those threads.
void Dispose(Task::Impl* p) {
  if (p->server != nullptr && p->server->OnOwnThread()) {
    std::thread([p] { Dispose(p); }).detach();
    return;
  }
  if (p->server != nullptr && PoolInUse(*p)) {
    MutexLock lock(&parked().mu);
    parked().tasks.push_back({p, std::nullopt});
    parked().WakeLocked();
    return;
  }
  delete p;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Task>> Task::Start(TaskOptions options) {
  WakeReaper();
  ASSIGN_OR_RETURN(ServerOptions server_options, ServerOptions::FromEnvironment());
  server_options.cluster = std::move(options.cluster);
  server_options.job = std::move(options.job);
  server_options.task = options.task;
  server_options.protocol = std::move(options.protocol);
  if (options.recv_timeout.has_value()) {
    if (*options.recv_timeout <= absl::ZeroDuration()) {
      return absl::InvalidArgumentError("TaskOptions::recv_timeout must be positive");
    }
    server_options.transfer.recv_timeout = *options.recv_timeout;
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Server> server, Server::Create(std::move(server_options)));
  auto impl = std::shared_ptr<Impl>(new Impl(), Dispose);
  impl->name = server->task_name();
  impl->protocol = server->protocol();
  impl->stop_timeout = server_options.stop_timeout;
  ASSIGN_OR_RETURN(DeviceName device, DeviceName::Parse(server->device_name()));
  impl->device = MakeTaskDevice(std::move(device));
  impl->server = std::move(server);
  return std::unique_ptr<Task>(new Task(std::move(impl)));
}

Task::Task(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

Task::~Task() {
  Stop();
  WakeReaper();
  // On one of the task's own threads, Dispose already hands the last reference to a thread of
  // its own, and nothing here may wait: the task goes once this callback ends.
  if (impl_->server->OnOwnThread()) {
    impl_.reset();
    return;
  }
  // The last reference may go here, and ~Server joins the task's threads: a recv callback that
  // never returns is one of them. So it goes on a thread of its own, waited for up to the stop
  // timeout as Stop is.
  const absl::Duration timeout = impl_->stop_timeout;
  const std::string name = impl_->name;
  auto gone = std::make_shared<Notification>();
  std::thread([impl = std::move(impl_), gone]() mutable {
    impl.reset();  // where the last reference goes, Dispose destroys or parks the task
    gone->Notify();
  }).detach();
  if (!gone->WaitForNotificationWithTimeout(timeout)) {
    LOG(ERROR) << "task " << name << ": destroying it gave up after "
               << absl::FormatDuration(timeout)
               << " (TENSORVERBS_STOP_TIMEOUT_MS): the task waits for its threads, and a recv "
                  "callback has not returned. Its threads and memory stay until it does";
  }
}

void Task::Stop() {
  std::shared_ptr<StopState> state = impl_->stop;
  {
    MutexLock lock(&state->mu);
    if (state->abandoned) return;  // said once; a later Stop (the destructor's) does not wait
    if (!state->started) {
      state->started = true;
      // The thread holds the task while it stops it: a Stop that outlives its caller's wait
      // still finds everything it and the stuck call return to. It lets go before it says it is
      // done, so a Stop that finished in time leaves the task to its owner alone.
      std::thread([impl = impl_, state]() mutable {
        impl->server->Stop();
        impl.reset();
        state->done.Notify();
      }).detach();
    }
  }
  // From a callback the shutdown waits for, waiting could only end in the timeout.
  if (impl_->server->OnOwnThread()) return;
  if (state->done.WaitForNotificationWithTimeout(impl_->stop_timeout)) return;
  {
    MutexLock lock(&state->mu);
    // It may have finished since the wait ended: then there is nothing to report.
    if (state->abandoned || state->done.HasBeenNotified()) return;
    state->abandoned = true;
  }
  LOG(ERROR) << "task " << impl_->name << ": Stop gave up after "
             << absl::FormatDuration(impl_->stop_timeout)
             << " (TENSORVERBS_STOP_TIMEOUT_MS): " << impl_->server->StopReport()
             << ". The shutdown goes on in the background; the task's threads and memory stay "
                "until the stuck call returns (a callback that blocks, or a fabric call that "
                "does not return)";
}

absl::Status Task::WaitForPeers(absl::Duration timeout) {
  return impl_->server->WaitForPeers(timeout);
}

absl::Status Task::WaitForPeers(const std::vector<std::string>& tasks, absl::Duration timeout) {
  return impl_->server->WaitForPeers(tasks, timeout);
}

const std::string& Task::name() const { return impl_->name; }
const std::string& Task::protocol() const { return impl_->protocol; }
uint64_t Task::incarnation() const { return impl_->server->incarnation(); }

absl::StatusOr<std::unique_ptr<Step>> Task::BeginStep(int64_t step_id) {
  ASSIGN_OR_RETURN(std::shared_ptr<RemoteRendezvous> rendezvous,
                   impl_->server->rendezvous_mgr()->Find(step_id));
  auto step = std::make_unique<Step::Impl>();
  step->task = impl_;
  step->rendezvous = std::move(rendezvous);
  step->id = step_id;
  return std::unique_ptr<Step>(new Step(std::move(step)));
}

absl::StatusOr<Tensor> Task::Empty(DataType dtype, const TensorShape& shape) {
  return Tensor::Allocate(impl_->server->recv_allocator(), dtype, shape);
}

absl::StatusOr<Allocator*> Task::DeviceAllocator(int device) {
  ASSIGN_OR_RETURN(PoolAllocator * pool, impl_->server->DeviceAllocator(device));
  return pool;
}

absl::StatusOr<Tensor> Task::AdoptDeviceMemory(int device, void* data, DataType dtype,
                                               const TensorShape& shape,
                                               std::function<void()> release) {
  return impl_->server->AdoptDeviceMemory(device, data, dtype, shape, std::move(release));
}

absl::StatusOr<Tensor> Task::AdoptHostMemory(void* data, DataType dtype, const TensorShape& shape,
                                             std::function<void()> release) {
  return AdoptMemory(MemoryPlacement::Host(), data, dtype, shape, std::move(release));
}

bool Task::Wait(Event& event, absl::Time deadline) {
  return impl_->server->DriveUntil(event, deadline);
}

Task::Burst::Burst(Task& task) : scope_(task.impl_->server->QuietScope()) {}

Task::Burst::~Burst() = default;

absl::Status Task::WaitForDeviceWork(int device) {
  return impl_->server->WaitForDeviceWork(device);
}

TaskStats Task::stats() const {
  const TransferStats& s = impl_->server->stats();
  TaskStats out;
  out.tensors = s.tensors.load(std::memory_order_relaxed);
  out.bytes = s.bytes.load(std::memory_order_relaxed);
  out.errors = s.errors.load(std::memory_order_relaxed);
  out.copies = s.copies.load(std::memory_order_relaxed);
  out.copied_bytes = s.copied_bytes.load(std::memory_order_relaxed);
  return out;
}

std::vector<std::pair<std::string, int64_t>> Task::counters() const {
  return impl_->server->Counters();
}

Step::Step(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Step::~Step() {
  impl_->rendezvous.reset();
  impl_->task->server->rendezvous_mgr()->Cleanup(impl_->id);
}

int64_t Step::id() const { return impl_->id; }

absl::Status Step::Send(absl::string_view dst_task, absl::string_view name, const Tensor& value) {
  Task::Impl& task = *impl_->task;
  KeyCache& keys = task.keys;
  const std::string index = KeyCache::Index(false, dst_task, name);
  if (std::shared_ptr<const KeyCache::Entry> cached = keys.Find(index)) {
    return SendKey(cached->key, value);
  }
  ASSIGN_OR_RETURN(TaskDeviceRef dst, keys.Device(dst_task));
  ASSIGN_OR_RETURN(ParsedKey key,
                   ParsedKey::Make(task.device->device, task.device->full_name,
                                   task.server->incarnation(), dst->device, dst->full_name, name));
  keys.Remember(index, dst->task_name, 0, key);
  return SendKey(key, value);
}

absl::Status Step::SendKey(const ParsedKey& key, const Tensor& value) {
  if (!value.IsInitialized()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sending ", key.edge_name, ": the tensor is uninitialized"));
  }
  return impl_->rendezvous->Send(key, value);
}

namespace {

// Starts the recv of `key` in `rendezvous`; `done` gets the tensor, or an uninitialized one for a
// dead tensor.
void StartRecv(RemoteRendezvous& rendezvous, const ParsedKey& key, const RecvOptions& options,
               Step::RecvCallback done) {
  RecvArgs args;
  args.allocator = options.allocator;
  args.expected_dtype = options.expected_dtype;
  args.expected_shape = options.expected_shape;
  args.into = options.into;
  args.quick_callback = options.quick_callback;
  args.waiter_starts = options.waiter_starts;
  rendezvous.RecvAsync(
      key, args,
      [done = std::move(done)](const absl::Status& status, const Tensor& tensor, bool is_dead) {
        if (!status.ok()) {
          done(status);
        } else if (is_dead) {
          done(Tensor());  // TensorFlow's dead tensor (an untaken branch): no value
        } else {
          done(tensor);
        }
      });
}

// The key of `name` sent by `src` (whose incarnation is `incarnation`) to `task`.
absl::StatusOr<ParsedKey> KeyFrom(const Task::Impl& task, const TaskDeviceName& src,
                                  uint64_t incarnation, absl::string_view name) {
  return ParsedKey::Make(src.device, src.full_name, incarnation, task.device->device,
                         task.device->full_name, name);
}

}  // namespace

void Step::RecvAsync(absl::string_view src_task, absl::string_view name, RecvCallback done) {
  RecvAsync(src_task, name, RecvOptions(), std::move(done));
}

void Step::RecvAsync(absl::string_view src_task, absl::string_view name, const RecvOptions& options,
                     RecvCallback done) {
  Server& server = *impl_->task->server;
  KeyCache& keys = impl_->task->keys;
  const std::string index = KeyCache::Index(true, src_task, name);
  if (std::shared_ptr<const KeyCache::Entry> cached = keys.Find(index)) {
    if (server.KnownPeerIncarnation(cached->peer_name) == cached->incarnation) {
      RecvKeyAsync(cached->key, options, std::move(done));
      return;
    }
  }
  absl::StatusOr<TaskDeviceRef> src = keys.Device(src_task);
  if (!src.ok()) {
    done(src.status());
    return;
  }
  if (std::optional<uint64_t> known = server.KnownPeerIncarnation((*src)->task_name)) {
    absl::StatusOr<ParsedKey> key = KeyFrom(*impl_->task, **src, *known, name);
    if (!key.ok()) {
      done(key.status());
      return;
    }
    keys.Remember(index, (*src)->task_name, *known, *key);
    RecvKeyAsync(*key, options, std::move(done));
    return;
  }
  // A peer not asked yet (WaitForPeers records them all): asking waits for it to answer, up to
  // 30 s, which an asynchronous call must not do on its caller's thread. A thread of its own
  // asks, holding the task and the step's rendezvous; a step ended meanwhile fails the recv.
  std::thread([task = impl_->task, rendezvous = impl_->rendezvous, src = *std::move(src),
               name = std::string(name), options, done = std::move(done)]() mutable {
    absl::StatusOr<uint64_t> incarnation =
        task->server->PeerIncarnation(src->task_name, absl::Seconds(30));
    if (!incarnation.ok()) {
      done(incarnation.status());
      return;
    }
    absl::StatusOr<ParsedKey> key = KeyFrom(*task, *src, *incarnation, name);
    if (!key.ok()) {
      done(key.status());
      return;
    }
    StartRecv(*rendezvous, *key, options, std::move(done));
  }).detach();
}

void Step::RecvKeyAsync(const ParsedKey& key, RecvCallback done) {
  RecvKeyAsync(key, RecvOptions(), std::move(done));
}

void Step::RecvKeyAsync(const ParsedKey& key, const RecvOptions& options, RecvCallback done) {
  StartRecv(*impl_->rendezvous, key, options, std::move(done));
}

absl::StatusOr<Tensor> Step::Recv(absl::string_view src_task, absl::string_view name,
                                  absl::Duration timeout) {
  RecvOptions options;
  options.timeout = timeout;
  return Recv(src_task, name, options);
}

absl::StatusOr<Tensor> Step::Recv(absl::string_view src_task, absl::string_view name,
                                  const RecvOptions& options) {
  const absl::Duration timeout = options.timeout;
  const absl::Time deadline =
      timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
  // Shared with the callback, which may run after a timed-out Recv returned. The result is
  // written before the event is notified and read only after it was.
  struct State {
    Event event;
    absl::StatusOr<Tensor> result;
  };
  auto state = std::make_shared<State>();
  RecvOptions quick = options;
  quick.quick_callback = true;
  quick.waiter_starts = true;
  RecvAsync(src_task, name, quick, [state](absl::StatusOr<Tensor> result) {
    state->result = std::move(result);
    state->event.Notify();
  });
  if (!impl_->task->server->DriveUntil(state->event, deadline)) {
    return absl::DeadlineExceededError(absl::StrCat("recv of '", name, "' from ", src_task,
                                                    " in step ", impl_->id, " took over ",
                                                    absl::FormatDuration(timeout)));
  }
  return std::move(state->result);
}

absl::Status Step::WaitUntilSendsTaken(absl::Duration timeout) {
  const absl::Time deadline =
      timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
  // Peers take the sends through this task's progress, which this thread drives meanwhile.
  auto taken = std::make_shared<Event>();
  impl_->rendezvous->NotifyWhenSendsTaken(taken);
  if (impl_->task->server->DriveUntil(*taken, deadline)) return absl::OkStatus();
  const size_t left = impl_->rendezvous->NumPendingSends();
  if (left == 0) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat(left, " tensors sent in step ", impl_->id,
                                                  " were not taken by their peers within ",
                                                  absl::FormatDuration(timeout)));
}

}  // namespace tensorverbs
