// `batonctl bench`: a load generator against a baton frontend. Workloads: random (one-turn
// requests of random prompt ids) or chat (multi-turn conversations that share a system prompt
// and resend their history); closed loop (--concurrency) or open loop (--rate: Poisson
// arrivals), for a count of requests or a --duration. Every request uses ignore_eos, so it
// generates exactly --output-tokens. Client-side TTFT / ITL / e2e, the server's breakdown, chat
// turns and SLO goodput are summarised as a table, JSON (--json) and a plot (--plot).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

#include "client/interrupt_watcher.h"

namespace baton::ctl {

// Registers the subcommand; when it is selected, `*run` becomes its body (returns the exit code).
void add_bench_command(CLI::App& app, std::function<int(InterruptWatcher&)>* run);

}  // namespace baton::ctl
