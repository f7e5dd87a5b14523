// The `tensorverbs` tool as a user runs it: the demo end to end, and the server subcommand's
// start-up, bad input and clean shutdown on SIGTERM.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "proto/worker.grpc.pb.h"
#include "tensorverbs/placement.h"
#include "tests/support/subprocess.h"
#include "tests/support/temp_dir.h"

namespace tensorverbs {
namespace {

using ::testing::HasSubstr;
using testing::RunTool;
using testing::ScopedTempDir;
using testing::Subprocess;
using testing::ToolRun;

// The demo with the default protocol (grpc+verbs here: libfabric shm is usable) and with grpc.
// `*output` (if given) gets its stdout.
void ExpectDemoTrains(const std::vector<std::string>& extra, const std::string& protocol,
                      std::string* output = nullptr) {
  std::vector<std::string> args = {"demo", "--steps", "12", "--workers", "2"};
  args.insert(args.end(), extra.begin(), extra.end());
  absl::StatusOr<ToolRun> run = RunTool(args, absl::Seconds(240));
  ASSERT_TRUE(run.ok()) << run.status();
  const std::string& out = run->out;
  EXPECT_EQ(run->exit_code, 0) << out;
  EXPECT_THAT(out, HasSubstr("over " + protocol));
  std::vector<float> losses;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    float loss;
    int step;
    if (sscanf(std::string(line).c_str(), "step %d loss %f", &step, &loss) == 2) {
      EXPECT_EQ(step, static_cast<int>(losses.size()) + 1);
      losses.push_back(loss);
    }
  }
  ASSERT_EQ(losses.size(), 12u) << out;
  EXPECT_LT(losses.back(), losses.front());
  EXPECT_THAT(out, HasSubstr("summary: protocol " + protocol + ", 1 ps + 2 workers, 12 steps"));
  EXPECT_THAT(out, HasSubstr("tensors/s"));
  EXPECT_THAT(out, HasSubstr("share of step time in transfer"));
  if (output != nullptr) *output = out;
}

// Starts `tensorverbs server ARGS...` and waits for its start-up line (into `*line`).
void StartServer(const std::vector<std::string>& args, std::unique_ptr<support::Subprocess>* server,
                 std::string* line) {
  std::vector<std::string> all = {"server"};
  all.insert(all.end(), args.begin(), args.end());
  absl::StatusOr<std::unique_ptr<support::Subprocess>> p =
      support::Subprocess::Start(testing::ToolPath(), all);
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<std::string> started =
      (*p)->WaitForLine("tensorverbs server: task", absl::Seconds(30));
  ASSERT_TRUE(started.ok()) << started.status();
  *server = *std::move(p);
  *line = *started;
}

// SIGTERM, then the server shuts down cleanly (exit code 0).
void ExpectCleanShutdown(support::Subprocess& server) {
  server.Signal(SIGTERM);
  absl::StatusOr<int> rc = server.Wait(absl::Seconds(30));
  ASSERT_TRUE(rc.ok()) << rc.status();
  EXPECT_EQ(*rc, 0);
}

TEST(ToolTest, DemoTrainsOverGrpcVerbsByDefaultAndTheLossFalls) {
  ExpectDemoTrains({}, "grpc+verbs");
}

TEST(ToolTest, DemoTrainsOverGrpcAndTheLossFalls) {
  ExpectDemoTrains({"--protocol", "grpc"}, "grpc");
}

// With a GPU the weights and gradients live in the tasks' GPU pools and travel GPU to GPU;
// without one the demo refuses at once (exit 1), before it starts any task.
TEST(ToolTest, DemoTrainsWithItsTensorsOnTheGpuOrSaysWhyNot) {
  absl::StatusOr<ToolRun> info = RunTool({"info"}, absl::Seconds(60));
  ASSERT_TRUE(info.ok()) << info.status();
  // The line under "GPUs (...):" says whether there is one.
  const size_t gpus = info->out.find("\nGPUs (");
  ASSERT_NE(gpus, std::string::npos) << info->out;
  const size_t first = info->out.find('\n', gpus + 1);
  const std::string gpu_line = info->out.substr(first + 1, info->out.find('\n', first + 1) - first);
  if (absl::StartsWith(gpu_line, "  none usable")) {
    absl::StatusOr<ToolRun> run = RunTool({"demo", "--device", "cuda"}, absl::Seconds(60));
    ASSERT_TRUE(run.ok()) << run.status();
    EXPECT_EQ(run->exit_code, 1) << run->out;
    EXPECT_THAT(run->out, ::testing::Not(HasSubstr("step 1 loss")));
    GTEST_SKIP() << "no GPU here: the demo refused --device cuda, as it should";
  }
  std::string out;
  ASSERT_NO_FATAL_FAILURE(ExpectDemoTrains({"--device", "cuda"}, "grpc+verbs", &out));
  EXPECT_THAT(out, HasSubstr("weights and gradients on cuda:0"));
  EXPECT_THAT(out, HasSubstr("received into GPU memory directly, 0 through host memory"));
}

// The demo's GPU branch everywhere: against the libcudart stand-in (tests/support/
// fake_cudart.cc, whose device memory is shared memory that CUDA IPC maps between the demo's
// processes), direct and then over the proxy path.
TEST(ToolTest, DemoKeepsItsTensorsOnAStandInGpuDirectOrThroughHostMemory) {
  setenv("TENSORVERBS_CUDA_RUNTIME", TV_FAKE_CUDART_PATH, 1);  // for the demo's processes
  std::string out;
  ASSERT_NO_FATAL_FAILURE(ExpectDemoTrains({"--device", "cuda"}, "grpc+verbs", &out));
  EXPECT_THAT(out, HasSubstr("weights and gradients on cuda:0"));
  EXPECT_THAT(out, HasSubstr("received into GPU memory directly, 0 through host memory"));
  setenv("TENSORVERBS_GPU_DIRECT", "off", 1);
  ASSERT_NO_FATAL_FAILURE(ExpectDemoTrains({"--device", "cuda"}, "grpc+verbs", &out));
  EXPECT_THAT(out, HasSubstr(": 0 received into GPU memory directly"));
  unsetenv("TENSORVERBS_GPU_DIRECT");
  unsetenv("TENSORVERBS_CUDA_RUNTIME");
}

TEST(ToolTest, DemoRejectsAnUnknownProtocol) {
  auto p = support::Subprocess::Start(testing::ToolPath(), {"demo", "--protocol", "smoke-signals"});
  ASSERT_TRUE(p.ok());
  absl::StatusOr<int> rc = (*p)->Wait(absl::Seconds(30));
  ASSERT_TRUE(rc.ok());
  EXPECT_EQ(*rc, 2);
}

TEST(ToolTest, InfoListsBackendsProvidersAndConfiguration) {
  absl::StatusOr<ToolRun> run = RunTool({"info"}, absl::Seconds(60));
  ASSERT_TRUE(run.ok()) << run.status();
  const std::string& out = run->out;
  EXPECT_EQ(run->exit_code, 0) << out;
  EXPECT_THAT(out, HasSubstr("loopback  usable"));
  EXPECT_THAT(out, HasSubstr("ofi       "));
  EXPECT_THAT(out, HasSubstr("shm (shm)")) << "libfabric's shm provider is installed here";
  EXPECT_THAT(out,
              HasSubstr("would use: shm for peers on this host, tcp;ofi_rxm for remote peers"));
  EXPECT_THAT(out, HasSubstr("shmem     usable"));
  EXPECT_THAT(out, HasSubstr("shmem for the tasks on this host"));
  EXPECT_THAT(out, HasSubstr("memlock limit"));
  EXPECT_THAT(out, HasSubstr("TENSORVERBS_RECV_TIMEOUT_MS"));
  EXPECT_THAT(out, HasSubstr("RDMA devices (ibverbs"));
  EXPECT_THAT(out, HasSubstr("RDMA_QP_QUEUE_DEPTH 1024"));
  EXPECT_THAT(out, HasSubstr("endpoint-bound keys per channel")) << "what loopback offers";
  EXPECT_THAT(out, HasSubstr("one key per region for every peer")) << "what shmem offers";
  // The rails a count would take: every interface address explained, loopback passed over.
  EXPECT_THAT(out, HasSubstr("rails (TENSORVERBS_RAILS: further lanes"));
  EXPECT_THAT(out, HasSubstr("lo (127.0.0.1/8, NUMA node unknown): passed over, loopback"));
  EXPECT_THAT(out, HasSubstr("TENSORVERBS_RAILS unset: one lane"));
}

// One version, set in project() and reported by --version and info alike.
TEST(ToolTest, VersionIsSemanticAndTheSameEverywhere) {
  absl::StatusOr<ToolRun> version = RunTool({"--version"}, absl::Seconds(30));
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(version->exit_code, 0) << version->out;
  EXPECT_THAT(version->out, ::testing::MatchesRegex("tensorverbs [0-9]+\\.[0-9]+\\.[0-9]+\n"));
  const std::string number = std::string(absl::StripSuffix(version->out, "\n")).substr(12);
  absl::StatusOr<ToolRun> info = RunTool({"info"}, absl::Seconds(60));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_THAT(info->out, HasSubstr("tensorverbs " + number + " info"));
}

TEST(ToolTest, BenchFabricMeasuresEveryProviderAndWritesJson) {
  const ScopedTempDir dir;
  const std::string json = dir.File("bench_fabric.json");
  absl::StatusOr<ToolRun> run = RunTool({"bench", "fabric", "--sizes", "4B,64KiB", "--iters", "50",
                                         "--providers", "shm,tcp;ofi_rxm", "--json", json},
                                        absl::Seconds(240));
  ASSERT_TRUE(run.ok()) << run.status();
  const std::string& out = run->out;
  EXPECT_EQ(run->exit_code, 0) << out;
  EXPECT_THAT(out, HasSubstr("provider shm, 2 processes"));
  EXPECT_THAT(out, HasSubstr("provider tcp;ofi_rxm, 2 processes"));
  std::ifstream in(json);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Two providers x two sizes, each with a measured bandwidth.
  size_t rows = 0;
  for (size_t pos = 0; (pos = text.find("\"bandwidth_gbps\"", pos)) != std::string::npos; ++pos)
    ++rows;
  EXPECT_EQ(rows, 4u) << text;
  EXPECT_THAT(text, HasSubstr("\"size_bytes\": 65536"));
}

TEST(ToolTest, BenchFabricRunsTheShmemBackendBesideMemcpy) {
  const ScopedTempDir dir;
  const std::string json = dir.File("bench_fabric_shmem.json");
  absl::StatusOr<ToolRun> run = RunTool({"bench", "fabric", "--backend", "shmem", "--sizes",
                                         "4B,1MiB", "--iters", "50", "--json", json},
                                        absl::Seconds(240));
  ASSERT_TRUE(run.ok()) << run.status();
  const std::string& out = run->out;
  ASSERT_EQ(run->exit_code, 0) << out;
  EXPECT_THAT(out, HasSubstr("backend shmem, provider (default), 2 processes"));
  EXPECT_THAT(out, HasSubstr("x memcpy"));
  std::ifstream in(json);
  const nlohmann::json rows = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(rows.is_array()) << out;
  ASSERT_EQ(rows.size(), 2u) << "one backend, no provider list: one row per size";
  for (const nlohmann::json& r : rows) {
    EXPECT_EQ(r.value("backend", ""), "shmem");
    EXPECT_GT(r.value("bandwidth_gbps", 0.0), 0.0) << r;
    EXPECT_GT(r.value("memcpy_gbps", 0.0), 0.0) << r;
    EXPECT_GT(r.value("ratio_to_memcpy", 0.0), 0.0) << r;
  }
}

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
}

TEST(ToolTest, BenchP2PComparesEveryProtocolWithItsCeilings) {
  const ScopedTempDir dir;
  const std::string json = dir.File("bench_p2p.json");
  const std::string png = dir.File("bench_p2p.png");
  absl::StatusOr<ToolRun> run = RunTool({"bench", "p2p", "--sizes", "4B,64KiB", "--iters", "20",
                                         "--window", "4", "--json", json, "--plot", png},
                                        absl::Seconds(280));
  ASSERT_TRUE(run.ok()) << run.status();
  const std::string& out = run->out;
  ASSERT_EQ(run->exit_code, 0) << out;
  EXPECT_THAT(out, HasSubstr("memcpy between pre-faulted buffers"));
  // Every task is on this host, so the raw ceiling is the same-host fabric the protocols use.
  EXPECT_THAT(out, HasSubstr("fabric write-with-immediate, backend shmem"));
  EXPECT_THAT(out, HasSubstr("summary"));
  nlohmann::json rows = ReadJson(json);
  ASSERT_TRUE(rows.is_array()) << out;
  // Copies per transfer at 64 KiB, by design: grpc parses into the tensor once, the copy mode
  // copies in and out, zero copy and gdr copy nothing.
  const std::map<std::string, double> copies = {
      {"grpc", 1}, {"grpc+verbs-copy", 2}, {"grpc+gdr", 0}, {"grpc+verbs", 0}};
  std::map<std::string, int> seen;
  for (const nlohmann::json& r : rows) {
    const std::string protocol = r.value("protocol", "");
    ++seen[protocol];
    EXPECT_GT(r.value("bandwidth_gbps", 0.0), 0) << r.dump();
    if (copies.count(protocol) == 0) continue;
    EXPECT_GT(r.value("p50_us", 0.0), 0) << r.dump();
    EXPECT_GE(r.value("p99_us", 0.0), r.value("p50_us", 0.0)) << r.dump();
    EXPECT_GT(r.value("ratio_to_fabric_write", 0.0), 0) << r.dump();
    // Three measured repetitions (the default): the median lies within their range.
    EXPECT_EQ(r.value("repeat", 0), 3) << r.dump();
    EXPECT_LE(r.value("bandwidth_gbps_min", 1e9), r.value("bandwidth_gbps", 0.0)) << r.dump();
    EXPECT_LE(r.value("bandwidth_gbps", 1e9), r.value("bandwidth_gbps_max", 0.0)) << r.dump();
    EXPECT_LE(r.value("p50_us_min", 1e9), r.value("p50_us", 0.0)) << r.dump();
    EXPECT_LE(r.value("p50_us", 1e9), r.value("p50_us_max", 0.0)) << r.dump();
    if (r.value("size_bytes", 0) == 65536) {
      EXPECT_DOUBLE_EQ(r.value("copies_per_transfer", -1.0), copies.at(protocol)) << r.dump();
    }
  }
  for (const auto& [protocol, n] : copies) EXPECT_EQ(seen[protocol], 2) << protocol;
  EXPECT_EQ(seen["fabric-write"], 2);
  EXPECT_EQ(seen["memcpy"], 2);
  std::ifstream image(png, std::ios::binary);
  char magic[8] = {};
  image.read(magic, 8);
  EXPECT_EQ(std::string(magic + 1, 3), "PNG") << "a PNG plot was drawn";
  // A link rate limits the --netns link (tools/netns.h); without it there is no link to limit.
  absl::StatusOr<ToolRun> bad =
      RunTool({"bench", "p2p", "--link-rate", "2gbit", "--sizes", "4B"}, absl::Seconds(30));
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_EQ(bad->exit_code, 2);
  // So do rails, and at most 4 of them.
  for (std::vector<std::string> args : {std::vector<std::string>{"--rails", "2"},
                                        std::vector<std::string>{"--netns", "--rails", "5"}}) {
    args.insert(args.begin(), {"bench", "p2p"});
    args.insert(args.end(), {"--sizes", "4B"});
    absl::StatusOr<ToolRun> railed = RunTool(args, absl::Seconds(30));
    ASSERT_TRUE(railed.ok()) << railed.status();
    EXPECT_NE(railed->exit_code, 0) << absl::StrJoin(args, " ");
  }
}

TEST(ToolTest, BenchRateReportsTensorsPerSecondPerMessageSlotCountAndBatch) {
  const ScopedTempDir dir;
  const std::string json = dir.File("bench_rate.json");
  absl::StatusOr<ToolRun> run = RunTool(
      {"bench", "rate", "--protocols", "grpc+verbs,grpc", "--sizes", "4B", "--recvs", "2000",
       "--window", "64", "--slots", "1,8", "--batch", "1,16", "--repeat", "2", "--json", json},
      absl::Seconds(240));
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(run->exit_code, 0) << run->out;
  EXPECT_THAT(run->out, HasSubstr("grpc+verbs 4B: 8 slots, batch 16 = "));
  EXPECT_THAT(run->out, HasSubstr("grpc+verbs 4B: 1 slots, batch 16 = "));
  // The raw fabric's small-write rate, measured in the same run, is the ceiling it is set against.
  EXPECT_THAT(run->out, HasSubstr("rate relative to the raw fabric's small writes"));
  nlohmann::json rows = ReadJson(json);
  ASSERT_TRUE(rows.is_array());
  ASSERT_EQ(rows.size(), 5u) << rows.dump();  // grpc+verbs with 1 and 8 slots x 2 batches, grpc
  std::set<std::pair<int, int>> configs;
  for (const nlohmann::json& r : rows) {
    EXPECT_GT(r.value("tensors_per_s", 0.0), 0) << r.dump();
    EXPECT_EQ(r.value("recvs", 0), 2000) << r.dump();
    EXPECT_EQ(r.value("repeat", 0), 2) << r.dump();
    EXPECT_LE(r.value("tensors_per_s_min", 1e12), r.value("tensors_per_s", 0.0)) << r.dump();
    EXPECT_LE(r.value("tensors_per_s", 1e12), r.value("tensors_per_s_max", 0.0)) << r.dump();
    EXPECT_GT(r.value("fabric_writes_per_s", 0.0), 0) << r.dump();
    EXPECT_GT(r.value("ratio_to_fabric_writes", 0.0), 0) << r.dump();
    configs.insert({r.value("message_slots", -1), r.value("message_batch", -1)});
  }
  EXPECT_EQ(configs, (std::set<std::pair<int, int>>{{0, 0}, {1, 1}, {1, 16}, {8, 1}, {8, 16}}));
  // Bad counts are refused (a usage error) before anything starts.
  run = RunTool({"bench", "rate", "--batch", "0"}, absl::Seconds(30));
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->exit_code, 2);
  EXPECT_EQ(run->out, "");
}

TEST(ToolTest, BenchPsRunsTrainingStepsOfARealModelOverEveryProtocol) {
  const ScopedTempDir dir;
  const std::string json = dir.File("bench_ps.json");
  absl::StatusOr<ToolRun> run = RunTool({"bench", "ps", "--model", "resnet50", "--workers", "1",
                                         "--steps", "2", "--warmup", "1", "--json", json},
                                        absl::Seconds(280));
  ASSERT_TRUE(run.ok()) << run.status();
  const std::string& out = run->out;
  ASSERT_EQ(run->exit_code, 0) << out;
  EXPECT_THAT(out, HasSubstr("resnet50 (161 variables, 25.56 M parameters"));
  EXPECT_THAT(out, HasSubstr("zero copy (grpc+verbs) vs second place"));
  nlohmann::json rows = ReadJson(json);
  ASSERT_TRUE(rows.is_array());
  ASSERT_EQ(rows.size(), 4u) << rows.dump();
  for (const nlohmann::json& r : rows) {
    EXPECT_GT(r.value("step_ms_p50", 0.0), 0) << r.dump();
    EXPECT_GT(r.value("throughput_gbps", 0.0), 0) << r.dump();
    if (r.value("protocol", "") == "grpc+verbs") {
      EXPECT_EQ(r.value("copies_per_step", -1.0), 0) << "zero copy in steady state";
    }
  }
}

TEST(ToolTest, BenchScaleReportsEachTaskCountsCosts) {
  const ScopedTempDir dir;
  const std::string json = dir.File("bench_scale.json");
  absl::StatusOr<ToolRun> run = RunTool(
      {"bench", "scale", "--tasks", "2,3", "--steps", "3", "--json", json}, absl::Seconds(120));
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(run->exit_code, 0) << run->out;
  nlohmann::json rows = ReadJson(json);
  ASSERT_TRUE(rows.is_array());
  ASSERT_EQ(rows.size(), 2u) << rows.dump();
  for (const nlohmann::json& r : rows) {
    const int n = r.value("tasks", 0);
    // Every task sets up a channel each way with every peer.
    EXPECT_EQ(r.value("channels_per_task", 0.0), 2.0 * (n - 1)) << r.dump();
    EXPECT_GT(r.value("setup_ms", 0.0), 0) << r.dump();
    EXPECT_GT(r.value("step_ms_p50", 0.0), 0) << r.dump();
    EXPECT_GT(r.value("fds_per_task", 0.0), 0) << r.dump();
    EXPECT_GT(r.value("threads_per_task", 0.0), 1) << r.dump();
    EXPECT_GT(r.value("pss_mib_per_task", 0.0), 0) << r.dump();
    // Once all reported, each task (n <= 16) timed its idle turns alone.
    EXPECT_GT(r.value("quiet_turn_us", 0.0), 0) << r.dump();
    EXPECT_GT(r.value("quiet_turn_cpu_us_max", 0.0), 0) << r.dump();
    EXPECT_EQ(r.value("quiet_turn_max_channels", 0), 2 * (n - 1)) << r.dump();
  }
  run = RunTool({"bench", "scale", "--tasks", "1"}, absl::Seconds(30));
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->exit_code, 2) << "a cluster of one task has nothing to measure";
}

// --start gated: every task's server stands before any task's set-up is timed; the launcher
// says "go" to each. Under srun the tasks share one input, so it is refused there.
TEST(ToolTest, BenchScaleGatedStartTimesTheSetUpOnceEveryTaskStands) {
  const ScopedTempDir dir;
  const std::string json = dir.File("bench_scale_gated.json");
  absl::StatusOr<ToolRun> run = RunTool(
      {"bench", "scale", "--tasks", "3", "--steps", "2", "--start", "gated", "--json", json},
      absl::Seconds(120));
  ASSERT_TRUE(run.ok()) << run.status();
  ASSERT_EQ(run->exit_code, 0) << run->out;
  nlohmann::json rows = ReadJson(json);
  ASSERT_TRUE(rows.is_array() && rows.size() == 1u) << rows.dump();
  EXPECT_EQ(rows[0].value("start", ""), "gated") << rows[0].dump();
  EXPECT_GT(rows[0].value("setup_ms", 0.0), 0) << rows[0].dump();
  EXPECT_GT(rows[0].value("setup_cpu_ms_p50", 0.0), 0) << rows[0].dump();
  EXPECT_EQ(rows[0].value("channels_per_task", 0.0), 4.0) << rows[0].dump();
  run = RunTool({"bench", "scale", "--tasks", "3", "--launcher", "srun", "--start", "gated"},
                absl::Seconds(30));
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->exit_code, 2) << "refused before srun is looked for";
}

TEST(ToolTest, BenchScaleParameterServerLayoutSetsUpOnlyWorkerToServerChannels) {
  // 5 tasks, 2 of them parameter servers: channels come up with each pair's first tensor, so
  // each server has one each way with each of the 3 workers (6) and each worker one each way
  // with each server (4): 24 in all, 4.8 per task, where an all-to-all makes 8 each. Asking for
  // every channel at start makes 8 each whatever the layout.
  const ScopedTempDir dir;
  for (const char* channels : {"on-demand", "at-start"}) {
    const std::string json = dir.File(absl::StrCat("bench_scale_ps_", channels, ".json"));
    absl::StatusOr<ToolRun> run = RunTool({"bench", "scale", "--tasks", "5", "--pattern", "ps:2",
                                           "--channels", channels, "--steps", "2", "--json", json},
                                          absl::Seconds(120));
    ASSERT_TRUE(run.ok()) << run.status();
    ASSERT_EQ(run->exit_code, 0) << run->out;
    nlohmann::json rows = ReadJson(json);
    ASSERT_TRUE(rows.is_array() && rows.size() == 1u) << rows.dump();
    EXPECT_DOUBLE_EQ(rows[0].value("channels_per_task", 0.0),
                     std::string(channels) == "on-demand" ? 4.8 : 8.0)
        << channels << ": " << rows[0].dump();
    EXPECT_GT(rows[0].value("step_ms_p50", 0.0), 0) << rows[0].dump();
  }
  absl::StatusOr<ToolRun> bad =
      RunTool({"bench", "scale", "--tasks", "2", "--pattern", "ps:2"}, absl::Seconds(30));
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_EQ(bad->exit_code, 2) << "two parameter servers and no worker";
}

TEST(ToolTest, BenchScaleCountsOneLibfabricEndpointPerTaskWhateverItsChannels) {
  // Three tasks over libfabric (shm, every task on this host), each with a channel each way to
  // both peers: the channels share their task's one libfabric endpoint, unless told not to.
  const ScopedTempDir dir;
  setenv("TENSORVERBS_FABRIC", "ofi", 1);
  for (const char* shared : {"on", "off"}) {
    setenv("TENSORVERBS_OFI_SHARED_ENDPOINT", shared, 1);
    const std::string json = dir.File(absl::StrCat("bench_scale_", shared, ".json"));
    absl::StatusOr<ToolRun> run = RunTool(
        {"bench", "scale", "--tasks", "3", "--steps", "2", "--json", json}, absl::Seconds(120));
    ASSERT_TRUE(run.ok()) << run.status();
    ASSERT_EQ(run->exit_code, 0) << run->out;
    nlohmann::json rows = ReadJson(json);
    ASSERT_TRUE(rows.is_array() && rows.size() == 1u) << rows.dump();
    EXPECT_EQ(rows[0].value("channels_per_task", 0.0), 4.0) << rows[0].dump();
    EXPECT_EQ(rows[0].value("endpoints_per_task", 0.0), std::string(shared) == "on" ? 1.0 : 4.0)
        << shared << ": " << rows[0].dump();
  }
  unsetenv("TENSORVERBS_OFI_SHARED_ENDPOINT");
  unsetenv("TENSORVERBS_FABRIC");
}

TEST(ToolTest, BenchModelsAreTheirPublishedSizes) {
  // The variable lists are generated from the architectures: check them against the
  // published trainable-parameter counts.
  for (const auto& [model, expect] : std::vector<std::pair<std::string, std::string>>{
           {"vgg16", "32 variables, 138.36 M parameters"},
           {"resnet50", "161 variables, 25.56 M parameters"},
           {"inception3", "196 variables, 27.14 M parameters"}}) {
    absl::StatusOr<ToolRun> run =
        RunTool({"bench", "ps", "--model", model, "--workers", "1", "--steps", "1", "--warmup", "0",
                 "--protocols", "grpc+verbs"},
                absl::Seconds(200));
    ASSERT_TRUE(run.ok()) << run.status();
    EXPECT_EQ(run->exit_code, 0) << run->out;
    EXPECT_THAT(run->out, HasSubstr(model + " (" + expect)) << run->out;
  }
}

TEST(ToolTest, ServerRunsUntilSigtermAndShutsDownCleanly) {
  absl::StatusOr<std::vector<int>> ports = PickFreePorts(1);
  ASSERT_TRUE(ports.ok());
  std::unique_ptr<support::Subprocess> server;
  std::string line;
  ASSERT_NO_FATAL_FAILURE(StartServer({"--cluster", absl::StrCat("ps=127.0.0.1:", (*ports)[0]),
                                       "--job", "ps", "--task", "0", "--protocol", "grpc"},
                                      &server, &line));
  EXPECT_THAT(line, HasSubstr("/job:ps/replica:0/task:0 serving protocol grpc"));
  ExpectCleanShutdown(*server);
}

// Under Slurm the server takes its cluster, job and task from srun's variables; without them it
// exits with a usage error (placement_test checks each message).
TEST(ToolTest, ServerTakesItsPlaceFromSlurm) {
  absl::StatusOr<std::vector<int>> ports = PickFreePorts(1);
  ASSERT_TRUE(ports.ok());
  for (const char* v : {"SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS"}) {
    unsetenv(v);
  }
  {
    auto p = support::Subprocess::Start(testing::ToolPath(), {"server", "--cluster-from", "slurm"});
    ASSERT_TRUE(p.ok());
    absl::StatusOr<int> rc = (*p)->Wait(absl::Seconds(30));
    ASSERT_TRUE(rc.ok()) << rc.status();
    EXPECT_EQ(*rc, 2) << "no SLURM_JOB_NODELIST: a usage error";
  }
  setenv("SLURM_JOB_NODELIST", "127.0.0.1", 1);
  setenv("SLURM_TASKS_PER_NODE", "2", 1);
  setenv("SLURM_PROCID", "1", 1);
  setenv("TENSORVERBS_SLURM_PORT", absl::StrCat((*ports)[0] - 1).c_str(), 1);
  setenv("TENSORVERBS_SLURM_JOBS", "ps:1,worker:1", 1);
  std::unique_ptr<support::Subprocess> server;
  std::string line;
  StartServer({"--cluster-from", "slurm", "--protocol", "grpc"}, &server, &line);
  for (const char* v : {"SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE", "SLURM_PROCID",
                        "TENSORVERBS_SLURM_PORT", "TENSORVERBS_SLURM_JOBS"}) {
    unsetenv(v);
  }
  ASSERT_NE(server, nullptr);
  EXPECT_THAT(line, HasSubstr(absl::StrCat("/job:worker/replica:0/task:0 serving protocol grpc on "
                                           "127.0.0.1:",
                                           (*ports)[0])));
  ExpectCleanShutdown(*server);
}

// The security options reach every task the tools start: a demo whose tasks share a secret
// trains, and a server started with one refuses a caller without its proof.
TEST(ToolTest, ServerAndDemoTakeTheSecurityOptions) {
  ScopedTempDir dir;
  const std::string secret = dir.File("secret");
  std::ofstream(secret) << "a cluster secret for the tool test\n";
  ASSERT_EQ(::chmod(secret.c_str(), 0600), 0);
  ASSERT_NO_FATAL_FAILURE(ExpectDemoTrains({"--secret-file", secret}, "grpc+verbs"));
  // The flag reaches the tasks: one they cannot use stops the demo with the setting named.
  const std::string short_secret = dir.File("short");
  std::ofstream(short_secret) << "short\n";
  ASSERT_EQ(::chmod(short_secret.c_str(), 0600), 0);
  auto demo = support::Subprocess::Start(
      "/bin/sh", {"-c", absl::StrCat("exec '", testing::ToolPath(),
                                     "' demo --steps 2 --secret-file '", short_secret, "' 2>&1")});
  ASSERT_TRUE(demo.ok()) << demo.status();
  absl::StatusOr<std::string> failed =
      (*demo)->WaitForLine("tensorverbs demo: task", absl::Seconds(60));
  ASSERT_TRUE(failed.ok()) << failed.status();
  EXPECT_THAT(*failed, HasSubstr("TENSORVERBS_SECRET_FILE"));
  EXPECT_THAT(*failed, HasSubstr("at least 16"));
  absl::StatusOr<int> demo_rc = (*demo)->Wait(absl::Seconds(60));
  ASSERT_TRUE(demo_rc.ok()) << demo_rc.status();
  EXPECT_NE(*demo_rc, 0);

  absl::StatusOr<std::vector<int>> ports = PickFreePorts(1);
  ASSERT_TRUE(ports.ok());
  const std::string address = absl::StrCat("127.0.0.1:", (*ports)[0]);
  std::unique_ptr<support::Subprocess> server;
  std::string line;
  ASSERT_NO_FATAL_FAILURE(
      StartServer({"--cluster", absl::StrCat("ps=", address), "--job", "ps", "--task", "0",
                   "--protocol", "grpc", "--secret-file", secret},
                  &server, &line));
  auto stub = proto::WorkerService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  proto::GetStatusResponse response;
  const grpc::Status outsider = stub->GetStatus(&context, proto::GetStatusRequest(), &response);
  EXPECT_EQ(outsider.error_code(), grpc::StatusCode::UNAUTHENTICATED) << outsider.error_message();
  ExpectCleanShutdown(*server);
}

// A running server answers `tensorverbs stats` as a table, JSON and Prometheus' format, and
// keeps the metrics file it was given up to date; a task that is not there is a clear error.
TEST(ToolTest, StatsShowsARunningTaskAndTheServerWritesItsMetricsFile) {
  ScopedTempDir dir;
  const std::string metrics = dir.File("tensorverbs.prom");
  absl::StatusOr<std::vector<int>> ports = PickFreePorts(2);
  ASSERT_TRUE(ports.ok());
  const std::string address = absl::StrCat("127.0.0.1:", (*ports)[0]);
  std::unique_ptr<support::Subprocess> server;
  std::string line;
  ASSERT_NO_FATAL_FAILURE(StartServer(
      {"--cluster", absl::StrCat("ps=", address), "--job", "ps", "--task", "0", "--protocol",
       "grpc+verbs", "--metrics-file", metrics, "--metrics-interval-ms", "100"},
      &server, &line));

  absl::StatusOr<ToolRun> table = RunTool({"stats", address}, absl::Seconds(30));
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->exit_code, 0) << table->out;
  EXPECT_THAT(table->out, HasSubstr("task /job:ps/replica:0/task:0  protocol grpc+verbs over "));
  EXPECT_THAT(table->out, HasSubstr("tensors_received"));
  absl::StatusOr<ToolRun> json = RunTool({"stats", address, "--json"}, absl::Seconds(30));
  ASSERT_TRUE(json.ok()) << json.status();
  const nlohmann::json j = nlohmann::json::parse(json->out);
  EXPECT_EQ(j["task"], "/job:ps/replica:0/task:0");
  EXPECT_EQ(j["counters"]["tensors_received"], 0);
  absl::StatusOr<ToolRun> prom = RunTool({"stats", address, "--prometheus"}, absl::Seconds(30));
  ASSERT_TRUE(prom.ok()) << prom.status();
  EXPECT_THAT(prom->out, HasSubstr("# TYPE tensorverbs_tensors_received_total counter\n"));

  // The file appears within a few intervals and holds the same families.
  std::string contents;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (contents.find("tensorverbs_up_seconds") == std::string::npos && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
    std::stringstream read;
    read << std::ifstream(metrics).rdbuf();
    contents = read.str();
  }
  EXPECT_THAT(contents, HasSubstr("tensorverbs_pool_bytes{task=\"/job:ps/replica:0/task:0\"}"));
  ExpectCleanShutdown(*server);

  absl::StatusOr<ToolRun> nobody =
      RunTool({"stats", absl::StrCat("127.0.0.1:", (*ports)[1]), "--timeout-ms", "1000"},
              absl::Seconds(30));
  ASSERT_TRUE(nobody.ok()) << nobody.status();
  EXPECT_EQ(nobody->exit_code, 1);
}

TEST(ToolTest, ServerBadInputExitsWithAMessage) {
  struct Case {
    std::vector<std::string> args;
    int code;
  };
  const std::vector<Case> cases = {
      {{"server", "--cluster", "ps=nohost", "--job", "ps", "--task", "0"}, 2},
      {{"server", "--cluster", "ps=127.0.0.1:1", "--job", "worker", "--task", "0"}, 1},
      {{"server", "--cluster", "ps=127.0.0.1:1", "--job", "ps", "--task", "3"}, 1},
      {{"server", "--cluster", "ps=127.0.0.1:1", "--job", "ps", "--task", "0", "--protocol", "x"},
       1},
      {{"server", "--job", "ps"}, 2},  // no cluster, and no --cluster-from
      {{"server", "--cluster-from", "slurm", "--job", "ps"}, 2},
      {{"server", "--cluster-from", "k8s"}, 105},  // CLI11: not one of the choices
  };
  for (const Case& c : cases) {
    auto p = support::Subprocess::Start(testing::ToolPath(), c.args);
    ASSERT_TRUE(p.ok());
    absl::StatusOr<int> rc = (*p)->Wait(absl::Seconds(30));
    ASSERT_TRUE(rc.ok());
    EXPECT_EQ(*rc, c.code) << c.args[2];
  }
}

}  // namespace
}  // namespace tensorverbs
