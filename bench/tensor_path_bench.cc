// One small tensor's whole grpc+verbs path, and the stages it is made of, with Google Benchmark.
//
// BM_TensorPath runs training-like steps between two Servers in this process (task 1 sends
// every key of the step, task 0 receives them) over the loopback or the shmem fabric, and
// reports per tensor: wall time, CPU time of the whole process (both tasks, every thread) and
// heap allocations (every thread). The stage benchmarks time, one at a time on this thread, the
// pieces a transfer goes through, so a change to one of them can be seen on its own:
//
//   rendezvous  BM_KeyIntern, BM_RendezvousSendThenRecv
//   request     BM_RequestEncodeDecode (a REQUEST by name index, with its destination)
//   codec       BM_MetaDataEncodeDecode (the response's meta-data)
//   allocation  BM_PoolTensor (the destination tensor from the registered pool)
//   fabric      BM_FabricWriteImm (post a 4 B write with immediate, poll both completions),
//               BM_IdlePoll (an idle domain's poll, by its connected peers)
//   callback    BM_CallbackHandoff (inline, or handed to a callback thread and waited for)
//   keys        BM_ChannelKeyRegistration (a channel's first destination in a pool region)
//
//   build/bench/tensor_path_bench --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>
#include <time.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "src/common/executor.h"
#include "src/common/shared_memory.h"
#include "src/fabric/fabric.h"
#include "src/protocol/message.h"
#include "src/rendezvous/key_table.h"
#include "src/rendezvous/local_rendezvous.h"
#include "src/server/server.h"
#include "src/tensor/allocator.h"
#include "tensorverbs/placement.h"
#include "tests/support/allocation_counter.h"

namespace tensorverbs {
namespace {

double ProcessCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// A TensorFlow-style key: devices, incarnation, an edge name.
std::string KeyString(int i) {
  return ParsedKey::Create("/job:worker/replica:0/task:1/device:CPU:0", 1234567,
                           "/job:worker/replica:0/task:0/device:CPU:0",
                           absl::StrCat("gradients/layer_", i, "/conv/weights_grad:0"));
}

// Two tasks of one cluster in this process, kept for the benchmark's life (one per fabric).
struct Pair {
  std::unique_ptr<Server> receiver, sender;
};

Pair* StartPair(const std::string& fabric) {
  auto* p = new Pair;
  std::vector<int> ports = *PickFreePorts(2);
  ClusterSpec cluster =
      *ClusterSpec::Parse(absl::StrCat("worker=127.0.0.1:", ports[0], ",127.0.0.1:", ports[1]));
  ServerOptions o;
  o.cluster = cluster;
  o.job = "worker";
  o.protocol = "grpc+verbs";
  o.verbs.fabric = fabric;
  o.task = 0;
  absl::StatusOr<std::unique_ptr<Server>> r = Server::Create(o);
  o.task = 1;
  absl::StatusOr<std::unique_ptr<Server>> s = Server::Create(o);
  if (!r.ok() || !s.ok()) {
    delete p;
    return nullptr;
  }
  p->receiver = *std::move(r);
  p->sender = *std::move(s);
  return p;
}

Pair* GetPair(const std::string& fabric) {
  static Pair* loopback = StartPair("loopback");
  static Pair* shmem = StartPair("shmem");
  return fabric == "shmem" ? shmem : loopback;
}

// One step: task 1 sends every key (passive Sends), task 0 receives them all asynchronously and
// waits for the last callback. Returns false on any error.
bool RunStep(Pair& pair, int64_t step, const std::vector<ParsedKey>& keys,
             const std::vector<Tensor>& tensors) {
  auto sender = *pair.sender->rendezvous_mgr()->Find(step);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!sender->Send(keys[i], tensors[i]).ok()) return false;
  }
  auto receiver = *pair.receiver->rendezvous_mgr()->Find(step);
  std::atomic<int> done{0};
  std::atomic<int> errors{0};
  for (const ParsedKey& key : keys) {
    receiver->RecvAsync(key, RecvArgs(), [&](const absl::Status& s, const Tensor&, bool) {
      if (!s.ok()) errors.fetch_add(1, std::memory_order_relaxed);
      done.fetch_add(1, std::memory_order_release);
    });
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (done.load(std::memory_order_acquire) < static_cast<int>(keys.size())) {
    if (absl::Now() > deadline) return false;
  }
  receiver.reset();
  sender.reset();
  pair.receiver->rendezvous_mgr()->Cleanup(step);
  pair.sender->rendezvous_mgr()->Cleanup(step);
  return errors.load() == 0;
}

// Arguments: keys per step, fabric (0 loopback, 1 shmem).
void BM_TensorPath(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  const std::string fabric = state.range(1) == 1 ? "shmem" : "loopback";
  state.SetLabel(fabric);
  Pair* pair = GetPair(fabric);
  if (pair == nullptr) {
    state.SkipWithError("the servers did not start");
    return;
  }
  std::vector<ParsedKey> keys;
  std::vector<Tensor> tensors;
  for (int i = 0; i < n; ++i) {
    keys.push_back(*ParsedKey::Parse(ParsedKey::Create(
        pair->sender->device_name(), pair->sender->incarnation(), pair->receiver->device_name(),
        absl::StrCat("gradients/layer_", i, "/conv/weights_grad:0"))));
    Tensor t =
        *Tensor::Allocate(pair->sender->recv_allocator(), DataType::kFloat32, TensorShape::Of({1}));
    *static_cast<float*>(t.data()) = static_cast<float>(i);
    tensors.push_back(std::move(t));
  }
  static int64_t step = 1;
  // Warm-up: channels, meta-data caches, pools and the pushed requests reach their steady state.
  for (int i = 0; i < 20; ++i) {
    if (!RunStep(*pair, ++step, keys, tensors)) {
      state.SkipWithError("a warm-up step failed");
      return;
    }
  }
  const double cpu0 = ProcessCpuSeconds();
  testing::StartCountingAllocations();
  for (auto _ : state) {
    if (!RunStep(*pair, ++step, keys, tensors)) {
      state.SkipWithError("a step failed");
      break;
    }
  }
  const double tensors_moved = static_cast<double>(state.iterations()) * n;
  state.SetItemsProcessed(static_cast<int64_t>(tensors_moved));
  state.counters["us_per_tensor_process_cpu"] = (ProcessCpuSeconds() - cpu0) * 1e6 / tensors_moved;
  state.counters["allocs_per_tensor"] =
      static_cast<double>(testing::StopCountingAllocations()) / tensors_moved;
}
BENCHMARK(BM_TensorPath)
    ->ArgsProduct({{1, 64}, {0, 1}})
    ->ArgNames({"keys", "shmem"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// The receiver's per-recv lookup of its interned key.
void BM_KeyIntern(benchmark::State& state) {
  KeyTable table;
  ParsedKey key = *ParsedKey::Parse(KeyString(7));
  KeyRef first = table.Intern(key);
  for (auto _ : state) benchmark::DoNotOptimize(table.Intern(key));
}
BENCHMARK(BM_KeyIntern);

// The sender's step table: a passive Send, then the recv that takes it (what a REQUEST does on
// the sending task). A fresh table per batch of 64 keys, as per step, interning its keys in
// one KeyTable for the process as a Server does.
void BM_RendezvousSendThenRecv(benchmark::State& state) {
  std::vector<ParsedKey> keys;
  for (int i = 0; i < 64; ++i) keys.push_back(*ParsedKey::Parse(KeyString(i)));
  Tensor t = Tensor::Make(DataType::kFloat32, TensorShape::Of({1}));
  KeyTable interned;
  // The sending task's responses hold their key interned already (the channel's index table).
  std::vector<KeyRef> refs;
  for (const ParsedKey& key : keys) refs.push_back(interned.Intern(key));
  int64_t taken = 0;
  for (auto _ : state) {
    state.PauseTiming();
    auto table = std::make_unique<LocalRendezvous>(&interned);
    state.ResumeTiming();
    for (size_t i = 0; i < keys.size(); ++i) {
      (void)table->Send(keys[i], t, false);
      table->RecvAsync(refs[i], [&taken](const absl::Status&, const Tensor&, bool) { ++taken; });
    }
    state.PauseTiming();
    table.reset();
    state.ResumeTiming();
  }
  state.SetItemsProcessed(state.iterations() * 64);
  benchmark::DoNotOptimize(taken);
}
BENCHMARK(BM_RendezvousSendThenRecv);

protocol::Message RequestMessage() {
  protocol::Message m;
  m.type = protocol::MessageType::kTensorRequest;
  m.name_index = 17;
  m.step_id = 123456;
  m.request_index = 42;
  m.remote_addr = 0x7f0012345000;
  m.remote_key = std::string(40, 'k');  // the shmem fabric's packed key is 40 bytes
  m.meta.dtype = DataType::kFloat32;
  m.meta.shape = TensorShape::Of({1});
  m.meta.tensor_bytes = 4;
  return m;
}

// Encodes `m` into a slot and decodes it back, once per iteration.
void EncodeAndDecode(benchmark::State& state, const protocol::Message& m) {
  std::vector<uint8_t> slot(protocol::kMessageSize);
  for (auto _ : state) {
    absl::StatusOr<size_t> size = protocol::EncodedSize(m);
    if (!size.ok() || !protocol::EncodeMessage(m, absl::MakeSpan(slot.data(), *size)).ok()) {
      state.SkipWithError("the message does not encode");
      break;
    }
    absl::StatusOr<protocol::Message> back = protocol::DecodeMessage(slot);
    if (!back.ok()) {
      state.SkipWithError(std::string(back.status().message()).c_str());
      break;
    }
    benchmark::DoNotOptimize(back);
  }
}

// Both ends of a REQUEST: the receiver encodes it into a slot, the sender decodes it.
void BM_RequestEncodeDecode(benchmark::State& state) {
  const protocol::Message m = RequestMessage();
  EncodeAndDecode(state, m);
}
BENCHMARK(BM_RequestEncodeDecode);

// Both ends of a META_DATA_RESPONSE (the sender's answer when the receiver had no cached meta).
void BM_MetaDataEncodeDecode(benchmark::State& state) {
  protocol::Message m = RequestMessage();
  m.type = protocol::MessageType::kMetaDataResponse;
  m.name_index = protocol::kNoNameIndex;
  m.remote_addr = 0;
  m.remote_key.clear();
  m.meta.shape = TensorShape::Of({64, 3, 3, 3});
  m.meta.tensor_bytes = 64 * 3 * 3 * 3 * 4;
  EncodeAndDecode(state, m);
}
BENCHMARK(BM_MetaDataEncodeDecode);

// The receiver's destination: a small tensor from the registered pool, and its release.
void BM_PoolTensor(benchmark::State& state) {
  static PoolAllocator* pool = new PoolAllocator("bench", PoolAllocator::Options());
  for (auto _ : state) {
    absl::StatusOr<Tensor> t = Tensor::Allocate(pool, DataType::kFloat32, TensorShape::Of({1}));
    benchmark::DoNotOptimize(t);
  }
}
BENCHMARK(BM_PoolTensor);

// The fabric's part: post a 4 B write with immediate between two endpoints of this process and
// poll until both the local completion and the immediate arrived. Argument: 0 loopback, 1 shmem.
void BM_FabricWriteImm(benchmark::State& state) {
  const std::string backend = state.range(0) == 1 ? "shmem" : "loopback";
  state.SetLabel(backend);
  auto a = fabric::OpenDomain(backend, fabric::DomainOptions());
  auto b = fabric::OpenDomain(backend, fabric::DomainOptions());
  if (!a.ok() || !b.ok()) {
    state.SkipWithError("the fabric did not open");
    return;
  }
  auto ea = *(*a)->CreateEndpoint();
  auto eb = *(*b)->CreateEndpoint();
  if (!ea->Connect(eb->LocalAddress()).ok() || !eb->Connect(ea->LocalAddress()).ok()) {
    state.SkipWithError("the endpoints did not connect");
    return;
  }
  std::vector<char> src(64, 1);
  auto dst = SharedMemory::Create(4096, "bench");
  auto src_mr = *(*a)->RegisterMemory(src.data(), src.size(), fabric::kAccessLocal);
  auto dst_mr = *(*b)->RegisterMemory((*dst)->data(), 4096, fabric::kAccessRemoteWrite);
  fabric::RemoteBuffer remote{dst_mr->PackRemoteKey(), reinterpret_cast<uint64_t>((*dst)->data()),
                              4096};
  fabric::Completion c[8];
  uint32_t imm = 0;
  for (auto _ : state) {
    ++imm;
    if (!ea->PostWriteWithImm({src_mr.get(), src.data(), 4}, remote, imm, imm).ok()) {
      state.SkipWithError("post failed");
      break;
    }
    bool local = false, remote_imm = false;
    while (!local || !remote_imm) {
      if (!local && *(*a)->Poll(absl::MakeSpan(c)) > 0) local = true;
      if (!remote_imm && *(*b)->Poll(absl::MakeSpan(c)) > 0) remote_imm = true;
    }
  }
}
BENCHMARK(BM_FabricWriteImm)->Arg(0)->Arg(1)->ArgName("shmem");

// The fabric's part of an idle progress turn: one Poll of a domain with nothing arriving, whose
// endpoints are connected each to a peer domain of its own (a peer task, in this process). Each
// pair carried one write with immediate first, so what a provider makes on first use (tcp's
// connections) stands. Arguments: fabric (0 shmem, 1 ofi tcp;ofi_rxm) and peers. The slope over
// the peer count is what each channel adds to every idle turn.
void BM_IdlePoll(benchmark::State& state) {
  static const char* const kBackends[][3] = {{"shmem", "", "shmem"},
                                             {"ofi", "tcp;ofi_rxm", "ofi tcp"}};
  const auto& which = kBackends[state.range(0)];
  const int peers = static_cast<int>(state.range(1));
  state.SetLabel(which[2]);
  fabric::DomainOptions options;
  options.provider = which[1];
  auto skip = [&state](const absl::Status& s) {
    state.SkipWithError(std::string(s.message()).c_str());
  };
  auto own = fabric::OpenDomain(which[0], options);
  if (!own.ok()) return skip(own.status());
  std::vector<char> src(64, 1);
  auto src_mr = (*own)->RegisterMemory(src.data(), src.size(), fabric::kAccessLocal);
  if (!src_mr.ok()) return skip(src_mr.status());
  struct Peer {
    std::unique_ptr<fabric::Domain> domain;
    std::unique_ptr<fabric::Endpoint> theirs, ours;
    std::unique_ptr<SharedMemory> dst;
    std::unique_ptr<fabric::MemoryRegion> dst_mr;
  };
  std::vector<Peer> all(peers);
  fabric::Completion c[16];
  for (int i = 0; i < peers; ++i) {
    Peer& p = all[i];
    auto domain = fabric::OpenDomain(which[0], options);
    if (!domain.ok()) return skip(domain.status());
    p.domain = *std::move(domain);
    auto theirs = p.domain->CreateEndpoint();
    auto ours = (*own)->CreateEndpoint();
    if (!theirs.ok() || !ours.ok()) return skip(theirs.ok() ? ours.status() : theirs.status());
    p.theirs = *std::move(theirs);
    p.ours = *std::move(ours);
    absl::Status s = p.ours->Connect(p.theirs->LocalAddress());
    if (s.ok()) s = p.theirs->Connect(p.ours->LocalAddress());
    if (!s.ok()) return skip(s);
    auto dst = SharedMemory::Create(4096, "bench");
    if (!dst.ok()) return skip(dst.status());
    p.dst = *std::move(dst);
    auto dst_mr = p.domain->RegisterMemory(p.dst->data(), 4096, fabric::kAccessRemoteWrite);
    if (!dst_mr.ok()) return skip(dst_mr.status());
    p.dst_mr = *std::move(dst_mr);
    const fabric::RemoteBuffer remote{p.dst_mr->PackRemoteKey(),
                                      reinterpret_cast<uint64_t>(p.dst->data()), 4096};
    s = p.ours->PostWriteWithImm({src_mr->get(), src.data(), 4}, remote, 1, 1);
    if (!s.ok()) return skip(s);
    bool local = false, arrived = false;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while ((!local || !arrived) && absl::Now() < deadline) {
      auto n = (*own)->Poll(absl::MakeSpan(c));
      if (!n.ok()) return skip(n.status());
      for (size_t k = 0; k < *n; ++k) {
        if (!c[k].status.ok()) return skip(c[k].status);
        local = true;
      }
      auto m = p.domain->Poll(absl::MakeSpan(c));
      if (!m.ok()) return skip(m.status());
      arrived |= *m > 0;
    }
    if (!local || !arrived) return skip(absl::DeadlineExceededError("a first write did not land"));
  }
  size_t seen = 0;
  absl::Status failed;
  for (auto _ : state) {
    auto n = (*own)->Poll(absl::MakeSpan(c));
    if (n.ok()) {
      seen += *n;
    } else if (failed.ok()) {
      failed = n.status();
    }
  }
  if (!failed.ok()) return skip(failed);
  if (seen != 0) return skip(absl::InternalError("an idle domain reported completions"));
  state.counters["peers"] = peers;
}
BENCHMARK(BM_IdlePoll)->ArgsProduct({{0, 1}, {1, 16, 64}})->ArgNames({"fabric", "peers"});

// What a channel key costs a channel, once per pool region it is offered a destination in: one
// RegisterMemoryFor of a pre-touched 64 MiB pool region (TENSORVERBS_POOL_REGION_MB's default)
// and its deregistration when the channel closes. Argument: 0 loopback, 1 ofi shm, 2 ofi
// tcp;ofi_rxm.
void BM_ChannelKeyRegistration(benchmark::State& state) {
  static const char* const kBackends[][3] = {
      {"loopback", "", "loopback"}, {"ofi", "shm", "ofi shm"}, {"ofi", "tcp;ofi_rxm", "ofi tcp"}};
  const auto& which = kBackends[state.range(0)];
  state.SetLabel(which[2]);
  fabric::DomainOptions options;
  options.provider = which[1];
  auto domain = fabric::OpenDomain(which[0], options);
  if (!domain.ok()) {
    state.SkipWithError(std::string(domain.status().message()).c_str());
    return;
  }
  auto endpoint = *(*domain)->CreateEndpoint();
  constexpr size_t kRegion = size_t{64} << 20;
  std::vector<char> region(kRegion, 1);  // touched, as the pool pre-touches
  for (auto _ : state) {
    auto mr =
        (*domain)->RegisterMemoryFor(*endpoint, region.data(), kRegion, fabric::kAccessRemoteWrite);
    if (!mr.ok()) {
      state.SkipWithError(std::string(mr.status().message()).c_str());
      break;
    }
    benchmark::DoNotOptimize(mr->get());
  }
}
BENCHMARK(BM_ChannelKeyRegistration)->DenseRange(0, 2)->ArgName("fabric");

// A recv's callback: run inline on the completing thread (argument 0), or handed to a callback
// thread as the default configuration does and waited for (argument 1).
void BM_CallbackHandoff(benchmark::State& state) {
  static Executor* executor = new Executor("bench-callbacks", 1);
  std::atomic<int64_t> ran{0};
  for (auto _ : state) {
    const int64_t want = ran.load(std::memory_order_relaxed) + 1;
    Executor::Task task = [&ran] { ran.fetch_add(1, std::memory_order_release); };
    if (state.range(0) == 0) {
      std::move(task)();
    } else {
      executor->Schedule(std::move(task));
      while (ran.load(std::memory_order_acquire) < want) {
      }
    }
  }
}
BENCHMARK(BM_CallbackHandoff)->Arg(0)->Arg(1)->ArgName("thread");

}  // namespace
}  // namespace tensorverbs

BENCHMARK_MAIN();
