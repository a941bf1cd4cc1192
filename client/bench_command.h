// `batonctl bench`: a load generator against a baton frontend. Closed loop (--concurrency C:
// C requests always in flight) or open loop (--rate R: Poisson arrivals, R per second). Every
// request is random prompt token ids with ignore_eos, so it generates exactly --output-tokens.
// Client-side TTFT / ITL / e2e and the server's breakdown are summarised as a table and JSON.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

#include "client/interrupt_watcher.h"

namespace baton::ctl {

// Registers the subcommand; when it is selected, `*run` becomes its body (returns the exit code).
void add_bench_command(CLI::App& app, std::function<int(InterruptWatcher&)>* run);

}  // namespace baton::ctl
