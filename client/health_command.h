// `batonctl health`: one grpc.health.v1 check of a baton role, as a probe command. Prints the
// status and exits 0 when it is SERVING, 1 otherwise (NOT_SERVING, unknown service, unreachable,
// past --timeout), 2 on bad usage. Runtimes without native gRPC probes (podman kube play, Docker
// HEALTHCHECK) run it as an exec probe against the plaintext --health-listen port.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

#include "client/interrupt_watcher.h"

namespace baton::ctl {

// Registers the subcommand; when it is selected, `*run` becomes its body (returns the exit code).
void add_health_command(CLI::App& app, std::function<int(InterruptWatcher&)>* run);

}  // namespace baton::ctl
