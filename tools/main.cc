// tensorverbs: the command-line tool. `tensorverbs --help` lists the subcommands.
#include <CLI/CLI.hpp>

#include <cstdio>

#include "src/common/config.h"
#include "src/server/server.h"
#include "absl/strings/str_join.h"
#include "tools/commands.h"

int main(int argc, char** argv) {
  using namespace tensorverbs::tools;
  CLI::App app{"tensorverbs: RDMA tensor transport (grpc, grpc+verbs) with server, demo and tools"};
  app.require_subcommand(1);
  const std::string protocols = absl::StrJoin(tensorverbs::AvailableProtocols(), ", ");

  ServerCommandOptions server;
  CLI::App* server_cmd = app.add_subcommand("server", "Run one task of a cluster until SIGTERM/SIGINT");
  server_cmd->add_option("--cluster", server.cluster,
                         "Cluster spec: ps=host:port;worker=host:port,host:port or JSON")
      ->required();
  server_cmd->add_option("--job", server.job, "This task's job name")->required();
  server_cmd->add_option("--task", server.task, "This task's index in its job")->required();
  server_cmd->add_option("--protocol", server.protocol, "Protocol (" + protocols + ")")
      ->default_val("grpc");
  server_cmd->add_flag("--wait-for-peers", server.wait_for_peers,
                       "Wait until every other task answers (TENSORVERBS_CONNECT_TIMEOUT_MS)");

  DemoOptions demo;
  CLI::App* demo_cmd = app.add_subcommand(
      "demo", "Train a small model with 1 ps + K workers as local processes");
  demo_cmd->add_option("--protocol", demo.protocol,
                       "Protocol (" + protocols + "); default: the best available");
  demo_cmd->add_option("--steps", demo.steps, "Training steps")->default_val(20);
  demo_cmd->add_option("--workers", demo.workers, "Worker tasks")->default_val(2);
  demo_cmd->add_option("--learning-rate", demo.learning_rate, "SGD learning rate")->default_val(0.2);

  CLI::App* info_cmd = app.add_subcommand(
      "info", "Show the fabric backends and providers usable here and the configuration");

  DemoTaskOptions task;
  CLI::App* task_cmd = app.add_subcommand("demo-task", "One task of the demo (started by demo)");
  task_cmd->group("");  // internal
  task_cmd->add_option("--cluster", task.cluster)->required();
  task_cmd->add_option("--job", task.job)->required();
  task_cmd->add_option("--task", task.task)->required();
  task_cmd->add_option("--protocol", task.protocol)->required();
  task_cmd->add_option("--steps", task.steps)->required();
  task_cmd->add_option("--step-base", task.step_base)->required();
  task_cmd->add_option("--learning-rate", task.learning_rate)->required();

  CLI11_PARSE(app, argc, argv);

  if (absl::Status s = tensorverbs::Config::EnvironmentStatus(); !s.ok()) {
    std::fprintf(stderr, "tensorverbs: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (server_cmd->parsed()) return RunServerCommand(server);
  if (demo_cmd->parsed()) return RunDemoCommand(demo);
  if (task_cmd->parsed()) return RunDemoTask(task);
  if (info_cmd->parsed()) return RunInfoCommand();
  return 2;
}
