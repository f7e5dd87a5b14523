// tensorverbs: the command-line tool. `tensorverbs --help` lists the subcommands.
#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_join.h"
#include "src/common/config.h"
#include "src/server/server.h"
#include "tensorverbs/version.h"
#include "tools/bench_cluster.h"
#include "tools/commands.h"

int main(int argc, char** argv) {
  using namespace tensorverbs::tools;
  // Each line as it is printed, also into a pipe or a file (`| tee`, a test reading the output
  // of a run that hangs): a benchmark's rows are minutes apart, and a line is cheap.
  setvbuf(stdout, nullptr, _IOLBF, 0);
  // The bench launchers (ps, scale, p2p and fabric peers) write to their children's input: a child
  // that died must turn that write into an error naming it ("closed its input"), not kill the
  // launcher before it reports and cleans up its namespaces.
  signal(SIGPIPE, SIG_IGN);
  CLI::App app{"tensorverbs: RDMA tensor transport (grpc, grpc+verbs) with server, demo and tools"};
  app.set_version_flag("--version", std::string("tensorverbs ") + tensorverbs::Version());
  app.require_subcommand(1);
  const std::string protocols = absl::StrJoin(tensorverbs::AvailableProtocols(), ", ");

  ServerCommandOptions server;
  CLI::App* server_cmd =
      app.add_subcommand("server", "Run one task of a cluster until SIGTERM/SIGINT");
  server_cmd->add_option("--cluster", server.cluster,
                         "Cluster spec: ps=host:port;worker=host:port,host:port or JSON");
  server_cmd->add_option("--job", server.job, "This task's job name");
  server_cmd->add_option("--task", server.task, "This task's index in its job");
  server_cmd
      ->add_option("--cluster-from", server.cluster_from,
                   "Take the cluster, job and task from the launcher: slurm (SLURM_* and "
                   "TENSORVERBS_SLURM_JOBS/_PORT) or tf_config (TF_CONFIG)")
      ->check(CLI::IsMember({"slurm", "tf_config"}));
  server_cmd->add_option("--protocol", server.protocol, "Protocol (" + protocols + ")")
      ->default_val("grpc");
  server_cmd->add_flag("--wait-for-peers", server.wait_for_peers,
                       "Wait until every other task answers (TENSORVERBS_CONNECT_TIMEOUT_MS)");
  server_cmd->add_option("--metrics-file", server.metrics_file,
                         "Write the task's counters there in Prometheus' text format (the "
                         "node exporter's textfile collector reads *.prom files)");
  server_cmd
      ->add_option("--metrics-interval-ms", server.metrics_interval_ms,
                   "How often the metrics file is rewritten")
      ->default_val(10000);

  StatsCommandOptions stats;
  CLI::App* stats_cmd =
      app.add_subcommand("stats", "Show a running task's counters and channels (its GetStats RPC)");
  stats_cmd->add_option("address", stats.address, "host:port of the task")->required();
  stats_cmd->add_flag("--json", stats.json, "Print JSON instead of a table");
  stats_cmd->add_flag("--prometheus", stats.prometheus, "Print Prometheus' text format");
  stats_cmd->add_option("--as", stats.as_task,
                        "With security configured: the task of the cluster whose credentials "
                        "the call presents");
  stats_cmd->add_option("--timeout-ms", stats.timeout_ms, "How long to wait for the answer")
      ->default_val(10000);

  DemoOptions demo;
  CLI::App* demo_cmd =
      app.add_subcommand("demo", "Train a small model with 1 ps + K workers as local processes");
  demo_cmd->add_option("--protocol", demo.protocol,
                       "Protocol (" + protocols + "); default: the best available");
  demo_cmd->add_option("--steps", demo.steps, "Training steps")->default_val(20);
  demo_cmd->add_option("--workers", demo.workers, "Worker tasks")->default_val(2);
  demo_cmd->add_option("--learning-rate", demo.learning_rate, "SGD learning rate")
      ->default_val(0.2);
  demo_cmd
      ->add_option("--device", demo.device,
                   "Where weights and gradients live and travel: cpu or cuda[:N] (the math "
                   "runs on the CPU either way)")
      ->default_val(demo.device);
  demo_cmd
      ->add_option("--launcher", demo.launcher,
                   "local: the tasks are processes of this host; srun: one Slurm job step of "
                   "1 + workers tasks, placed by Slurm (TENSORVERBS_SLURM_PORT is the first "
                   "task port of each node)")
      ->check(CLI::IsMember({"local", "srun"}))
      ->default_val(demo.launcher);

  CLI::App* info_cmd = app.add_subcommand(
      "info", "Show the fabric backends and providers usable here and the configuration");
  std::string settings_table;
  info_cmd->add_option("--settings-markdown", settings_table,
                       "Print the README's table of the settings instead: tensorverbs or rdma");

  BenchFabricOptions bench;
  CLI::App* bench_cmd = app.add_subcommand("bench", "Benchmarks");
  bench_cmd->require_subcommand(1);
  CLI::App* bench_fabric = bench_cmd->add_subcommand(
      "fabric", "Write-with-immediate bandwidth and latency per size between two processes");
  bench_fabric->add_option("--backend", bench.backend, "Fabric backend (shmem, ofi, loopback)")
      ->default_val("ofi");
  bench_fabric->add_option("--providers", bench.providers, "Comma-separated libfabric providers")
      ->default_val("shm,tcp;ofi_rxm");
  bench_fabric->add_option("--sizes", bench.sizes, "Comma-separated sizes: 4B,4KiB,1MiB,...")
      ->default_val("4B,64B,1KiB,4KiB,64KiB,1MiB,16MiB,64MiB,256MiB");
  bench_fabric->add_option("--iters", bench.iters, "Iterations per size (default: by size)");
  bench_fabric->add_option("--window", bench.window, "Writes in flight for bandwidth")
      ->default_val(16);
  bench_fabric->add_flag("!--no-compare", bench.compare, "Do not run fi_pingpong");
  bench_fabric->add_option("--json", bench.json, "Write JSON rows to this file");

  BenchP2POptions p2p;
  CLI::App* bench_p2p = bench_cmd->add_subcommand(
      "p2p", "Protocol bandwidth, latency, copies and CPU per size between two processes");
  bench_p2p->add_option("--sizes", p2p.sizes, "Comma-separated sizes: 4B,4KiB,1MiB,...")
      ->default_val(p2p.sizes);
  bench_p2p->add_option("--protocols", p2p.protocols,
                        "Comma-separated protocols (" + protocols + "); default: all");
  bench_p2p->add_option("--json", p2p.json, "Write JSON rows to this file");
  bench_p2p->add_option("--plot", p2p.plot, "Draw bandwidth and latency into this PNG");
  bench_p2p->add_flag("--netns", p2p.netns,
                      "Run the peer in its own network namespace joined by veth (root)");
  bench_p2p->add_option("--link-rate", p2p.link_rate,
                        "With --netns, limit the link to this rate each way (tc tbf: 2gbit, "
                        "500mbit), as a NIC of that speed; with --rails, a comma-separated "
                        "rate per rail (2gbit,1gbit), the last for the rails after it");
  bench_p2p
      ->add_option("--rails", p2p.rails,
                   "With --netns, join the hosts by this many links (1..4), each at its "
                   "--link-rate, with a lane of every channel on each (TENSORVERBS_RAILS)")
      ->check(CLI::Range(1, 4));
  bench_p2p->add_flag("--mixed", p2p.mixed,
                      "Each protocol as a pair alone on this host, then inside a cluster of two "
                      "hosts (a third task in a network namespace; root): the same-host pair and "
                      "a cross-host pair, each over its own fabric");
  bench_p2p->add_option("--iters", p2p.iters, "Recvs per size and phase (default: by size)");
  bench_p2p->add_option("--window", p2p.window,
                        "Recvs outstanding for bandwidth (default: by size)");
  bench_p2p->add_option("--poll-mode", p2p.poll_mode, "busy, blocking or adaptive");
  bench_p2p->add_option("--callback-threads", p2p.callback_threads,
                        "Recv callback threads; 0 runs them inline (default: environment)");
  bench_p2p->add_flag("!--no-baselines", p2p.baselines, "Do not measure the raw fabric");
  bench_p2p
      ->add_option("--device", p2p.device,
                   "Where tensors live: SRC[,DST], each cpu, cuda or cuda:N (one value: both)")
      ->default_val(p2p.device);
  bench_p2p
      ->add_option("--repeat", p2p.repeat,
                   "Measured repetitions per size after a warm-up; medians and ranges")
      ->default_val(p2p.repeat)
      ->check(CLI::Range(1, 100));

  BenchRateOptions rate;
  CLI::App* bench_rate = bench_cmd->add_subcommand(
      "rate", "Small tensors per second with many recvs outstanding, per message-slot count");
  bench_rate->add_option("--sizes", rate.sizes, "Comma-separated sizes")->default_val(rate.sizes);
  bench_rate->add_option("--protocols", rate.protocols, "Comma-separated protocols; default: all");
  bench_rate->add_option("--slots", rate.slots, "Message-slot counts for the verbs protocols")
      ->default_val(rate.slots);
  bench_rate
      ->add_option("--batch", rate.batch,
                   "Most control messages per slot, comma-separated (1: the seed's one)")
      ->default_val(rate.batch);
  bench_rate->add_flag("--netns", rate.netns,
                       "Run the peer in its own network namespace joined by veth (root)");
  bench_rate->add_option("--recvs", rate.recvs, "Recvs per configuration")->default_val(rate.recvs);
  bench_rate->add_option("--window", rate.window, "Recvs outstanding")->default_val(rate.window);
  bench_rate->add_option("--json", rate.json, "Write JSON rows to this file");
  bench_rate->add_option("--poll-mode", rate.poll_mode, "busy, blocking or adaptive");
  bench_rate->add_option("--callback-threads", rate.callback_threads,
                         "Recv callback threads; 0 runs them inline (default: environment)");
  bench_rate
      ->add_option("--repeat", rate.repeat,
                   "Measured repetitions per configuration; medians and ranges")
      ->default_val(rate.repeat)
      ->check(CLI::Range(1, 100));
  bench_rate->add_flag("!--no-baselines", rate.baselines,
                       "Do not measure the raw fabric's small-write rate");

  BenchPsOptions ps;
  CLI::App* bench_ps = bench_cmd->add_subcommand(
      "ps", "Parameter-server training steps of VGG16, ResNet-50 or Inception v3 per protocol");
  bench_ps->add_option("--model", ps.models, "vgg16, resnet50, inception3, comma-separated, or all")
      ->default_val(ps.models);
  bench_ps->add_option("--workers", ps.workers, "Worker counts, comma-separated")
      ->default_val(ps.workers);
  bench_ps->add_option("--ps", ps.ps, "Parameter-server tasks")->default_val(ps.ps);
  bench_ps->add_option("--protocols", ps.protocols, "Comma-separated protocols; default: all");
  bench_ps->add_option("--steps", ps.steps, "Measured steps")->default_val(ps.steps);
  bench_ps->add_option("--warmup", ps.warmup, "Warm-up steps")->default_val(ps.warmup);
  bench_ps->add_flag("--netns", ps.netns, "Every task in its own network namespace (root)");
  bench_ps->add_option("--hosts", ps.hosts,
                       "With --netns: this many hosts, the tasks spread over them in blocks");
  bench_ps->add_option("--fabrics", ps.fabrics,
                       "TENSORVERBS_FABRIC values to run in turn, comma-separated (auto,ofi)");
  bench_ps->add_option("--json", ps.json, "Write JSON rows to this file");
  bench_ps->add_option("--poll-mode", ps.poll_mode, "busy, blocking or adaptive");
  bench_ps
      ->add_option("--launcher", ps.launcher,
                   "local: processes of this host (or --netns); srun: each run one Slurm job "
                   "step, the tasks placed by Slurm")
      ->check(CLI::IsMember({"local", "srun"}))
      ->default_val(ps.launcher);

  BenchPsTaskOptions ps_task;
  CLI::App* ps_task_cmd = app.add_subcommand("bench-ps-task", "One task of bench ps");
  ps_task_cmd->group("");
  ps_task_cmd->add_option("--cluster", ps_task.cluster);
  ps_task_cmd->add_option("--job", ps_task.job);
  ps_task_cmd->add_option("--task", ps_task.task);
  ps_task_cmd->add_option("--cluster-from", ps_task.cluster_from)
      ->check(CLI::IsMember({"slurm", "tf_config"}));
  ps_task_cmd->add_option("--model", ps_task.model)->required();
  ps_task_cmd->add_option("--workers", ps_task.workers)->required();
  ps_task_cmd->add_option("--steps", ps_task.steps)->required();
  ps_task_cmd->add_option("--warmup", ps_task.warmup)->required();
  ps_task_cmd->add_option("--step-base", ps_task.step_base)->required();
  ps_task_cmd->add_option("--protocol", ps_task.server.protocol)->required();
  ps_task_cmd->add_option("--message-slots", ps_task.server.message_slots);
  ps_task_cmd->add_option("--message-batch", ps_task.server.message_batch);
  ps_task_cmd->add_option("--poll-mode", ps_task.server.poll_mode);
  ps_task_cmd->add_option("--fabric", ps_task.server.fabric);
  ps_task_cmd->add_option("--callback-threads", ps_task.server.callback_threads);

  BenchScaleOptions scale;
  CLI::App* bench_scale = bench_cmd->add_subcommand(
      "scale",
      "Set-up, first and steady all-to-all step, memory, descriptors and threads per "
      "task count");
  bench_scale->add_option("--tasks", scale.tasks, "Task counts, comma-separated")
      ->default_val(scale.tasks);
  bench_scale->add_option("--protocol", scale.protocol)->default_val(scale.protocol);
  bench_scale->add_option("--steps", scale.steps, "Measured steps")->default_val(scale.steps);
  bench_scale->add_option("--bytes", scale.bytes, "Size of each all-to-all tensor")
      ->default_val(scale.bytes);
  bench_scale->add_flag("--netns", scale.netns, "Tasks in network namespaces (root)");
  bench_scale->add_option("--hosts", scale.hosts,
                          "With --netns: this many hosts, the tasks spread over them in blocks");
  bench_scale->add_option("--json", scale.json, "Write JSON rows to this file");
  bench_scale->add_option("--poll-mode", scale.poll_mode, "busy, blocking or adaptive");
  bench_scale
      ->add_option("--launcher", scale.launcher,
                   "local: processes of this host (or --netns); srun: each task count one Slurm "
                   "job step, the tasks placed by Slurm")
      ->check(CLI::IsMember({"local", "srun"}))
      ->default_val(scale.launcher);
  bench_scale
      ->add_option("--pattern", scale.pattern,
                   "all-to-all: every task exchanges with every other each step; ps:K: each "
                   "worker with the K parameter servers (tasks 0..K-1) alone")
      ->default_val(scale.pattern);
  bench_scale
      ->add_option("--channels", scale.channels,
                   "on-demand: each channel is set up by its pair's first tensor; at-start: "
                   "set-up also makes a channel to every peer")
      ->check(CLI::IsMember({"on-demand", "at-start"}))
      ->default_val(scale.channels);
  bench_scale
      ->add_option("--start", scale.start,
                   "as-launched: a task's set-up is timed from its own start, while the others "
                   "may still start; gated: from the moment every task's server stands (not "
                   "with --launcher srun)")
      ->check(CLI::IsMember({"as-launched", "gated"}))
      ->default_val(scale.start);

  BenchScaleTaskOptions scale_task;
  CLI::App* scale_task_cmd = app.add_subcommand("bench-scale-task", "One task of bench scale");
  scale_task_cmd->group("");
  scale_task_cmd->add_option("--cluster", scale_task.cluster);
  scale_task_cmd->add_option("--job", scale_task.job);
  scale_task_cmd->add_option("--task", scale_task.task);
  scale_task_cmd->add_option("--cluster-from", scale_task.cluster_from)
      ->check(CLI::IsMember({"slurm", "tf_config"}));
  scale_task_cmd->add_option("--steps", scale_task.steps)->required();
  scale_task_cmd->add_option("--bytes", scale_task.bytes)->required();
  scale_task_cmd->add_flag("--channels-at-start", scale_task.channels_at_start);
  scale_task_cmd->add_flag("--gated", scale_task.gated);
  scale_task_cmd->add_option("--ps", scale_task.ps);
  scale_task_cmd->add_option("--protocol", scale_task.server.protocol)->required();
  scale_task_cmd->add_option("--message-slots", scale_task.server.message_slots);
  scale_task_cmd->add_option("--message-batch", scale_task.server.message_batch);
  scale_task_cmd->add_option("--poll-mode", scale_task.server.poll_mode);
  scale_task_cmd->add_option("--fabric", scale_task.server.fabric);
  scale_task_cmd->add_option("--callback-threads", scale_task.server.callback_threads);

  BenchPeerOptions bench_peer;
  CLI::App* bench_peer_cmd = app.add_subcommand("bench-peer", "Sender side of bench p2p/rate");
  bench_peer_cmd->group("");
  bench_peer_cmd->add_option("--cluster", bench_peer.cluster)->required();
  bench_peer_cmd->add_option("--job", bench_peer.job)->required();
  bench_peer_cmd->add_option("--task", bench_peer.task)->required();
  bench_peer_cmd->add_option("--protocol", bench_peer.server.protocol)->required();
  bench_peer_cmd->add_option("--message-slots", bench_peer.server.message_slots);
  bench_peer_cmd->add_option("--message-batch", bench_peer.server.message_batch);
  bench_peer_cmd->add_option("--poll-mode", bench_peer.server.poll_mode);
  bench_peer_cmd->add_option("--callback-threads", bench_peer.server.callback_threads);
  bench_peer_cmd->add_option("--send-device", bench_peer.server.send_device);
  bench_peer_cmd->add_option("--rails", bench_peer.server.rails);

  BenchFabricOptions peer;
  CLI::App* peer_cmd = app.add_subcommand("bench-fabric-peer", "Target side of bench fabric");
  peer_cmd->group("");
  peer_cmd->add_option("--backend", peer.backend)->required();
  peer_cmd->add_option("--providers", peer.providers)->required();
  peer_cmd->add_option("--max-size", peer.max_size)->required();
  peer_cmd->add_option("--source", peer.source);

  DemoTaskOptions task;
  CLI::App* task_cmd = app.add_subcommand("demo-task", "One task of the demo (started by demo)");
  task_cmd->group("");  // internal
  task_cmd->add_option("--cluster", task.cluster);
  task_cmd->add_option("--job", task.job);
  task_cmd->add_option("--task", task.task);
  task_cmd->add_option("--cluster-from", task.cluster_from)
      ->check(CLI::IsMember({"slurm", "tf_config"}));
  task_cmd->add_option("--protocol", task.protocol)->required();
  task_cmd->add_option("--steps", task.steps)->required();
  task_cmd->add_option("--step-base", task.step_base)->required();
  task_cmd->add_option("--learning-rate", task.learning_rate)->required();
  task_cmd->add_option("--device", task.device)->required();

  // Authentication for the commands that run tasks. The flags set the variables, before the
  // environment is read, so the tasks these commands start inherit them.
  struct SecurityFlag {
    const char* flag;
    const char* variable;
    const char* help;
    std::string value;
  };
  SecurityFlag security_flags[] = {
      {"--secret-file", "TENSORVERBS_SECRET_FILE", "File holding the cluster secret", ""},
      {"--tls-cert", "TENSORVERBS_TLS_CERT", "This task's TLS certificate (PEM)", ""},
      {"--tls-key", "TENSORVERBS_TLS_KEY", "The certificate's private key (PEM)", ""},
      {"--tls-ca", "TENSORVERBS_TLS_CA", "The cluster's CA certificate (PEM)", ""},
  };
  for (CLI::App* cmd : {server_cmd, demo_cmd, bench_p2p, bench_rate, bench_ps, stats_cmd}) {
    for (SecurityFlag& f : security_flags) {
      cmd->add_option(f.flag, f.value, std::string(f.help) + " (" + f.variable + ")")
          ->group("Security");
    }
  }

  CLI11_PARSE(app, argc, argv);
  for (const SecurityFlag& f : security_flags) {
    if (!f.value.empty()) setenv(f.variable, f.value.c_str(), /*overwrite=*/1);
  }

  // The README's tables depend on the defaults alone, not on this environment.
  if (info_cmd->parsed() && !settings_table.empty()) return RunSettingsMarkdown(settings_table);
  if (absl::Status s = tensorverbs::Config::EnvironmentStatus(); !s.ok()) {
    std::fprintf(stderr, "tensorverbs: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (server_cmd->parsed()) return RunServerCommand(server);
  if (stats_cmd->parsed()) return RunStatsCommand(stats);
  if (demo_cmd->parsed()) return RunDemoCommand(demo);
  if (task_cmd->parsed()) return RunDemoTask(task);
  if (info_cmd->parsed()) return RunInfoCommand();
  if (bench_fabric->parsed()) return RunBenchFabric(bench);
  if (peer_cmd->parsed()) return RunBenchFabricPeer(peer);
  if (bench_p2p->parsed()) return RunBenchP2P(p2p);
  if (bench_rate->parsed()) return RunBenchRate(rate);
  if (bench_peer_cmd->parsed()) return RunBenchPeer(bench_peer);
  if (bench_ps->parsed()) return RunBenchPs(ps);
  if (ps_task_cmd->parsed()) return RunBenchPsTask(ps_task);
  if (bench_scale->parsed()) return RunBenchScale(scale);
  if (scale_task_cmd->parsed()) return RunBenchScaleTask(scale_task);
  return 2;
}
