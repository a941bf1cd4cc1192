// How baton's binaries (`baton`, `batonctl`) read their command line and report a failure: one
// line on stderr, "<name>: error: <what>", and nothing throws out of main. Header-only; the
// binaries link CLI11.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <optional>
#include <string>

namespace baton {

// Exit codes of every baton binary: 0 ok, 1 a runtime failure, 2 bad flags or input.
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// One error line on stderr (what was printed on stdout first goes out first).
inline int report_error(const CLI::App& app, int exit_code, const std::string& what) {
  std::fflush(stdout);
  std::fprintf(stderr, "%s: error: %s\n", app.get_name().c_str(), what.c_str());
  return exit_code;
}

// Parses argv into `app`. The exit code when the process ends here (--help and --version: 0 after
// their text; a usage error: kExitUsage after its line), nullopt when the command is to run.
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return report_error(app, kExitUsage, std::string(e.what()) + " (see --help)");
  }
  return std::nullopt;
}

// Runs the chosen command: its exit code, or kExitFailure after the line of what it threw.
template <class Command>
int run_command(const CLI::App& app, Command&& command) {
  try {
    return command();
  } catch (const std::exception& e) {
    return report_error(app, kExitFailure, e.what());
  }
}

}  // namespace baton
