// `batonctl generate`: one Generate call, the text streamed to stdout as it arrives, the
// request's timing breakdown (from its final message) on stderr.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

#include "client/interrupt_watcher.h"

namespace baton::ctl {

// Registers the subcommand; when it is selected, `*run` becomes its body (returns the exit code).
void add_generate_command(CLI::App& app, std::function<int(InterruptWatcher&)>* run);

}  // namespace baton::ctl
