#include "tools/bench_cluster.h"

#include <signal.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "src/common/checksum.h"
#include "src/common/config.h"
#include "src/common/mutex.h"
#include "src/common/status_macros.h"
#include "src/support/process_util.h"
#include "tensorverbs/device_name.h"
#include "tensorverbs/placement.h"
#include "tools/bench_device.h"
#include "tools/bench_util.h"

namespace tensorverbs::tools {
namespace {

constexpr char kJob[] = "worker";

// The names <prefix>0 .. <prefix><keys-1>.
std::vector<std::string> Names(const std::string& prefix, int keys) {
  std::vector<std::string> names;
  for (int i = 0; i < keys; ++i) names.push_back(absl::StrCat(prefix, i));
  return names;
}

int64_t TotalCopies(const Server& server) { return server.stats().copies.load(); }
int64_t DeviceCopies(const Server& server) {
  return server.stats().device_to_host.load() + server.stats().host_to_device.load();
}
int64_t DeviceDirect(const Server& server) {
  return server.stats().device_direct_sends.load() + server.stats().device_direct_recvs.load();
}

// The peer's command loop.
absl::Status ServeCommands(Server& server, const MemoryPlacement& send_device) {
  const std::string receiver = CpuDeviceName(kJob, 0);
  std::string line;
  while (std::getline(std::cin, line)) {
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (f.empty()) continue;
    if (f[0] == "quit") return absl::OkStatus();
    absl::Status status;
    std::string reply = "ok";
    if (f[0] == "send" && f.size() == 7) {
      int keys = 0;
      uint64_t bytes = 0, seed = 0;
      int64_t first = 0, steps = 0;
      if (!absl::SimpleAtoi(f[2], &keys) || !absl::SimpleAtoi(f[3], &bytes) ||
          !absl::SimpleAtoi(f[4], &first) || !absl::SimpleAtoi(f[5], &steps) ||
          !absl::SimpleAtoi(f[6], &seed) || keys < 1) {
        status = absl::InvalidArgumentError(absl::StrCat("malformed command '", line, "'"));
      } else {
        // One tensor in the registered pool (or on the GPU), shared by every send (tensors
        // are immutable).
        absl::StatusOr<Tensor> t =
            PatternTensor(send_device, server, bytes, static_cast<uint32_t>(seed));
        if (!t.ok()) {
          status = t.status();
        } else {
          std::vector<ParsedKey> k =
              MakeKeys(server.device_name(), server.incarnation(), receiver, Names(f[1], keys));
          for (int64_t s = first; s < first + steps && status.ok(); ++s) {
            absl::StatusOr<std::shared_ptr<RemoteRendezvous>> r = server.rendezvous_mgr()->Find(s);
            if (!r.ok()) {
              status = r.status();
              break;
            }
            for (const ParsedKey& key : k) {
              status = (*r)->Send(key, *t);
              if (!status.ok()) break;
            }
          }
        }
      }
    } else if (f[0] == "cleanup" && f.size() == 3) {
      int64_t first = 0, steps = 0;
      if (!absl::SimpleAtoi(f[1], &first) || !absl::SimpleAtoi(f[2], &steps)) {
        status = absl::InvalidArgumentError(absl::StrCat("malformed command '", line, "'"));
      } else {
        for (int64_t s = first; s < first + steps; ++s) server.rendezvous_mgr()->Cleanup(s);
      }
    } else if (f[0] == "usage") {
      reply = absl::StrFormat("usage %.6f %d %d %d %d", CpuSeconds(), TotalCopies(server),
                              server.stats().copied_bytes.load(), DeviceCopies(server),
                              DeviceDirect(server));
    } else {
      status = absl::InvalidArgumentError(absl::StrCat("unknown command '", line, "'"));
    }
    if (!status.ok()) {
      std::printf("error %s\n", status.ToString().c_str());
    } else {
      std::printf("%s\n", reply.c_str());
    }
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ParseProtocolList(const std::string& list) {
  const std::vector<std::string> available = AvailableProtocols();
  if (list.empty()) {
    // Every protocol, the baseline first.
    return std::vector<std::string>(available.rbegin(), available.rend());
  }
  const std::map<std::string, std::string> aliases = {{"verbs", "grpc+verbs"},
                                                      {"zero-copy", "grpc+verbs"},
                                                      {"copy-verbs", "grpc+verbs-copy"},
                                                      {"gdr", "grpc+gdr"}};
  std::vector<std::string> out;
  for (absl::string_view p : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    std::string name(p);
    if (auto it = aliases.find(name); it != aliases.end()) name = it->second;
    if (std::find(available.begin(), available.end(), name) == available.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown protocol '", p, "'; available: ", absl::StrJoin(available, ", ")));
    }
    out.push_back(name);
  }
  if (out.empty()) return absl::InvalidArgumentError("no protocols given");
  return out;
}

absl::StatusOr<std::unique_ptr<BenchLayout>> BenchLayout::Create(int tasks, bool netns, int hosts) {
  auto layout = std::unique_ptr<BenchLayout>(new BenchLayout());
  std::vector<std::string> host_names(tasks, "127.0.0.1");
  layout->host_of_.resize(tasks);
  for (int i = 0; i < tasks; ++i) layout->host_of_[i] = hosts > 0 ? i * hosts / tasks : i;
  if (netns) {
    ASSIGN_OR_RETURN(layout->netns_, NetnsCluster::Create(hosts > 0 ? hosts : tasks));
    for (int i = 0; i < tasks; ++i) host_names[i] = layout->netns_->address(layout->host_of_[i]);
  }
  ASSIGN_OR_RETURN(std::vector<int> ports, PickFreePorts(tasks));
  for (int i = 0; i < tasks; ++i) {
    layout->addresses_.push_back(absl::StrCat(host_names[i], ":", ports[i]));
  }
  return layout;
}

absl::StatusOr<std::unique_ptr<BenchLayout>> BenchLayout::CreateUnderSrun(
    const std::vector<std::pair<std::string, int>>& jobs) {
  auto layout = std::unique_ptr<BenchLayout>(new BenchLayout());
  ASSIGN_OR_RETURN(layout->srun_, support::FindOnPath("srun"));
  for (const auto& [job, count] : jobs) {
    absl::StrAppend(&layout->srun_jobs_, layout->srun_jobs_.empty() ? "" : ",", job, ":", count);
    for (int i = 0; i < count; ++i) {
      layout->addresses_.push_back(absl::StrCat("slurm rank ", layout->addresses_.size()));
    }
  }
  return layout;
}

std::vector<std::string> BenchLayout::PlacementArgs(const std::string& cluster,
                                                    const std::string& job, int task) const {
  if (!srun_.empty()) return {"--cluster-from", "slurm"};
  return {"--cluster", cluster, "--job", job, "--task", absl::StrCat(task)};
}

absl::StatusOr<std::vector<nlohmann::json>> BenchLayout::RunUnderSrun(
    const std::vector<std::string>& args, absl::Duration timeout, const std::string& what) {
  ASSIGN_OR_RETURN(std::string exe, support::SelfExecutable());
  const int tasks = static_cast<int>(addresses_.size());
  // The step's tasks inherit the environment srun was started with.
  setenv("TENSORVERBS_SLURM_JOBS", srun_jobs_.c_str(), 1);
  std::vector<std::string> srun_args = {absl::StrCat("--ntasks=", tasks), "--kill-on-bad-exit=1",
                                        "--label", "--input=all", exe};
  srun_args.insert(srun_args.end(), args.begin(), args.end());
  ASSIGN_OR_RETURN(std::unique_ptr<support::Subprocess> step,
                   support::Subprocess::Start(srun_, srun_args));
  // A step whose srun is killed outright lives on under slurmstepd, holding its ports and CPUs
  // from the next run: on every way out but a clean end, srun gets SIGTERM (which it passes on
  // to the tasks, and which ends the step) and time to act on it.
  bool ended = false;
  absl::Cleanup end_step = [&] {
    if (ended) return;
    step->Signal(SIGTERM);
    (void)step->Wait(absl::Seconds(15));
  };
  // "R: result {...}" from each rank, in whatever order they finish. srun passes a task's
  // output on in pieces of its own size, each labelled and ended with a newline: a long result
  // comes as several lines of one rank, joined here until they parse.
  constexpr size_t kMaxResult = size_t{4} << 20;
  std::vector<nlohmann::json> results(tasks);
  std::vector<std::string> partial(tasks);
  std::vector<bool> have(tasks, false);
  const absl::Time deadline = absl::Now() + timeout;
  for (int got = 0; got < tasks;) {
    absl::StatusOr<std::string> line = step->ReadLine(deadline - absl::Now());
    if (!line.ok()) {
      return absl::Status(line.status().code(),
                          absl::StrCat(what, " under srun: ", got, " of ", tasks,
                                       " tasks reported: ", line.status().message()));
    }
    std::pair<absl::string_view, absl::string_view> labelled =
        absl::StrSplit(*line, absl::MaxSplits(':', 1));
    int rank = -1;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(labelled.first), &rank) || rank < 0 ||
        rank >= tasks || have[rank]) {
      continue;  // srun's own messages, or a rank that already reported
    }
    absl::string_view piece = labelled.second;
    absl::ConsumePrefix(&piece, " ");  // the label is "R: "
    std::string& text = partial[rank];
    absl::StrAppend(&text, absl::StripTrailingAsciiWhitespace(piece));
    absl::string_view body = text;
    if (absl::ConsumePrefix(&body, "error ")) {
      return absl::InternalError(absl::StrCat(what, " rank ", rank, ": ", body));
    }
    if (!absl::ConsumePrefix(&body, "result ")) {
      text.clear();  // not a result: nothing to join
      continue;
    }
    results[rank] = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
    if (results[rank].is_discarded()) {
      if (text.size() < kMaxResult) continue;  // more of it to come
      return absl::InternalError(
          absl::StrCat(what, " rank ", rank, " reported '", body.substr(0, 200), "...'"));
    }
    have[rank] = true;
    ++got;
  }
  (void)Tell(*step, "exit");  // --input=all: every task reads it
  ended = step->Wait(absl::Seconds(30)).ok();
  return results;
}

absl::StatusOr<std::vector<nlohmann::json>> BenchLayout::Run(
    const std::function<std::vector<std::string>(int)>& args_of, absl::Duration timeout,
    const std::string& what, const Phases& phases) {
  if (!srun_.empty() && !phases.gate.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": no start gate under srun"));
  }
  if (!srun_.empty()) return RunUnderSrun(args_of(0), timeout, what);
  ASSIGN_OR_RETURN(std::string exe, support::SelfExecutable());
  const int tasks = static_cast<int>(addresses_.size());
  std::vector<std::unique_ptr<support::Subprocess>> children;
  for (int i = 0; i < tasks; ++i) {
    std::vector<std::string> args =
        netns_ ? netns_->ExecPrefix(host_of_[i]) : std::vector<std::string>{};
    args.push_back(exe);
    for (std::string& a : args_of(i)) args.push_back(std::move(a));
    const std::string path = args.front();
    args.erase(args.begin());
    ASSIGN_OR_RETURN(std::unique_ptr<support::Subprocess> child,
                     support::Subprocess::Start(path, args));
    children.push_back(std::move(child));
  }
  for (int i = 0; i < tasks && !phases.gate.empty(); ++i) {
    RETURN_IF_ERROR(Expect(*children[i], phases.gate, timeout).status());
  }
  for (int i = 0; i < tasks && !phases.gate.empty(); ++i) RETURN_IF_ERROR(Tell(*children[i], "go"));
  std::vector<nlohmann::json> results(tasks);
  for (int i = 0; i < tasks; ++i) {
    ASSIGN_OR_RETURN(std::string line, Expect(*children[i], "result ", timeout));
    results[i] = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (results[i].is_discarded()) {
      return absl::InternalError(absl::StrCat(what, " task ", i, " reported '", line, "'"));
    }
  }
  absl::Status status;
  for (int i = 0; i < tasks && phases.after && status.ok(); ++i) {
    status = phases.after(i, *children[i], results[i]);
  }
  for (auto& c : children) (void)Tell(*c, "exit");
  for (auto& c : children) (void)c->Wait(absl::Seconds(30));
  if (!status.ok()) return status;
  return results;
}

int RunBenchTaskProcess(const std::function<absl::Status()>& task) {
  absl::Status s = task();
  if (s.ok()) return 0;
  std::printf("error %s\n", s.ToString().c_str());
  std::fflush(stdout);
  return 1;
}

std::vector<std::string> BenchServerOptions::ToArgs() const {
  std::vector<std::string> args = {"--protocol", protocol};
  if (message_slots > 0) args.insert(args.end(), {"--message-slots", absl::StrCat(message_slots)});
  if (message_batch > 0) args.insert(args.end(), {"--message-batch", absl::StrCat(message_batch)});
  if (!poll_mode.empty()) args.insert(args.end(), {"--poll-mode", poll_mode});
  if (callback_threads >= 0) {
    args.insert(args.end(), {"--callback-threads", absl::StrCat(callback_threads)});
  }
  if (send_device != "cpu") args.insert(args.end(), {"--send-device", send_device});
  if (!fabric.empty()) args.insert(args.end(), {"--fabric", fabric});
  if (!rails.empty()) args.insert(args.end(), {"--rails", rails});
  return args;
}

void BenchServerOptions::Apply(ServerOptions* options) const {
  options->protocol = protocol;
  if (message_slots > 0) options->verbs.channel.message_slots = message_slots;
  if (message_batch > 0) options->verbs.channel.message_batch = message_batch;
  if (!poll_mode.empty()) options->verbs.poll_mode = poll_mode;
  if (!fabric.empty()) options->verbs.fabric = fabric;
  if (!rails.empty()) {
    options->verbs.rails = absl::StrSplit(rails, ',', absl::SkipWhitespace());
  }
  if (callback_threads >= 0) options->callback_threads = callback_threads;
  // A benchmark that stalls should fail in minutes, not after the default ten.
  options->transfer.recv_timeout = absl::Minutes(2);
}

int RunBenchPeer(const BenchPeerOptions& o) {
  auto fail = [](const absl::Status& s) {
    std::printf("error %s\n", s.ToString().c_str());
    std::fflush(stdout);
    return 1;
  };
  absl::StatusOr<ClusterSpec> cluster = ClusterSpec::Parse(o.cluster);
  if (!cluster.ok()) return fail(cluster.status());
  absl::StatusOr<MemoryPlacement> send_device = ParseDevice(o.server.send_device, "--send-device");
  if (!send_device.ok()) return fail(send_device.status());
  ServerOptions options = ServerOptions::FromConfig(Config::Get());
  options.cluster = *cluster;
  options.job = o.job;
  options.task = o.task;
  o.server.Apply(&options);
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Create(options);
  if (!server.ok()) return fail(server.status());
  // The benchmarks time pairs in steady state: every channel is set up before they start.
  if (absl::Status s = (*server)->WaitForPeers(absl::Seconds(60)); !s.ok()) return fail(s);
  if (absl::Status s = (*server)->SetUpChannels(absl::Seconds(60)); !s.ok()) return fail(s);
  std::printf("ready %s %016llx\n", (*server)->device_name().c_str(),
              static_cast<unsigned long long>((*server)->incarnation()));
  std::fflush(stdout);
  absl::Status s = ServeCommands(**server, *send_device);
  (*server)->Stop();
  return s.ok() ? 0 : fail(s);
}

absl::StatusOr<std::unique_ptr<PairBench>> PairBench::Start(const BenchServerOptions& options,
                                                            const NetnsHost* netns) {
  if (netns == nullptr) return StartTasks(options, {"127.0.0.1", "127.0.0.1"}, {{}, {}});
  // A railed host: each end's further lanes on its own addresses of rails 1.. (its first is
  // the task's address, on rail 0).
  std::vector<std::string> rails(2);
  for (int rail = 1; rail < netns->rails(); ++rail) {
    absl::StrAppend(&rails[0], rails[0].empty() ? "" : ",", netns->local_address(rail));
    absl::StrAppend(&rails[1], rails[1].empty() ? "" : ",", netns->remote_address(rail));
  }
  return StartTasks(options, {netns->local_address(), netns->remote_address()},
                    {{}, netns->ExecPrefix()}, rails);
}

absl::StatusOr<std::unique_ptr<PairBench>> PairBench::StartMixed(const BenchServerOptions& options,
                                                                 const NetnsHost& netns) {
  return StartTasks(options, {netns.local_address(), netns.local_address(), netns.remote_address()},
                    {{}, {}, netns.ExecPrefix()});
}

absl::StatusOr<std::unique_ptr<PairBench>> PairBench::StartTasks(
    const BenchServerOptions& options, const std::vector<std::string>& hosts,
    const std::vector<std::vector<std::string>>& prefixes, const std::vector<std::string>& rails) {
  auto with_rails = [&](size_t task) {
    BenchServerOptions o = options;
    if (task < rails.size() && !rails[task].empty()) o.rails = rails[task];
    return o;
  };
  auto bench = std::unique_ptr<PairBench>(new PairBench);
  ASSIGN_OR_RETURN(std::vector<int> ports, PickFreePorts(static_cast<int>(hosts.size())));
  std::vector<std::string> addresses;
  for (size_t i = 0; i < hosts.size(); ++i)
    addresses.push_back(absl::StrCat(hosts[i], ":", ports[i]));
  const std::string cluster = absl::StrCat(kJob, "=", absl::StrJoin(addresses, ","));
  ASSIGN_OR_RETURN(std::string exe, support::SelfExecutable());
  for (size_t i = 1; i < hosts.size(); ++i) {
    std::vector<std::string> args = prefixes[i];
    args.insert(args.end(), {exe, "bench-peer", "--cluster", cluster, "--job", kJob, "--task",
                             absl::StrCat(i)});
    for (const std::string& a : with_rails(i).ToArgs()) args.push_back(a);
    const std::string path = args.front();
    args.erase(args.begin());
    Peer peer;
    ASSIGN_OR_RETURN(peer.process, support::Subprocess::Start(path, args));
    bench->peers_.push_back(std::move(peer));
  }

  ServerOptions server_options = ServerOptions::FromConfig(Config::Get());
  ASSIGN_OR_RETURN(server_options.cluster, ClusterSpec::Parse(cluster));
  server_options.job = kJob;
  server_options.task = 0;
  with_rails(0).Apply(&server_options);
  ASSIGN_OR_RETURN(bench->server_, Server::Create(server_options));
  RETURN_IF_ERROR(bench->server_->WaitForPeers(absl::Seconds(60)));
  RETURN_IF_ERROR(bench->server_->SetUpChannels(absl::Seconds(60)));
  for (Peer& peer : bench->peers_) {
    ASSIGN_OR_RETURN(std::string ready, Expect(*peer.process, "ready ", absl::Seconds(90)));
    std::vector<std::string> f = absl::StrSplit(ready, ' ');
    if (f.size() != 2 || !absl::SimpleHexAtoi(f[1], &peer.incarnation)) {
      return absl::InternalError(absl::StrCat("bench peer announced '", ready, "'"));
    }
    peer.device = f[0];
  }
  return bench;
}

PairBench::~PairBench() {
  for (Peer& peer : peers_) {
    // Best effort: the Subprocess destructor kills it otherwise.
    if (peer.process) (void)Tell(*peer.process, "quit");
  }
  for (Peer& peer : peers_) {
    if (peer.process) (void)peer.process->Wait(absl::Seconds(20));
  }
  if (server_) server_->Stop();
}

std::string PairBench::fabric() const {
  auto* t = server_->verbs_transport();
  if (t == nullptr) return "tcp (gRPC)";
  // The receiving channel from the sender: with a fabric per peer, the task's name for its
  // fabrics lists both.
  const std::string& device = peers_[sender_].device;
  const std::string task = device.substr(0, device.find("/device:"));
  for (const protocol::ChannelSnapshot& c : t->ChannelSnapshots(absl::Seconds(10))) {
    if (c.receives && c.peer_task == task && c.state == "ready") return c.fabric;
  }
  return t->fabric_name();
}

std::vector<ParsedKey> PairBench::Keys(const std::string& prefix, int keys) const {
  const Peer& peer = peers_[sender_];
  return MakeKeys(peer.device, peer.incarnation, server_->device_name(), Names(prefix, keys));
}

absl::Status PairBench::PeerSend(const std::string& prefix, int keys, size_t bytes,
                                 int64_t first_step, int64_t steps, uint32_t seed) {
  support::Subprocess& peer = *peers_[sender_].process;
  RETURN_IF_ERROR(Tell(peer, absl::StrCat("send ", prefix, " ", keys, " ", bytes, " ", first_step,
                                          " ", steps, " ", seed)));
  return Expect(peer, "ok").status();
}

absl::Status PairBench::Cleanup(int64_t first_step, int64_t steps) {
  for (Peer& peer : peers_) {
    RETURN_IF_ERROR(Tell(*peer.process, absl::StrCat("cleanup ", first_step, " ", steps)));
  }
  for (int64_t s = first_step; s < first_step + steps; ++s) server_->rendezvous_mgr()->Cleanup(s);
  for (Peer& peer : peers_) RETURN_IF_ERROR(Expect(*peer.process, "ok").status());
  return absl::OkStatus();
}

absl::StatusOr<PairBench::Usage> PairBench::PeerUsage() {
  support::Subprocess& peer = *peers_[sender_].process;
  RETURN_IF_ERROR(Tell(peer, "usage"));
  ASSIGN_OR_RETURN(std::string rest, Expect(peer, "usage "));
  std::vector<std::string> f = absl::StrSplit(rest, ' ');
  Usage u;
  if (f.size() != 5 || !absl::SimpleAtod(f[0], &u.cpu_seconds) ||
      !absl::SimpleAtoi(f[1], &u.copies) || !absl::SimpleAtoi(f[2], &u.copied_bytes) ||
      !absl::SimpleAtoi(f[3], &u.device_copies) || !absl::SimpleAtoi(f[4], &u.device_direct)) {
    return absl::InternalError(absl::StrCat("bench peer reported usage '", rest, "'"));
  }
  return u;
}

PairBench::Usage PairBench::LocalUsage() const {
  Usage u;
  u.cpu_seconds = CpuSeconds();
  u.copies = TotalCopies(*server_);
  u.copied_bytes = server_->stats().copied_bytes.load();
  u.device_copies = DeviceCopies(*server_);
  u.device_direct = DeviceDirect(*server_);
  return u;
}

absl::StatusOr<RecvRunResult> RunRecvs(Server& server, const std::vector<ParsedKey>& keys,
                                       int64_t first_step, int64_t count, int window, size_t bytes,
                                       uint32_t seed, absl::Duration timeout,
                                       Allocator* allocator) {
  if (keys.empty() || count < 1 || window < 1) {
    return absl::InvalidArgumentError("RunRecvs: no keys, recvs or window");
  }
  // Completions are counted with atomics and only the last one wakes the waiting thread: a
  // mutex whose waiters are woken on every unlock would put a futex wake-up on each recv.
  struct State {
    Server* server;
    RecvArgs args;
    std::vector<ParsedKey> keys;
    int64_t first_step, count;
    size_t bytes;
    uint32_t crc;
    std::vector<int64_t> start_ns;
    std::vector<double> latency_us;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> started{0};
    std::atomic<int64_t> finished{0};
    std::atomic<bool> failed{false};
    std::atomic<int64_t> end_ns{0};
    Tensor checked[2];  // recv 0 and the last one, each written by its own callback
    Notification all_done;
    Mutex mu;
    absl::Status status ABSL_GUARDED_BY(mu);
  };
  auto state = std::make_shared<State>();
  state->server = &server;
  state->args.allocator = allocator;
  state->keys = keys;
  state->first_step = first_step;
  state->count = count;
  state->bytes = bytes;
  state->crc = BenchPatternCrc(bytes, seed);
  state->start_ns.assign(count, 0);
  state->latency_us.assign(count, 0);

  // Starts recv `i`; its callback starts the next one, so `window` recvs stay outstanding.
  struct Starter {
    static void Start(const std::shared_ptr<State>& st, int64_t i) {
      if (st->failed.load(std::memory_order_relaxed)) return;
      st->started.fetch_add(1);
      const size_t nkeys = st->keys.size();
      const ParsedKey& key = st->keys[i % nkeys];
      absl::StatusOr<std::shared_ptr<RemoteRendezvous>> r =
          st->server->rendezvous_mgr()->Find(st->first_step + i / static_cast<int64_t>(nkeys));
      if (!r.ok()) {
        Finish(st, r.status());
        return;
      }
      st->start_ns[i] = absl::GetCurrentTimeNanos();
      (*r)->RecvAsync(key, st->args, [st, i](const absl::Status& s, const Tensor& t, bool) {
        st->latency_us[i] = (absl::GetCurrentTimeNanos() - st->start_ns[i]) / 1e3;
        absl::Status result = s;
        if (result.ok() && t.TotalBytes() != st->bytes) {
          result = absl::DataLossError(
              absl::StrCat("recv ", i, " got ", t.TotalBytes(), " bytes, not ", st->bytes));
        } else if (result.ok() && (i == 0 || i == st->count - 1)) {
          // Checked once the run is over: a checksum of 64 MiB takes milliseconds of a core
          // that the transfers still in flight would otherwise share.
          st->checked[i == 0 ? 0 : 1] = t;
        }
        if (result.ok()) {
          const int64_t n = st->next.fetch_add(1);
          if (n < st->count) Start(st, n);
        }
        Finish(st, result);
      });
    }
    static void Finish(const std::shared_ptr<State>& st, const absl::Status& s) {
      if (!s.ok()) {
        MutexLock lock(&st->mu);
        if (st->status.ok()) st->status = s;
        st->failed.store(true);
      }
      const int64_t finished = st->finished.fetch_add(1) + 1;
      if (finished == st->count || (st->failed.load() && finished == st->started.load())) {
        st->end_ns.store(absl::GetCurrentTimeNanos());
        st->all_done.Notify();
      }
    }
  };
  const absl::Time t0 = absl::Now();
  const int64_t initial = std::min<int64_t>(window, count);
  state->next.store(initial);
  for (int64_t i = 0; i < initial; ++i) Starter::Start(state, i);
  if (!state->all_done.WaitForNotificationWithTimeout(timeout)) {
    return absl::DeadlineExceededError(
        absl::StrCat("recvs did not finish within ", absl::FormatDuration(timeout), " (",
                     state->finished.load(), " of ", state->count, " done)"));
  }
  {
    MutexLock lock(&state->mu);
    if (!state->status.ok()) return state->status;
  }
  for (int c = 0; c < 2; ++c) {
    const Tensor& t = state->checked[c];
    if (t.TotalBytes() != bytes) continue;
    ASSIGN_OR_RETURN(const uint32_t crc, TensorCrc(t));
    if (crc != state->crc) {
      return absl::DataLossError(absl::StrCat("recv ", c == 0 ? int64_t{0} : count - 1,
                                              ": the bytes differ from what the peer sent"));
    }
  }
  RecvRunResult result;
  result.elapsed = absl::FromUnixNanos(state->end_ns.load()) - t0;
  result.latency_us = std::move(state->latency_us);
  return result;
}

}  // namespace tensorverbs::tools
