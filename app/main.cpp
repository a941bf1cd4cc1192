// `baton`: one binary, subcommands per role (see DESIGN.md). Errors are one line on stderr,
// prefixed "baton: ", with exit code 1 (runtime) or 2 (usage / bad input); nothing throws out.
#include <functional>
#include <optional>
#include <string>

#include "app/engine_commands.h"
#include "common/cli_main.h"
#include "common/version.h"
#if BATON_WITH_SERVING
#include "app/serve_commands.h"
#endif

int main(int argc, char** argv) {
  CLI::App app{"baton: disaggregated prefill/decode LLM serving", "baton"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("baton ") + baton::baton_version());
  std::function<int()> run;
  baton::add_engine_commands(app, &run);
#if BATON_WITH_SERVING
  baton::add_serve_commands(app, &run, argc, argv);
#endif
  if (const std::optional<int> exit_code = baton::parse_command_line(app, argc, argv)) return *exit_code;
  return baton::run_command(app, run);
}
