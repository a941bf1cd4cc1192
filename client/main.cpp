// `batonctl`: the command-line client of baton's public Generation API.
//   batonctl generate  stream one completion and its timing breakdown
//   batonctl bench     load-test a frontend (closed loop or Poisson arrivals)
//   batonctl doctor    check a deployment: its roles, their agreement, every KV link's bandwidth
//   batonctl health    one grpc.health.v1 check of a role (a probe command)
// Errors are one line on stderr, "batonctl: error: ...", with exit code 1 (server or RPC
// failure; doctor: a problem found), 2 (bad flags) or 130 (interrupted); nothing throws out.
#include <functional>
#include <optional>
#include <string>

#include "client/bench_command.h"
#include "client/channel.h"
#include "client/doctor_command.h"
#include "client/generate_command.h"
#include "client/health_command.h"
#include "client/interrupt_watcher.h"
#include "common/cli_main.h"
#include "common/version.h"

int main(int argc, char** argv) {
  using namespace baton::ctl;
  CLI::App app{"batonctl: client for a baton deployment", "batonctl"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("batonctl ") + baton::baton_version());
  std::function<int(InterruptWatcher&)> run;
  add_generate_command(app, &run);
  add_bench_command(app, &run);
  add_doctor_command(app, &run);
  add_health_command(app, &run);
  if (const std::optional<int> exit_code = baton::parse_command_line(app, argc, argv)) return *exit_code;
  // Before the first gRPC thread exists: every thread inherits the blocked SIGINT/SIGTERM.
  InterruptWatcher interrupts;
  return baton::run_command(app, [&] { return run(interrupts); });
}
