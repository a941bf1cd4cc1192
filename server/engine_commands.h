// The engine subcommands of `baton` (no serving dependencies): generate, tokenize and
// tools make-test-model. Each registers itself on the CLI11 app and runs when selected.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

#include "common/status.h"

namespace baton {

// Registers the engine subcommands. `*run` is set to the selected command's body, which returns
// the process exit code.
void add_engine_commands(CLI::App& app, std::function<int()>* run);

// Exit codes: 0 ok, 1 runtime failure (unreadable model, unsupported file), 2 bad input.
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

// Prints "baton: error: <message>" on stderr and returns the exit code: kExitUsage for bad input
// (INVALID_ARGUMENT), kExitFailure otherwise.
int exit_with_error(const Status& status);

}  // namespace baton
