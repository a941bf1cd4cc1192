// `baton serve --role=frontend|prefill|decode` and `baton local` (all roles in one process over
// loopback gRPC, one /metrics). Every flag can also come from a BATON_* environment variable
// (BATON_MODEL, BATON_LISTEN, ...), for Kubernetes.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace baton {

void add_serve_commands(CLI::App& app, std::function<int()>* run, int argc, char** argv);

}  // namespace baton
