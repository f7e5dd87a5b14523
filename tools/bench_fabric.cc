// `tensorverbs bench fabric`: write-with-immediate bandwidth and latency of a fabric backend
// between two processes, per message size, in the style of perftest's ib_write_bw and
// ib_write_lat, and libfabric's own fi_pingpong on the same provider and sizes in the same run.
//
// The launcher is the initiator; it starts `tensorverbs bench-fabric-peer` as the target and
// drives it with one line per test on its stdin:
//   connect <address hex> <key hex> <base>   -> "ok"
//   lat <size> <iters>    ping-pong: echo each write-with-immediate back      -> "done"
//   bw <size> <iters>     count writes, then a zero-byte write as the ack     -> "done"
// Both sides busy-poll (this is a benchmark). Results: a table on stdout and JSON rows.
#include "tools/bench_fabric.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "src/common/config.h"
#include "src/common/shared_memory.h"
#include "src/common/status_macros.h"
#include "src/fabric/fabric.h"
#include "src/support/process_util.h"
#include "src/support/subprocess.h"
#include "tensorverbs/placement.h"
#include "tools/bench_util.h"
#include "tools/commands.h"

namespace tensorverbs::tools {
namespace {

// One side: a domain, an endpoint, and a registered buffer of the largest size.
class Side {
 public:
  static absl::StatusOr<std::unique_ptr<Side>> Open(const std::string& backend,
                                                    const std::string& provider,
                                                    const std::string& source, size_t bytes) {
    auto side = std::unique_ptr<Side>(new Side);
    fabric::DomainOptions options;
    options.provider = provider;
    options.source_address = source;
    options.queue_depth = 256;
    options.copy_threads = Config::Get().shmem_copy_threads;  // as a task's would have
    options.peer_copy = Config::Get().shmem_peer_copy;
    options.ofi_shared_endpoint = Config::Get().ofi_shared_endpoint;
    ASSIGN_OR_RETURN(side->domain_, fabric::OpenDomain(backend, options));
    ASSIGN_OR_RETURN(side->ep_, side->domain_->CreateEndpoint());
    side->size_ = std::max<size_t>(bytes, 4096);
    void* p;
    if (side->domain_->capabilities().shared_memory) {
      // Where the protocol's pool would be: memory the peer maps.
      ASSIGN_OR_RETURN(side->shared_, SharedMemory::Create(side->size_, "bench-fabric"));
      p = side->shared_->data();
    } else {
      p = mmap(nullptr, side->size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return absl::ResourceExhaustedError("bench: cannot map the buffer");
    }
    madvise(p, side->size_, MADV_HUGEPAGE);
    std::memset(p, 0x5A, side->size_);  // fault every page in before measuring
    side->buf_ = static_cast<char*>(p);
    ASSIGN_OR_RETURN(side->mr_, side->domain_->RegisterMemory(
                                    side->buf_, side->size_,
                                    fabric::kAccessRemoteWrite | fabric::kAccessRemoteRead));
    return side;
  }
  ~Side() {
    mr_.reset();
    ep_.reset();
    domain_.reset();
    if (buf_ != nullptr && shared_ == nullptr) munmap(buf_, size_);
  }

  std::string Hello() const {
    return absl::StrCat(absl::BytesToHexString(ep_->LocalAddress()), " ",
                        absl::BytesToHexString(mr_->PackRemoteKey()), " ",
                        reinterpret_cast<uintptr_t>(buf_));
  }
  absl::Status Connect(const std::vector<std::string>& f) {  // address, key, base
    if (f.size() != 3) return absl::InvalidArgumentError("bench: malformed peer description");
    RETURN_IF_ERROR(ep_->Connect(absl::HexStringToBytes(f[0])));
    remote_.key = absl::HexStringToBytes(f[1]);
    if (!absl::SimpleAtoi(f[2], &remote_.addr)) return absl::InvalidArgumentError("bench: base");
    remote_.length = size_;
    return absl::OkStatus();
  }

  absl::Status Write(size_t size, uint32_t imm) {
    fabric::RemoteBuffer r = remote_;
    r.length = size;
    return ep_->PostWriteWithImm({mr_.get(), buf_, size}, r, imm, imm);
  }

  // Polls once; counts completions. An error completion fails the benchmark, and so does a
  // wait with nothing at all for kStallLimit: a write lost on the way (or a peer gone) would
  // otherwise spin both processes forever.
  absl::Status Poll() {
    fabric::Completion c[64];
    ASSIGN_OR_RETURN(size_t n, domain_->Poll(absl::MakeSpan(c)));
    if (n == 0) {
      // The clock is read once every 4096 empty polls, to leave the measured loop alone.
      if ((++empty_polls_ & 4095) != 0) return absl::OkStatus();
      const absl::Time now = absl::Now();
      if (quiet_since_ == absl::InfiniteFuture()) quiet_since_ = now;
      if (now - quiet_since_ > kStallLimit) {
        return absl::DeadlineExceededError(absl::StrCat(
            "bench: no completion and no immediate for ", absl::FormatDuration(kStallLimit), " (",
            local_done_, " writes completed, ", imms_,
            " immediates received so far): the fabric lost a write or the peer stopped"));
      }
      return absl::OkStatus();
    }
    empty_polls_ = 0;
    quiet_since_ = absl::InfiniteFuture();
    for (size_t i = 0; i < n; ++i) {
      RETURN_IF_ERROR(c[i].status);
      if (c[i].kind == fabric::CompletionKind::kRemoteWriteImm) {
        ++imms_;
      } else {
        ++local_done_;
      }
    }
    return absl::OkStatus();
  }

  uint64_t imms_ = 0;
  uint64_t local_done_ = 0;
  uint64_t posted_ = 0;
  static constexpr absl::Duration kStallLimit = absl::Seconds(40);  // past the 30 s op timeout

 private:
  Side() = default;
  std::unique_ptr<fabric::Domain> domain_;
  std::unique_ptr<fabric::Endpoint> ep_;
  std::unique_ptr<fabric::MemoryRegion> mr_;
  std::unique_ptr<SharedMemory> shared_;
  char* buf_ = nullptr;
  size_t size_ = 0;
  fabric::RemoteBuffer remote_;
  uint64_t empty_polls_ = 0;
  absl::Time quiet_since_ = absl::InfiniteFuture();
};

using Row = FabricRow;

absl::Status RunLatency(Side& side, support::Subprocess& peer, size_t size, int iters, Row& row) {
  const int warmup = std::min(iters / 10 + 1, 100);
  RETURN_IF_ERROR(Tell(peer, absl::StrCat("lat ", size, " ", iters + warmup)));
  std::vector<double> rtt;
  rtt.reserve(iters);
  absl::Duration total;
  for (int i = 0; i < iters + warmup; ++i) {
    const uint64_t want_local = side.local_done_ + 1, want_imm = side.imms_ + 1;
    absl::Time t0 = absl::Now();
    RETURN_IF_ERROR(side.Write(size, static_cast<uint32_t>(i)));
    while (side.local_done_ < want_local || side.imms_ < want_imm) RETURN_IF_ERROR(side.Poll());
    absl::Duration d = absl::Now() - t0;
    if (i >= warmup) {
      rtt.push_back(absl::ToDoubleMicroseconds(d));
      total += d;
    }
  }
  RETURN_IF_ERROR(Expect(peer, "done").status());
  std::sort(rtt.begin(), rtt.end());
  row.lat_iters = iters;
  row.p50_us = rtt[rtt.size() / 2] / 2;
  row.p99_us = rtt[std::min(rtt.size() - 1, rtt.size() * 99 / 100)] / 2;
  row.pingpong_us = absl::ToDoubleMicroseconds(total) / (2.0 * iters);
  row.pingpong_mbps = 2.0 * iters * size / absl::ToDoubleSeconds(total) / 1e6;
  return absl::OkStatus();
}

absl::Status RunBandwidth(Side& side, support::Subprocess& peer, size_t size, int iters, int window,
                          Row& row) {
  RETURN_IF_ERROR(Tell(peer, absl::StrCat("bw ", size, " ", iters)));
  const uint64_t base_local = side.local_done_, base_imm = side.imms_;
  absl::Time t0 = absl::Now();
  int posted = 0;
  while (posted < iters || side.local_done_ - base_local < static_cast<uint64_t>(iters) ||
         side.imms_ == base_imm) {
    while (posted < iters && posted - static_cast<int>(side.local_done_ - base_local) < window) {
      RETURN_IF_ERROR(side.Write(size, static_cast<uint32_t>(posted)));
      ++posted;
    }
    RETURN_IF_ERROR(side.Poll());
  }
  absl::Duration d = absl::Now() - t0;
  RETURN_IF_ERROR(Expect(peer, "done").status());
  row.bw_iters = iters;
  row.bw_gbps = static_cast<double>(size) * iters / absl::ToDoubleSeconds(d) / 1e9;
  return absl::OkStatus();
}

// fi_pingpong (libfabric-bin) on the same provider and size: {usec/xfer, MB/sec}.
absl::StatusOr<std::pair<double, double>> RunFiPingpong(const std::string& provider, size_t size,
                                                        int iters) {
  ASSIGN_OR_RETURN(std::vector<int> ports, PickFreePorts(1));
  const std::string port = absl::StrCat(ports[0]);
  std::vector<std::string> common = {"-p", provider,           "-e", "rdm",
                                     "-S", absl::StrCat(size), "-I", absl::StrCat(iters)};
  std::vector<std::string> server_args = common;
  server_args.insert(server_args.end(), {"-B", port});
  ASSIGN_OR_RETURN(auto server, support::Subprocess::Start("/usr/bin/fi_pingpong", server_args));
  for (int attempt = 0; attempt < 50; ++attempt) {
    absl::SleepFor(absl::Milliseconds(100));
    std::vector<std::string> client_args = common;
    client_args.insert(client_args.end(), {"-P", port, "127.0.0.1"});
    ASSIGN_OR_RETURN(auto client, support::Subprocess::Start("/usr/bin/fi_pingpong", client_args));
    std::string out = client->ReadAll(absl::Seconds(60));
    absl::StatusOr<int> rc = client->Wait(absl::Seconds(10));
    if (!rc.ok()) {
      // Seen under heavy load on tcp;ofi_rxm: a fi_pingpong pair that never finishes. The
      // comparison is left out of the row rather than holding the bench (both are killed).
      return absl::DeadlineExceededError("fi_pingpong did not finish within 60 s");
    }
    if (*rc != 0) continue;  // the server was not listening yet
    for (absl::string_view line : absl::StrSplit(out, '\n')) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipWhitespace());
      double mbps, usec;
      if (f.size() == 8 && absl::SimpleAtod(f[5], &mbps) && absl::SimpleAtod(f[6], &usec)) {
        return std::make_pair(usec, mbps);
      }
    }
    return absl::InternalError(absl::StrCat("fi_pingpong printed no result: ", out));
  }
  return absl::UnavailableError("fi_pingpong did not run");
}

}  // namespace

int RunBenchFabricPeer(const BenchFabricOptions& o) {
  absl::StatusOr<size_t> max = ParseSize(o.max_size);
  if (!max.ok()) return 2;
  absl::StatusOr<std::unique_ptr<Side>> side = Side::Open(o.backend, o.providers, o.source, *max);
  if (!side.ok()) {
    std::fprintf(stderr, "bench-fabric-peer: %s\n", side.status().ToString().c_str());
    return 1;
  }
  Side& s = **side;
  std::printf("hello %s\n", s.Hello().c_str());
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
    std::vector<std::string> f = absl::StrSplit(line, ' ');
    absl::Status status;
    if (f[0] == "connect") {
      status = s.Connect({f.begin() + 1, f.end()});
      if (status.ok()) std::printf("ok\n");
    } else if ((f[0] == "lat" || f[0] == "bw") && f.size() == 3) {
      size_t size = std::stoul(f[1]);
      uint64_t iters = std::stoull(f[2]);
      const uint64_t base_imm = s.imms_, base_local = s.local_done_;
      uint64_t sent = 0;
      while (status.ok() && s.imms_ - base_imm < iters) {
        status = s.Poll();
        // Ping-pong: answer each arrival.
        while (status.ok() && f[0] == "lat" && sent < s.imms_ - base_imm) {
          status = s.Write(size, static_cast<uint32_t>(sent++));
        }
      }
      if (status.ok() && f[0] == "bw") {
        status = s.Write(0, 0xFFFFFFFE);
        ++sent;
      }
      // Drain our own completions.
      while (status.ok() && s.local_done_ - base_local < sent) status = s.Poll();
      if (status.ok()) std::printf("done\n");
    } else if (f[0] == "quit") {
      return 0;
    } else {
      status = absl::InvalidArgumentError(absl::StrCat("unknown command '", line, "'"));
    }
    if (!status.ok()) {
      std::printf("error %s\n", status.ToString().c_str());
      std::fflush(stdout);
      return 1;
    }
    std::fflush(stdout);
  }
  return 0;
}

absl::StatusOr<std::vector<FabricRow>> MeasureFabric(const FabricBenchSpec& spec) {
  if (spec.sizes.empty()) return absl::InvalidArgumentError("bench fabric: no sizes");
  const size_t max_size = *std::max_element(spec.sizes.begin(), spec.sizes.end());
  const bool have_fi_pingpong =
      spec.compare && spec.peer_prefix.empty() && access("/usr/bin/fi_pingpong", X_OK) == 0;
  const std::string& provider = spec.provider;
  ASSIGN_OR_RETURN(std::unique_ptr<Side> side,
                   Side::Open(spec.backend, provider, spec.source, max_size));
  ASSIGN_OR_RETURN(std::string exe, support::SelfExecutable());
  std::vector<std::string> args = spec.peer_prefix;
  args.insert(args.end(),
              {exe, "bench-fabric-peer", "--backend", spec.backend, "--providers", provider,
               "--max-size", absl::StrCat(max_size), "--source", spec.peer_source});
  const std::string path = args.front();
  args.erase(args.begin());
  ASSIGN_OR_RETURN(std::unique_ptr<support::Subprocess> peer,
                   support::Subprocess::Start(path, args));
  absl::StatusOr<std::string> hello = peer->WaitForLine("hello ", absl::Seconds(60));
  if (!hello.ok()) {
    return absl::Status(hello.status().code(), absl::StrCat("the bench-fabric peer did not start: ",
                                                            hello.status().message()));
  }
  std::vector<std::string> f = absl::StrSplit(hello->substr(6), ' ');
  RETURN_IF_ERROR(side->Connect(f));
  RETURN_IF_ERROR(Tell(*peer, absl::StrCat("connect ", side->Hello())));
  RETURN_IF_ERROR(Expect(*peer, "ok").status());
  if (spec.print) {
    std::printf(
        "\nfabric write-with-immediate, backend %s, provider %s, 2 processes, busy polling\n",
        spec.backend.c_str(), provider.empty() ? "(default)" : provider.c_str());
    std::printf("%10s %8s %12s %10s %10s %14s %14s %12s %10s %9s\n", "#bytes", "#iters", "BW[GB/s]",
                "lat p50", "lat p99", "pingpong MB/s", "fi_pingpong", "ratio", "memcpy",
                "x memcpy");
  }
  std::vector<FabricRow> rows;
  for (size_t size : spec.sizes) {
    Row row;
    row.provider = provider.empty() ? "(default)" : provider;
    row.size = size;
    const int lat_iters =
        spec.iters > 0 ? spec.iters
                       : static_cast<int>(std::clamp<size_t>((size_t{256} << 20) / size, 20, 5000));
    const int bw_iters =
        spec.iters > 0 ? spec.iters
                       : static_cast<int>(std::clamp<size_t>((size_t{2} << 30) / size, 10, 20000));
    RETURN_IF_ERROR(RunLatency(*side, *peer, size, lat_iters, row));
    RETURN_IF_ERROR(RunBandwidth(*side, *peer, size, bw_iters, spec.window, row));
    if (have_fi_pingpong && spec.backend == "ofi" && !provider.empty()) {
      absl::StatusOr<std::pair<double, double>> fi = RunFiPingpong(provider, size, lat_iters);
      if (fi.ok()) {
        std::tie(row.fi_us, row.fi_mbps) = *fi;
      } else if (spec.print) {
        std::printf("%10s fi_pingpong left out: %s\n", SizeName(size).c_str(),
                    std::string(fi.status().message()).c_str());
      }
    }
    if (spec.compare) row.memcpy_gbps = MeasureMemcpyGbps(size);
    if (spec.print) {
      std::string fi_text = row.fi_mbps > 0 ? absl::StrFormat("%.1f MB/s", row.fi_mbps) : "-";
      std::string ratio =
          row.fi_mbps > 0 ? absl::StrFormat("%.2f", row.pingpong_mbps / row.fi_mbps) : "-";
      std::string memcpy_text =
          row.memcpy_gbps > 0 ? absl::StrFormat("%.3f", row.memcpy_gbps) : "-";
      std::string memcpy_ratio =
          row.memcpy_gbps > 0 ? absl::StrFormat("%.2f", row.bw_gbps / row.memcpy_gbps) : "-";
      std::printf("%10s %8d %12.3f %8.2fus %8.2fus %14.1f %14s %12s %10s %9s\n",
                  SizeName(size).c_str(), lat_iters, row.bw_gbps, row.p50_us, row.p99_us,
                  row.pingpong_mbps, fi_text.c_str(), ratio.c_str(), memcpy_text.c_str(),
                  memcpy_ratio.c_str());
      std::fflush(stdout);
    }
    rows.push_back(row);
  }
  (void)Tell(*peer, "quit");  // best effort: the peer is reaped either way
  (void)peer->Wait(absl::Seconds(10));
  return rows;
}

int RunBenchFabric(const BenchFabricOptions& o) {
  absl::StatusOr<std::vector<size_t>> sizes = ParseSizeList(o.sizes);
  if (!sizes.ok()) {
    std::fprintf(stderr, "tensorverbs bench fabric: --sizes: %s\n",
                 std::string(sizes.status().message()).c_str());
    return 2;
  }
  std::vector<Row> rows;
  std::vector<std::string> providers = absl::StrSplit(o.providers, ',', absl::SkipEmpty());
  // Providers are libfabric's; the other backends have one each.
  if (providers.empty() || o.backend != "ofi") providers = {""};
  for (const std::string& provider : providers) {
    FabricBenchSpec spec;
    spec.backend = o.backend;
    spec.provider = provider;
    spec.sizes = *sizes;
    spec.iters = o.iters;
    spec.window = o.window;
    spec.compare = o.compare;
    absl::StatusOr<std::vector<FabricRow>> got = MeasureFabric(spec);
    if (!got.ok()) {
      if (absl::IsUnavailable(got.status())) {
        std::printf("%s %s: skipped: %s\n", o.backend.c_str(), provider.c_str(),
                    std::string(got.status().message()).c_str());
        continue;
      }
      std::fprintf(stderr, "tensorverbs bench fabric: %s\n", got.status().ToString().c_str());
      return 1;
    }
    rows.insert(rows.end(), got->begin(), got->end());
  }
  std::printf(
      "\nBW: windowed writes (window %d) until the peer acknowledges the last; lat: half the\n"
      "round trip of a ping-pong of writes with immediate; pingpong MB/s counts both\n"
      "directions over the ping-pong time, as fi_pingpong does; ratio = ours / fi_pingpong;\n"
      "memcpy: one core copying between pre-faulted buffers of the size, in the same run.\n",
      o.window);
  if (!o.json.empty()) {
    nlohmann::json out = nlohmann::json::array();
    for (const Row& r : rows) {
      nlohmann::json j = {{"backend", o.backend},
                          {"provider", r.provider},
                          {"size_bytes", r.size},
                          {"bw_iters", r.bw_iters},
                          {"lat_iters", r.lat_iters},
                          {"bandwidth_gbps", r.bw_gbps},
                          {"p50_us", r.p50_us},
                          {"p99_us", r.p99_us},
                          {"pingpong_mbps", r.pingpong_mbps},
                          {"pingpong_us", r.pingpong_us}};
      if (r.memcpy_gbps > 0) {
        j["memcpy_gbps"] = r.memcpy_gbps;
        j["ratio_to_memcpy"] = r.bw_gbps / r.memcpy_gbps;
      }
      if (r.fi_mbps > 0) {
        j["fi_pingpong_mbps"] = r.fi_mbps;
        j["fi_pingpong_us"] = r.fi_us;
        j["ratio_to_fi_pingpong"] = r.pingpong_mbps / r.fi_mbps;
      }
      out.push_back(j);
    }
    std::ofstream(o.json) << out.dump(2) << "\n";
  }
  return 0;
}

}  // namespace tensorverbs::tools
