// `tensorverbs demo`: parameter-server data-parallel training of a small model between real
// processes on this host, over the chosen protocol.
//
// The launcher picks free ports, starts one ps task and K worker tasks as child processes of
// this binary (`demo-task`), relays their output and fails fast when one of them fails. Each
// step, every worker receives the weights from the ps, computes gradients on its own synthetic
// batch and sends them back; the ps averages and applies them and prints `step N loss X`.
// Step ids are step_base + N on every task, so all tasks agree on them without a master.
#include <signal.h>
#include <sys/types.h>

#include <cstdio>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "src/common/config.h"
#include "src/device/cuda_runtime.h"
#include "src/fabric/fabric.h"
#include "src/server/server.h"
#include "src/support/process_util.h"
#include "tensorverbs/device_name.h"
#include "tensorverbs/placement.h"
#include "tools/bench_device.h"
#include "tools/commands.h"
#include "tools/demo_model.h"
#include "tools/placement_flags.h"

namespace tensorverbs::tools {
namespace {

constexpr char kPsJob[] = "ps";
constexpr char kWorkerJob[] = "worker";

struct Peer {
  std::string device;
  uint64_t incarnation = 0;
};

void Fail(const std::string& task, const absl::Status& s) {
  std::fprintf(stderr, "tensorverbs demo: task %s failed: %s\n", task.c_str(),
               s.ToString().c_str());
}

std::vector<ParsedKey> Keys(const Peer& src, const Peer& dst,
                            const std::vector<std::string>& names) {
  std::vector<ParsedKey> keys;
  for (const std::string& n : names) {
    keys.push_back(
        *ParsedKey::Parse(ParsedKey::Create(src.device, src.incarnation, dst.device, n)));
  }
  return keys;
}

std::vector<std::string> Prefixed(absl::string_view prefix, const std::vector<std::string>& names) {
  std::vector<std::string> out;
  for (const std::string& n : names) out.push_back(absl::StrCat(prefix, n));
  return out;
}

// With --device cuda the model's tensors live on the GPU: each task keeps them in its pool of
// that GPU's memory, so weights and gradients travel GPU to GPU (directly, by CUDA IPC, over
// grpc+verbs on one host), and the math runs on host copies of them (the project has no GPU
// kernels). Without a GPU placement every call is the identity.
class ModelMemory {
 public:
  static absl::StatusOr<ModelMemory> For(Server& server, const std::string& device) {
    ModelMemory m;
    absl::StatusOr<DevicePair> where = ParseDevicePair(device);
    if (!where.ok()) return where.status();
    m.where_ = where->src;
    if (m.where_.host_accessible()) return m;
    absl::StatusOr<device::CudaRuntime*> rt = device::CudaRuntime::Get();
    if (!rt.ok()) return rt.status();
    m.runtime_ = *rt;
    absl::StatusOr<PoolAllocator*> pool = server.DeviceAllocator(m.where_.device);
    if (!pool.ok()) return pool.status();
    m.allocator_ = *pool;
    return m;
  }

  bool on_gpu() const { return allocator_ != nullptr; }
  RecvArgs args() const {
    RecvArgs a;
    a.allocator = allocator_;
    return a;
  }
  // `host`'s bytes in a new tensor of the model's memory.
  absl::StatusOr<Tensor> Place(const Tensor& host) const {
    if (!on_gpu()) return host;
    absl::StatusOr<Tensor> t = Tensor::Allocate(allocator_, host.dtype(), host.shape());
    if (!t.ok()) return t.status();
    absl::Status s = Copy(host, &*t, device::CopyKind::kHostToDevice);
    if (!s.ok()) return s;
    return t;
  }
  // Copies `host` over the model-memory tensor `*t` (same shape).
  absl::Status Update(const Tensor& host, Tensor* t) const {
    return on_gpu() ? Copy(host, t, device::CopyKind::kHostToDevice) : absl::OkStatus();
  }
  // A host tensor with `t`'s bytes.
  absl::StatusOr<Tensor> ToHost(const Tensor& t) const {
    if (!on_gpu() || t.placement().host_accessible()) return t;
    Tensor host = Tensor::Make(t.dtype(), t.shape());
    absl::Status s = Copy(t, &host, device::CopyKind::kDeviceToHost);
    if (!s.ok()) return s;
    return host;
  }

 private:
  absl::Status Copy(const Tensor& from, Tensor* to, device::CopyKind kind) const {
    if (from.TotalBytes() == 0) return absl::OkStatus();
    return runtime_->Memcpy(where_.device, to->data(), from.data(), from.TotalBytes(), kind,
                            "demo model");
  }

  MemoryPlacement where_;
  device::CudaRuntime* runtime_ = nullptr;
  Allocator* allocator_ = nullptr;
};

// Host copies of `tensors`, or the first error.
absl::StatusOr<std::vector<Tensor>> AllToHost(const ModelMemory& memory,
                                              const std::vector<Tensor>& tensors) {
  std::vector<Tensor> out;
  for (const Tensor& t : tensors) {
    absl::StatusOr<Tensor> h = memory.ToHost(t);
    if (!h.ok()) return h.status();
    out.push_back(*std::move(h));
  }
  return out;
}

// This task's recvs into GPU memory that the fabric wrote directly, and those that landed in
// host memory and were copied over (the proxy path). Counted where the recv completes: a
// sender counts its side only when the peer asks, which may be after its stats are taken.
int64_t DirectDeviceRecvs(const Server& server) {
  return server.stats().device_direct_recvs.load();
}
int64_t ProxiedDeviceRecvs(const Server& server) { return server.stats().host_to_device.load(); }

// Waits until every value sent at `step_id` has been taken by its receiver, so that shutting
// down does not strand a peer.
void WaitUntilDrained(Server& server, int64_t step_id, absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    absl::StatusOr<std::shared_ptr<RemoteRendezvous>> r = server.rendezvous_mgr()->Find(step_id);
    if (!r.ok() || (*r)->NumPendingSends() == 0) return;
    absl::SleepFor(absl::Milliseconds(5));
  }
}

int RunPs(Server& server, const DemoTaskOptions& o, int num_workers, const Peer& self,
          const std::vector<Peer>& workers, const ModelMemory& memory) {
  demo::ModelShape shape;
  std::vector<Tensor> params = demo::InitParameters(shape, /*seed=*/42);
  // In the server's registered pool, so that grpc+verbs sends them without a copy.
  for (Tensor& p : params) {
    absl::StatusOr<Tensor> pooled = p.Clone(server.recv_allocator());
    if (pooled.ok()) p = *std::move(pooled);
  }
  // What the workers get: the weights themselves, or their copy in the GPU's pool.
  std::vector<Tensor> sent;
  for (const Tensor& p : params) {
    absl::StatusOr<Tensor> placed = memory.Place(p);
    if (!placed.ok()) return Fail(server.task_name(), placed.status()), 1;
    sent.push_back(*std::move(placed));
  }
  const std::vector<std::string>& names = demo::ParameterNames();
  const std::vector<std::string> grad_names = Prefixed("grad/", names);
  float first_loss = 0, last_loss = 0;
  absl::Time start = absl::Now();
  absl::Duration recv_busy;
  for (int step = 0; step < o.steps; ++step) {
    const int64_t step_id = o.step_base + step;
    absl::StatusOr<std::shared_ptr<RemoteRendezvous>> r = server.rendezvous_mgr()->Find(step_id);
    if (!r.ok()) return Fail(server.task_name(), r.status()), 1;
    // The weights are sent without a copy: every worker has received them (it needs them for
    // its gradients) before the ps updates them in place below.
    for (const Peer& w : workers) {
      std::vector<ParsedKey> keys = Keys(self, w, Prefixed("param/", names));
      for (size_t p = 0; p < keys.size(); ++p) {
        absl::Status s = (*r)->Send(keys[p], sent[p]);
        if (!s.ok()) return Fail(server.task_name(), s), 1;
      }
    }
    std::vector<std::vector<Tensor>> grads;
    double loss_sum = 0;
    absl::Time recv_start = absl::Now();
    for (const Peer& w : workers) {
      absl::StatusOr<std::vector<Tensor>> got =
          RecvAll(**r, Keys(w, self, grad_names), memory.args());
      if (got.ok()) got = AllToHost(memory, *got);
      absl::StatusOr<std::vector<Tensor>> loss = RecvAll(**r, Keys(w, self, {"loss"}));
      for (const absl::Status& s : {got.status(), loss.status()}) {
        if (!s.ok()) return Fail(server.task_name(), s), 1;
      }
      loss_sum += (*loss)[0].flat<float>()[0];
      grads.push_back(*std::move(got));
    }
    recv_busy += absl::Now() - recv_start;
    demo::ApplyMeanGradients(grads, o.learning_rate, &params);
    for (size_t p = 0; p < params.size() && memory.on_gpu(); ++p) {
      absl::Status s = memory.Update(params[p], &sent[p]);
      if (!s.ok()) return Fail(server.task_name(), s), 1;
    }
    const float loss = static_cast<float>(loss_sum / num_workers);
    if (step == 0) first_loss = loss;
    last_loss = loss;
    std::printf("step %d loss %.4f\n", step + 1, loss);
    std::fflush(stdout);
    server.rendezvous_mgr()->Cleanup(step_id);
  }
  const absl::Duration train_time = absl::Now() - start;

  // Closing step: collect the workers' transfer statistics, then release them.
  const int64_t final_step = o.step_base + o.steps;
  absl::StatusOr<std::shared_ptr<RemoteRendezvous>> r = server.rendezvous_mgr()->Find(final_step);
  if (!r.ok()) return Fail(server.task_name(), r.status()), 1;
  int64_t tensors = server.stats().tensors.load();
  int64_t bytes = server.stats().bytes.load();
  int64_t direct = DirectDeviceRecvs(server), proxied = ProxiedDeviceRecvs(server);
  double worker_share_sum = 0;
  for (const Peer& w : workers) {
    absl::StatusOr<std::vector<Tensor>> got = RecvAll(**r, Keys(w, self, {"stats"}));
    if (!got.ok()) return Fail(server.task_name(), got.status()), 1;
    const int64_t* v = (*got)[0].flat<int64_t>();
    tensors += v[0];
    bytes += v[1];
    worker_share_sum += v[3] > 0 ? static_cast<double>(v[2]) / static_cast<double>(v[3]) : 0.0;
    direct += v[4];
    proxied += v[5];
  }
  for (const Peer& w : workers) {
    Tensor done = Tensor::Make(DataType::kInt32, TensorShape());
    done.flat<int32_t>()[0] = 1;
    absl::Status s = (*r)->Send(Keys(self, w, {"shutdown"})[0], done);
    if (!s.ok()) return Fail(server.task_name(), s), 1;
  }
  WaitUntilDrained(server, final_step, absl::Seconds(30));

  const double secs = absl::ToDoubleSeconds(train_time);
  std::printf(
      "summary: protocol %s, 1 ps + %d workers, %d steps in %.2f s (%.1f ms/step)\n"
      "  transfers: %lld tensors, %.2f MiB, %.0f tensors/s, %.1f MB/s\n"
      "  share of step time in transfer: workers %.1f%% (waiting for weights), ps %.1f%% "
      "(waiting for gradients)\n"
      "  loss: %.4f -> %.4f\n",
      server.protocol().c_str(), num_workers, o.steps, secs, 1000 * secs / o.steps,
      static_cast<long long>(tensors), bytes / 1048576.0, tensors / secs, bytes / secs / 1e6,
      100.0 * worker_share_sum / num_workers, 100.0 * absl::ToDoubleSeconds(recv_busy) / secs,
      first_loss, last_loss);
  if (memory.on_gpu()) {
    std::printf(
        "  weights and gradients on %s: %lld received into GPU memory directly, %lld through "
        "host memory\n",
        o.device.c_str(), static_cast<long long>(direct), static_cast<long long>(proxied));
  }
  std::fflush(stdout);
  if (!(last_loss < first_loss)) {
    std::fprintf(stderr, "tensorverbs demo: the loss did not fall (%.4f -> %.4f)\n", first_loss,
                 last_loss);
    return 1;
  }
  return 0;
}

int RunWorker(Server& server, const DemoTaskOptions& o, const Peer& self, const Peer& ps,
              const ModelMemory& memory) {
  demo::ModelShape shape;
  const std::vector<std::string>& names = demo::ParameterNames();
  std::vector<std::string> grad_names = Prefixed("grad/", names);
  absl::Duration recv_busy, step_busy;
  for (int step = 0; step < o.steps; ++step) {
    const int64_t step_id = o.step_base + step;
    absl::Time step_start = absl::Now();
    absl::StatusOr<std::shared_ptr<RemoteRendezvous>> r = server.rendezvous_mgr()->Find(step_id);
    if (!r.ok()) return Fail(server.task_name(), r.status()), 1;
    absl::StatusOr<std::vector<Tensor>> params =
        RecvAll(**r, Keys(ps, self, Prefixed("param/", names)), memory.args());
    if (!params.ok()) return Fail(server.task_name(), params.status()), 1;
    recv_busy += absl::Now() - step_start;
    absl::StatusOr<std::vector<Tensor>> host_params = AllToHost(memory, *params);
    if (!host_params.ok()) return Fail(server.task_name(), host_params.status()), 1;
    demo::Batch batch = demo::MakeBatch(shape, server.env().task, step);
    std::vector<Tensor> host_grads;
    float loss = demo::LossAndGradients(shape, *host_params, batch, &host_grads);
    std::vector<Tensor> grads;
    for (const Tensor& g : host_grads) {
      absl::StatusOr<Tensor> placed = memory.Place(g);
      if (!placed.ok()) return Fail(server.task_name(), placed.status()), 1;
      grads.push_back(*std::move(placed));
    }
    Tensor loss_t = Tensor::Make(DataType::kFloat32, TensorShape());
    loss_t.flat<float>()[0] = loss;
    grads.push_back(loss_t);
    std::vector<std::string> send_names = grad_names;
    send_names.push_back("loss");
    std::vector<ParsedKey> keys = Keys(self, ps, send_names);
    for (size_t i = 0; i < keys.size(); ++i) {
      absl::Status s = (*r)->Send(keys[i], grads[i]);
      if (!s.ok()) return Fail(server.task_name(), s), 1;
    }
    // The ps sent this step's weights only after it had the previous step's gradients.
    if (step > 0) server.rendezvous_mgr()->Cleanup(step_id - 1);
    step_busy += absl::Now() - step_start;
  }
  const int64_t final_step = o.step_base + o.steps;
  absl::StatusOr<std::shared_ptr<RemoteRendezvous>> r = server.rendezvous_mgr()->Find(final_step);
  if (!r.ok()) return Fail(server.task_name(), r.status()), 1;
  Tensor stats = Tensor::Make(DataType::kInt64, TensorShape::Of({6}));
  stats.flat<int64_t>()[0] = server.stats().tensors.load();
  stats.flat<int64_t>()[1] = server.stats().bytes.load();
  stats.flat<int64_t>()[2] = absl::ToInt64Microseconds(recv_busy);
  stats.flat<int64_t>()[3] = absl::ToInt64Microseconds(step_busy);
  stats.flat<int64_t>()[4] = DirectDeviceRecvs(server);
  stats.flat<int64_t>()[5] = ProxiedDeviceRecvs(server);
  absl::Status s = (*r)->Send(Keys(self, ps, {"stats"})[0], stats);
  if (!s.ok()) return Fail(server.task_name(), s), 1;
  // The ps sends this once it has everything from every worker.
  absl::StatusOr<std::vector<Tensor>> done = RecvAll(**r, Keys(ps, self, {"shutdown"}));
  if (!done.ok()) return Fail(server.task_name(), done.status()), 1;
  return 0;
}

}  // namespace

int RunDemoTask(const DemoTaskOptions& given) {
  DemoTaskOptions o = given;
  absl::StatusOr<TaskPlacement> placement =
      PlacementFromFlags(o.cluster_from, o.cluster, o.job, o.task);
  if (!placement.ok()) {
    std::fprintf(stderr, "tensorverbs demo-task: %s\n",
                 std::string(placement.status().message()).c_str());
    return 2;
  }
  const ClusterSpec* cluster = &placement->cluster;
  o.job = placement->job;
  o.task = placement->task;
  if (cluster->NumTasks(kPsJob) != 1 || cluster->NumTasks(kWorkerJob) < 1) {
    std::fprintf(stderr,
                 "tensorverbs demo-task: the demo needs one %s task and at least one %s task; "
                 "the cluster is %s\n",
                 kPsJob, kWorkerJob, cluster->ToString().c_str());
    return 2;
  }
  ServerOptions so = ServerOptions::FromConfig(Config::Get());
  so.cluster = *cluster;
  so.job = o.job;
  so.task = o.task;
  so.protocol = o.protocol;
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Create(so);
  if (!server.ok()) return Fail(TaskName(o.job, o.task), server.status()), 1;
  Server& srv = **server;
  absl::Status up = srv.WaitForPeers(Config::Get().connect_timeout);
  if (!up.ok()) return Fail(srv.task_name(), up), 1;
  const int num_workers = cluster->NumTasks(kWorkerJob);
  auto peer = [&](absl::string_view job, int task) {
    Peer p;
    p.device = CpuDeviceName(job, task);
    p.incarnation = *srv.PeerIncarnation(TaskName(job, task), absl::Seconds(1));
    return p;
  };
  Peer self{srv.device_name(), srv.incarnation()};
  absl::StatusOr<ModelMemory> memory = ModelMemory::For(srv, o.device);
  if (!memory.ok()) return Fail(srv.task_name(), memory.status()), 1;
  int rc;
  if (o.job == kPsJob) {
    std::vector<Peer> workers;
    for (int w = 0; w < num_workers; ++w) workers.push_back(peer(kWorkerJob, w));
    rc = RunPs(srv, o, num_workers, self, workers, *memory);
  } else {
    rc = RunWorker(srv, o, self, peer(kPsJob, 0), *memory);
  }
  srv.Stop();
  return rc;
}

int RunDemoCommand(const DemoOptions& options) {
  if (absl::Status s = Config::EnvironmentStatus(); !s.ok()) {
    std::fprintf(stderr, "tensorverbs demo: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  std::vector<std::string> protocols = AvailableProtocols();
  std::string protocol = options.protocol;
  if (protocol.empty()) {
    // grpc+verbs when this host has a fabric it can open (every demo task runs here), else grpc.
    absl::StatusOr<std::unique_ptr<fabric::Domain>> fabric = fabric::OpenFabric(
        fabric::FabricChoice::FromConfig(Config::Get(), /*all_peers_local=*/true));
    protocol = fabric.ok() ? "grpc+verbs" : "grpc";
    if (!fabric.ok()) {
      std::printf("tensorverbs demo: no RDMA fabric usable (%s); using grpc\n",
                  std::string(fabric.status().message()).c_str());
    }
  }
  if (std::find(protocols.begin(), protocols.end(), protocol) == protocols.end()) {
    std::fprintf(stderr, "tensorverbs demo: unknown protocol '%s'; available: %s\n",
                 protocol.c_str(), absl::StrJoin(protocols, ", ").c_str());
    return 2;
  }
  if (options.workers < 1 || options.workers > 64 || options.steps < 1) {
    std::fprintf(stderr, "tensorverbs demo: --workers must be 1..64 and --steps at least 1\n");
    return 2;
  }
  absl::StatusOr<DevicePair> device = ParseDevicePair(options.device);
  if (!device.ok() || !(device->src == device->dst)) {
    std::fprintf(stderr, "tensorverbs demo: --device '%s': expected cpu, cuda or cuda:N\n",
                 options.device.c_str());
    return 2;
  }
  if (absl::Status s = CheckDevice(device->src); !s.ok()) {
    std::fprintf(stderr, "tensorverbs demo: --device %s: %s\n", options.device.c_str(),
                 std::string(s.message()).c_str());
    return 1;
  }
  std::random_device rd;
  const int64_t step_base = (static_cast<int64_t>(rd() & 0x7fffff) << 24) + 1;
  // What every task runs, after how it is placed.
  const std::vector<std::string> task_args = {
      "--protocol",      protocol,
      "--steps",         absl::StrCat(options.steps),
      "--step-base",     absl::StrCat(step_base),
      "--learning-rate", absl::StrCat(options.learning_rate),
      "--device",        options.device};
  const std::string on_device =
      device->src.host_accessible()
          ? ""
          : absl::StrCat(", weights and gradients on ", device->src.ToString());

  std::vector<pid_t> children;
  std::vector<std::string> child_names;
  bool ok = true;
  if (options.launcher == "srun") {
    // One job step: Slurm places the tasks, and each reads its place from SLURM_*; rank 0 is
    // the ps and the rest are workers.
    absl::StatusOr<std::string> self = support::SelfExecutable();
    if (!self.ok()) {
      std::fprintf(stderr, "tensorverbs demo: %s\n", self.status().ToString().c_str());
      return 1;
    }
    setenv("TENSORVERBS_SLURM_JOBS",
           absl::StrCat(kPsJob, ":1,", kWorkerJob, ":", options.workers).c_str(), 1);
    std::printf(
        "tensorverbs demo: training a %d-%d-%d perceptron with 1 ps + %d workers over %s, "
        "launched by srun%s\n",
        demo::ModelShape().inputs, demo::ModelShape().hidden, demo::ModelShape().classes,
        options.workers, protocol.c_str(), on_device.c_str());
    std::fflush(stdout);
    support::BlockTerminationSignals();
    std::vector<std::string> args = {absl::StrCat("--ntasks=", options.workers + 1),
                                     "--kill-on-bad-exit=1",
                                     *self,
                                     "demo-task",
                                     "--cluster-from",
                                     "slurm"};
    args.insert(args.end(), task_args.begin(), task_args.end());
    absl::StatusOr<pid_t> pid = support::SpawnProgram("srun", args);
    if (!pid.ok()) {
      std::fprintf(stderr, "tensorverbs demo: --launcher srun: %s; is Slurm installed here?\n",
                   std::string(pid.status().message()).c_str());
      return 1;
    }
    children.push_back(*pid);
    child_names.push_back("srun (the job step)");
  } else {
    absl::StatusOr<std::vector<int>> ports = PickFreePorts(options.workers + 1);
    if (!ports.ok()) {
      std::fprintf(stderr, "tensorverbs demo: %s\n", ports.status().ToString().c_str());
      return 1;
    }
    std::vector<std::string> worker_addrs;
    for (int w = 0; w < options.workers; ++w)
      worker_addrs.push_back(absl::StrCat("127.0.0.1:", (*ports)[w + 1]));
    const std::string cluster =
        absl::StrCat("ps=127.0.0.1:", (*ports)[0], ";worker=", absl::StrJoin(worker_addrs, ","));
    std::printf(
        "tensorverbs demo: training a %d-%d-%d perceptron with 1 ps + %d workers over %s "
        "(cluster %s)%s\n",
        demo::ModelShape().inputs, demo::ModelShape().hidden, demo::ModelShape().classes,
        options.workers, protocol.c_str(), cluster.c_str(), on_device.c_str());
    std::fflush(stdout);
    support::BlockTerminationSignals();
    auto spawn = [&](const std::string& job, int task) -> bool {
      std::vector<std::string> args = {"demo-task", "--cluster", cluster,           "--job",
                                       job,         "--task",    absl::StrCat(task)};
      args.insert(args.end(), task_args.begin(), task_args.end());
      absl::StatusOr<pid_t> pid = support::SpawnSelf(args);
      if (!pid.ok()) {
        std::fprintf(stderr, "tensorverbs demo: %s\n", pid.status().ToString().c_str());
        return false;
      }
      children.push_back(*pid);
      child_names.push_back(TaskName(job, task));
      return true;
    };
    ok = spawn(kPsJob, 0);
    for (int w = 0; ok && w < options.workers; ++w) ok = spawn(kWorkerJob, w);
  }

  int rc = ok ? 0 : 1;
  const absl::Time deadline = absl::Now() + absl::Seconds(120) + absl::Seconds(2) * options.steps;
  while (ok && !children.empty()) {
    if (int sig = support::WaitForTerminationSignal(absl::ZeroDuration()); sig != 0) {
      std::fprintf(stderr, "tensorverbs demo: interrupted\n");
      rc = 130;
      break;
    }
    absl::StatusOr<support::ChildExit> exit =
        support::WaitAnyChild(children, absl::Milliseconds(200));
    if (!exit.ok()) {
      if (absl::Now() > deadline) {
        std::fprintf(stderr, "tensorverbs demo: the cluster did not finish in time\n");
        rc = 1;
        break;
      }
      continue;
    }
    size_t i = std::find(children.begin(), children.end(), exit->pid) - children.begin();
    std::string name = child_names[i];
    children.erase(children.begin() + i);
    child_names.erase(child_names.begin() + i);
    if (exit->signaled || exit->exit_code != 0) {
      std::fprintf(stderr, "tensorverbs demo: task %s %s\n", name.c_str(),
                   exit->signaled ? absl::StrCat("was killed by signal ", exit->signal).c_str()
                                  : absl::StrCat("exited with code ", exit->exit_code).c_str());
      rc = 1;
      break;
    }
  }
  for (pid_t pid : children) kill(pid, SIGTERM);
  // srun passes SIGTERM on to the step's tasks and waits for them: a step killed outright would
  // live on under slurmstepd.
  const absl::Duration grace = options.launcher == "srun" ? absl::Seconds(15) : absl::Seconds(5);
  for (pid_t pid : children) {
    absl::StatusOr<support::ChildExit> e = support::WaitAnyChild({pid}, grace);
    if (!e.ok()) {
      kill(pid, SIGKILL);
      (void)support::WaitAnyChild({pid}, absl::Seconds(5));
    }
    // A task that was killed, by us or by a signal, never closed its shm endpoints.
    support::UnlinkShmRegionsOf(pid);
  }
  return rc;
}

}  // namespace tensorverbs::tools
