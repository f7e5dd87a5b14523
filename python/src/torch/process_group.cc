#include "python/src/torch/process_group.h"

#include <Python.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <stdexcept>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "python/src/torch/collective.h"
#include "python/src/torch/work.h"
#include "src/common/config.h"
#include "src/common/host_identity.h"
#include "tensorverbs/placement.h"
#include "tensorverbs/version.h"

namespace tensorverbs::torch_backend {
namespace {

// The group's one step: its messages are told apart by name, never by step.
constexpr int64_t kStepId = 1;

// How long a group that goes (or a process that exits) waits for its peers to take what it sent:
// a peer may still be on its way to the last messages of a collective this rank has finished.
constexpr std::chrono::milliseconds kDrainLimit = std::chrono::seconds(10);

// Sends from this size lend the caller's tensor instead of copying it: the transport's own
// threshold for writing from memory outside its pool (Task::AdoptHostMemory), below which it
// would stage a copy anyway, and the copy here lets the send complete at once.
constexpr size_t kLendSendsFrom = size_t{64} << 10;

// Lets go of the GIL for its scope when the calling thread holds it. A group's last reference
// often goes from Python (destroy_process_group, a local that goes out of scope), with the GIL
// held; the threads the destructor waits for may need the GIL themselves, to drop a tensor
// whose Python object died before the C++ side let go of it.
class GilReleasedIfHeld {
 public:
  GilReleasedIfHeld()
      : state_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~GilReleasedIfHeld() {
    if (state_ != nullptr) PyEval_RestoreThread(state_);
  }
  GilReleasedIfHeld(const GilReleasedIfHeld&) = delete;
  GilReleasedIfHeld& operator=(const GilReleasedIfHeld&) = delete;

 private:
  PyThreadState* const state_;
};

// The groups alive in this process, for DrainAllGroups at exit.
struct LiveGroups {
  std::mutex mu;
  std::set<ProcessGroupTensorVerbs*> groups;
};
LiveGroups& Live() {
  static LiveGroups* live = new LiveGroups();  // never destroyed: used during exit
  return *live;
}
void Register(ProcessGroupTensorVerbs* g) {
  std::lock_guard<std::mutex> lock(Live().mu);
  Live().groups.insert(g);
}
void Unregister(ProcessGroupTensorVerbs* g) {
  std::lock_guard<std::mutex> lock(Live().mu);
  Live().groups.erase(g);
}

[[noreturn]] void Throw(const std::string& message) {
  throw std::runtime_error(absl::StrCat("tensorverbs: ", message));
}

// The address peers reach this rank at: TENSORVERBS_HOST, else this host's name resolved
// (gloo's default), else loopback.
std::string HostAddress(const Config& config) {
  const std::string& host = config.torch_host;
  if (!host.empty()) return host;
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) == 0) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (getaddrinfo(name, nullptr, &hints, &found) == 0 && found != nullptr) {
      char text[INET_ADDRSTRLEN] = {};
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr, text,
                sizeof(text));
      freeaddrinfo(found);
      return text;
    }
  }
  return "127.0.0.1";
}

// torch's errors carry a C++ backtrace after their first line.
std::string FirstLine(const char* text) {
  const char* end = std::strchr(text, '\n');
  return end == nullptr ? std::string(text) : std::string(text, end);
}

std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string Text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

}  // namespace

c10::intrusive_ptr<ProcessGroupTensorVerbs> ProcessGroupTensorVerbs::Create(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout) {
  if (size < 1 || rank < 0 || rank >= size) {
    Throw(absl::StrCat("rank ", rank, " is not in a world of size ", size));
  }
  if (timeout.count() <= 0) timeout = std::chrono::minutes(30);
  // Read at each group's creation, as a script may set the variables between groups.
  absl::StatusOr<Config> parsed =
      Config::FromEnvironment(EnvironmentVariables({"TENSORVERBS_", "RDMA_"}));
  if (!parsed.ok()) Throw(std::string(parsed.status().message()));
  const Config& config = *parsed;
  const std::string& protocol = config.torch_protocol;
  const std::string host = HostAddress(config);
  // Picked outside the ephemeral range and reserved on this host (tensorverbs/placement.h):
  // the task binds it only after every rank read the addresses.
  absl::StatusOr<std::vector<int>> port = tensorverbs::PickFreePorts(1, host);
  if (!port.ok()) {
    Throw(absl::StrCat(port.status().message(),
                       " (set TENSORVERBS_HOST to an address of this host)"));
  }
  const std::string address = absl::StrCat(host, ":", (*port)[0]);
  // A group made again over the same store (init after destroy) must not read the last one's
  // addresses: every rank counts its own inits, which agree when the ranks do.
  const int64_t generation = store->add(absl::StrCat("tensorverbs/inits/", rank), 1);
  const std::string prefix = absl::StrCat("tensorverbs/", generation, "/");
  // Ranks that all run on this host reduce through shared memory (same_host.h); each says where
  // it runs and whether it may, so that every rank decides alike.
  // Only where the ranks' own fabric would be the same-host one: a fabric forced to the network
  // (TENSORVERBS_FABRIC=ofi, say) is what the user wants measured or used.
  const bool may_share =
      config.torch_same_host && (config.fabric == "auto" || config.fabric == "shmem");
  const std::string mine = absl::StrCat(Version(), "|", size, "|", protocol, "|", address, "|",
                                        ThisHostIdentity(), "|", may_share ? 1 : 0);
  store->set(absl::StrCat(prefix, "rank/", rank), Bytes(mine));
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(absl::StrCat(prefix, "rank/", r));
  try {
    store->wait(keys, timeout);
  } catch (const std::exception& e) {
    std::vector<std::string> missing;
    for (int r = 0; r < size; ++r) {
      try {
        if (!store->check({keys[r]})) missing.push_back(absl::StrCat(r));
      } catch (const std::exception&) {
      }
    }
    // Each init of this rank counts itself, and one process inits a group once at a time: a
    // count past ours while we wait means another process joined as this rank.
    std::string twice;
    try {
      const int64_t inits = store->add(absl::StrCat("tensorverbs/inits/", rank), 0);
      if (inits > generation) {
        twice = absl::StrCat("; rank ", rank,
                             " was started by more than one process: each process needs a rank "
                             "of its own");
      }
    } catch (const std::exception&) {
    }
    Throw(absl::StrCat("rank(s) ", absl::StrJoin(missing, ", "), " did not join within ",
                       timeout.count(),
                       " ms: does every rank call init_process_group with "
                       "backend='tensorverbs' and the same world_size? (the store said: ",
                       FirstLine(e.what()), ")", twice));
  }
  std::vector<std::string> addresses(size);
  bool share = protocol == "grpc+verbs" && size >= 2 && size <= SameHostGroup::kMaxRanks;
  for (int r = 0; r < size; ++r) {
    const std::string theirs = Text(store->get(keys[r]));
    std::vector<std::string> f = absl::StrSplit(theirs, absl::MaxSplits('|', 5));
    int their_size = 0;
    if (f.size() != 6 || !absl::SimpleAtoi(f[1], &their_size)) {
      Throw(absl::StrCat("rank ", r, " published '", theirs, "', not a tensorverbs address"));
    }
    if (f[0] != Version()) {
      Throw(absl::StrCat("rank ", r, " runs tensorverbs ", f[0], " and this rank ", rank, " ",
                         Version(), ": use one version on every rank"));
    }
    if (their_size != size) {
      Throw(absl::StrCat("rank ", r, " was started with world_size ", their_size, " and this rank ",
                         rank, " with ", size));
    }
    if (f[2] != protocol) {
      Throw(absl::StrCat("rank ", r, " uses protocol ", f[2], " and this rank ", rank, " ",
                         protocol, ": set TENSORVERBS_PROTOCOL alike on every rank"));
    }
    addresses[r] = f[3];
    share = share && f[4] == ThisHostIdentity() && f[5] == "1";
  }
  std::unique_ptr<SameHostGroup> same_host;
  if (share) {
    SameHostGroup::Store access;
    access.set = [&](const std::string& key, const std::string& value) {
      store->set(key, Bytes(value));
    };
    access.get = [&](const std::string& key) -> absl::StatusOr<std::string> {
      try {
        store->wait({key}, timeout);
        return Text(store->get(key));
      } catch (const std::exception& e) {
        return absl::UnavailableError(
            absl::StrCat("the store did not give ", key, ": ", FirstLine(e.what())));
      }
    };
    absl::StatusOr<std::unique_ptr<SameHostGroup>> joined =
        SameHostGroup::Join(access, absl::StrCat(prefix, "same_host"), rank, size, timeout);
    if (!joined.ok()) Throw(joined.status().ToString());
    same_host = *std::move(joined);
  }
  absl::StatusOr<ClusterSpec> cluster =
      ClusterSpec::Parse(absl::StrCat("rank=", absl::StrJoin(addresses, ",")));
  if (!cluster.ok()) Throw(cluster.status().ToString());
  TaskOptions options;
  options.cluster = *std::move(cluster);
  options.job = "rank";
  options.task = rank;
  options.protocol = protocol;
  options.recv_timeout = absl::FromChrono(timeout);
  absl::StatusOr<std::unique_ptr<Task>> task = Task::Start(std::move(options));
  if (!task.ok()) Throw(absl::StrCat("rank ", rank, ": ", task.status().ToString()));
  absl::Status peers = (*task)->WaitForPeers(absl::FromChrono(timeout));
  if (!peers.ok()) Throw(absl::StrCat("rank ", rank, ": ", peers.ToString()));
  return c10::make_intrusive<ProcessGroupTensorVerbs>(rank, size, timeout, store, prefix,
                                                      std::move(addresses), *std::move(task),
                                                      std::move(same_host));
}

ProcessGroupTensorVerbs::ProcessGroupTensorVerbs(
    int rank, int size, std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Store> store,
    std::string key_prefix, std::vector<std::string> addresses, std::unique_ptr<Task> task,
    std::unique_ptr<SameHostGroup> same_host)
    : c10d::ProcessGroup(rank, size),
      timeout_(timeout),
      store_(std::move(store)),
      key_prefix_(std::move(key_prefix)),
      addresses_(std::move(addresses)),
      task_(std::move(task)),
      same_host_(std::move(same_host)),
      // Only grpc+verbs writes from the caller's memory; the other protocols would copy a lent
      // tensor all the same, only later, and their sends would complete later for nothing.
      lend_from_(task_->protocol() == "grpc+verbs" ? kLendSendsFrom : 0),
      completer_(WorkCompleter::Start()) {
  absl::StatusOr<std::unique_ptr<Step>> step = task_->BeginStep(kStepId);
  if (!step.ok()) Throw(step.status().ToString());
  step_ = *std::move(step);
  for (int r = 0; r < size; ++r) peer_tasks_.push_back(absl::StrCat("rank:", r));
  Step* step_ptr = step_.get();
  const std::vector<std::string>* tasks = &peer_tasks_;
  matcher_ = std::make_shared<P2pMatcher>(
      size, rank,
      [step_ptr, tasks, rank](int src, int64_t tag, int64_t n, size_t bytes, Tensor into,
                              P2pMatcher::NetworkDone done) {
        RecvOptions options = ExpectBytes(bytes);
        options.into = std::move(into);
        step_ptr->RecvAsync(
            (*tasks)[src], P2pName(src, rank, tag, n), options,
            [done = std::move(done)](absl::StatusOr<Tensor> message) { done(std::move(message)); });
      });
  worker_ = std::thread([this] { WorkerLoop(); });
  Register(this);
  init();
}

// The last strong reference may go while works still hold weak ones (their runners): the group
// shuts down then, not when the memory goes with the last work.
void ProcessGroupTensorVerbs::release_resources() { Shutdown(); }

ProcessGroupTensorVerbs::~ProcessGroupTensorVerbs() { Shutdown(); }

void ProcessGroupTensorVerbs::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  GilReleasedIfHeld no_gil;
  Unregister(this);
  // The last reference can go inside a work's future callback, on the worker itself, which
  // cannot wait for itself: it does not wait for the queue or join, and fails what is still
  // queued here. It still waits for the peers to take what was sent: a peer finishing the
  // collective that just ended here needs those messages.
  const bool on_worker = worker_.get_id() == std::this_thread::get_id();
  if (on_worker) {
    DrainSends(kDrainLimit);
  } else {
    Drain(kDrainLimit);
  }
  std::deque<Queued> never_run;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    if (on_worker) never_run.swap(queue_);
  }
  cv_.notify_all();
  // Sends the peers have not taken by now never will be: their works fail as the task drops
  // their tensors.
  completer_->Stop(absl::CancelledError(
      "the process group was destroyed before the task let go of the message (its peer may "
      "not have taken it)"));
  // Stopping the task fails its pending recvs, so a collective the worker runs ends now.
  task_->Stop();
  if (worker_.joinable()) {
    if (on_worker) {
      destroyed_->store(true, std::memory_order_release);  // WorkerLoop returns at once
      worker_.detach();
    } else {
      worker_.join();
    }
  }
  for (Queued& q : never_run) {
    q.work->Complete(absl::CancelledError("the process group was destroyed"));
  }
  matcher_->Fail(absl::CancelledError("the process group was destroyed"));
  step_.reset();
  task_.reset();
}

void ProcessGroupTensorVerbs::Drain(std::chrono::milliseconds limit) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    // The collectives queued run first: their messages are the peers' too.
    cv_.wait(lock, [this] { return queue_.empty() && !running_; });
  }
  DrainSends(limit);
}

void ProcessGroupTensorVerbs::DrainSends(std::chrono::milliseconds limit) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!group_error_.ok()) return;  // the peers do not wait for anything more
  }
  absl::Status s = step_->WaitUntilSendsTaken(absl::FromChrono(std::min(limit, timeout_)));
  if (!s.ok()) {
    std::fprintf(stderr, "tensorverbs: rank %d leaves messages no peer took: %s\n", getRank(),
                 s.ToString().c_str());
  }
}

void DrainAllGroups(std::chrono::milliseconds limit) {
  // Strong references taken under the lock, and the draining outside it: a group that shuts
  // down meanwhile (its last reference going on its worker, say) unregisters under the same
  // lock. A group still in the set has not finished unregistering, so its memory is there; one
  // whose last strong reference already went locks to null and is left to its shutdown.
  std::vector<c10::intrusive_ptr<ProcessGroupTensorVerbs>> groups;
  {
    std::lock_guard<std::mutex> lock(Live().mu);
    for (ProcessGroupTensorVerbs* g : Live().groups) {
      auto weak = c10::weak_intrusive_ptr<ProcessGroupTensorVerbs>::reclaim_copy(g);
      if (c10::intrusive_ptr<ProcessGroupTensorVerbs> strong = weak.lock()) {
        groups.push_back(std::move(strong));
      }
    }
  }
  for (const auto& g : groups) g->Drain(limit);
}

std::string ProcessGroupTensorVerbs::P2pName(int src, int dst, int64_t tag, int64_t n) {
  return absl::StrCat("p", src, ">", dst, "/", tag, "/", n);
}

std::string ProcessGroupTensorVerbs::PeerName(int rank) const {
  if (rank < 0 || rank >= static_cast<int>(addresses_.size())) return absl::StrCat("rank ", rank);
  return absl::StrCat("rank ", rank, " (task rank:", rank, " at ", addresses_[rank], ")");
}

std::string ProcessGroupTensorVerbs::What(const char* op, int64_t seq) const {
  return absl::StrCat(op, " #", seq, " on rank ", getRank(), " of ", getSize());
}

std::chrono::milliseconds ProcessGroupTensorVerbs::TimeoutOf(
    std::chrono::milliseconds requested) const {
  return requested.count() > 0 ? requested : timeout_;  // torch's "unset" is -1 ms
}

CounterList ProcessGroupTensorVerbs::stats() const { return counters_->List(); }

c10::intrusive_ptr<c10d::Work> ProcessGroupTensorVerbs::Enqueue(c10d::OpType type, const char* op,
                                                                std::vector<at::Tensor> outputs,
                                                                std::chrono::milliseconds timeout,
                                                                Body body) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t seq = next_seq_++;
  auto work =
      c10::make_intrusive<TvWork>(getRank(), type, nullptr, std::move(outputs), What(op, seq));
  // A wait() on the work runs the queue on the waiting thread (RunQueuedUntil), as long as the
  // group lives.
  work->set_runner(
      [group = c10::weak_intrusive_ptr<ProcessGroupTensorVerbs>(
           c10::intrusive_ptr<ProcessGroupTensorVerbs>::reclaim_copy(this))](TvWork& w) {
        if (c10::intrusive_ptr<ProcessGroupTensorVerbs> g = group.lock()) g->RunQueuedUntil(w);
      });
  queue_.push_back(Queued{work, std::move(body), seq, TimeoutOf(timeout)});
  cv_.notify_all();
  return work;
}

void ProcessGroupTensorVerbs::WorkerLoop() {
  // Outlives the group, which may be destroyed inside a work's Complete on this thread.
  const std::shared_ptr<std::atomic<bool>> destroyed = destroyed_;
  while (true) {
    {
      Queued item;
      absl::Status status;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stopping_ || (!queue_.empty() && !running_); });
        if (queue_.empty()) return;
        if (!TakeNext(&item, &status)) continue;
      }
      Run(item, status);
      // The item's tensors go before the worker says it is idle: the exit drain waits for that,
      // and a tensor whose Python object is gone needs the interpreter to free it, which a
      // thread cannot take once the interpreter is finalizing.
    }
    if (destroyed->load(std::memory_order_acquire)) return;
    Finished();
  }
}

bool ProcessGroupTensorVerbs::TakeNext(Queued* item, absl::Status* status) {
  if (running_ || queue_.empty()) return false;
  *item = std::move(queue_.front());
  queue_.pop_front();
  running_ = true;
  if (stopping_) {
    *status = absl::CancelledError("the process group was destroyed");
  } else if (!group_error_.ok()) {
    *status = absl::Status(group_error_.code(),
                           absl::StrCat("an earlier collective of this group failed, so the "
                                        "ranks no longer agree: ",
                                        group_error_.message()));
  }
  return true;
}

void ProcessGroupTensorVerbs::Finished() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
  }
  cv_.notify_all();
}

void ProcessGroupTensorVerbs::RunQueuedUntil(TvWork& work) {
  // The caller's thread runs the collectives queued before its own, and its own, in order,
  // where the worker has not started them: no hand-off to the worker and back, and the
  // collective's waits drive the task's progress on this thread.
  while (!work.done()) {
    {
      Queued item;
      absl::Status status;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!TakeNext(&item, &status)) return;  // the worker runs it: wait for the work
      }
      counters_->Add<Counter::kTorchCollectivesOnCaller>();
      Run(item, status);
    }
    Finished();
  }
}

void ProcessGroupTensorVerbs::Run(Queued& item, absl::Status status) {
  if (status.ok()) {
    Collective collective(*this, *item.work, item.seq,
                          absl::Now() + absl::FromChrono(item.timeout));
    {
      // Its sends and recvs wake no other thread: this one's waits start them.
      Task::Burst burst(*task_);
      status = item.body(collective);
    }
    // The caller may change its tensors once the work completes: what was lent from them
    // must have been taken by then. A failed operation does not wait (its lent messages hold
    // the memory until the task lets go of them), but for the messages that may still land
    // in its tensors, at most kLandingGrace: toward a live peer that never sends, the task
    // lets go of a destination only when the channel closes.
    if (status.ok()) {
      status = collective.WaitForLent();
    } else if (!collective.WaitForLandings(std::min(item.timeout, kLandingGrace))) {
      status = absl::Status(status.code(), absl::StrCat(status.message(),
                                                        "; a peer may still write into the "
                                                        "output tensors (the task did not "
                                                        "let go of them within ",
                                                        kLandingGrace.count(), " ms)"));
    }
    if (!status.ok() || item.work->done()) {
      FailGroup(status.ok()
                    ? absl::CancelledError(absl::StrCat(item.work->what(), " was abandoned"))
                    : absl::Status(status.code(),
                                   absl::StrCat(item.work->what(), ": ", status.message())));
    }
  }
  counters_->Add<Counter::kTorchCollectives>();
  if (!status.ok()) counters_->Add<Counter::kTorchFailed>();
  item.work->Complete(status);  // runs the future's callbacks, which may destroy the group
}

void ProcessGroupTensorVerbs::FailGroup(const absl::Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!group_error_.ok()) return;
    group_error_ = status;
  }
  try {
    store_->set(absl::StrCat(key_prefix_, "abort"),
                Bytes(absl::StrCat("rank ", getRank(), ": ", status.ToString())));
  } catch (const std::exception&) {
    // The store may be gone with the rank that hosted it; the peers time out instead.
  }
}

absl::Status ProcessGroupTensorVerbs::AbortFromPeers() {
  const std::string key = absl::StrCat(key_prefix_, "abort");
  try {
    if (!store_->check({key})) return absl::OkStatus();
    return absl::AbortedError(absl::StrCat("another rank failed first: ", Text(store_->get(key))));
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("the group's store does not answer (the rank that hosts it may have exited): ",
                     FirstLine(e.what())));
  }
}

}  // namespace tensorverbs::torch_backend
