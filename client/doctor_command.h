// `batonctl doctor`: the preflight check of a deployment. Given the frontend (which lists its
// workers to a privileged caller) or the worker lists, it checks every role's process (reachable,
// grpc.health.v1, load report: model fingerprint, KV dtype, block size, transport, version; its
// clock against this machine's) and every prefill → decode link (a synthetic KV of --kv-bytes sent
// over the prefill worker's own --kv-transport, timed: bandwidth and latency), prints a table and
// each problem with its fix, and exits 0 when there is none, 1 when there is one, 2 on bad usage.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

#include "client/interrupt_watcher.h"

namespace baton::ctl {

// Registers the subcommand; when it is selected, `*run` becomes its body (returns the exit code).
void add_doctor_command(CLI::App& app, std::function<int(InterruptWatcher&)>* run);

}  // namespace baton::ctl
