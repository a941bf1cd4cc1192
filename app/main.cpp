// `baton`: one binary, subcommands per role (see DESIGN.md). Errors are one line on stderr,
// prefixed "baton: ", with exit code 1 (runtime) or 2 (usage / bad input); nothing throws out.
#include <cstdio>
#include <exception>
#include <functional>
#include <string>

#include "common/version.h"
#include "app/engine_commands.h"
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
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "baton: error: %s (see --help)\n", e.what());
    return baton::kExitUsage;
  }
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "baton: error: %s\n", e.what());
    return baton::kExitFailure;
  }
}
