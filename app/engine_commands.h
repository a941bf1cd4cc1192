// The engine subcommands of `baton` (no serving dependencies): generate, tokenize and
// tools make-test-model. Each registers itself on the CLI11 app and runs when selected.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>

#include "common/cli_main.h"
#include "common/status.h"
#include "kernels/backend.h"
#include "model/model.h"

namespace baton {

// Registers the engine subcommands. `*run` is set to the selected command's body, which returns
// the process exit code.
void add_engine_commands(CLI::App& app, std::function<int()>* run);

// Exit codes (common/cli_main.h): 0 ok, 1 runtime failure (unreadable model, unsupported file),
// 2 bad input.

// --weights: auto | native | dense. Whether a model that `decodes` (generate, a decode worker;
// not a prefill worker) on `backend` keeps its GEMM weights quantised: native → yes where the
// backend can; dense → no; auto → where the backend's native kernels are fast on this CPU and the
// GEMMs run in bf16 (f32 is the exact mode, and stays dense).
bool use_native_weights(const std::string& weights, const Backend& backend, bool decodes);
// What a model that decodes and `prefills` too loads: native where use_native_weights says so,
// else dense; with auto, a model that prefills keeps a dense copy for big steps as well
// (`native` means native for every step).
Model::Weights weights_plan(const std::string& weights, const Backend& backend, bool decodes, bool prefills);
inline constexpr const char* kWeightsHelp =
    "GEMM weights: native (the file's quantised blocks, where kernels exist: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), dense "
    "(dequantised to --dtype), or auto (native for decoding where this CPU has AVX-512 VNNI and --dtype is bf16)";

// Prints "baton: error: <message>" on stderr and returns the exit code: kExitUsage for bad input
// (INVALID_ARGUMENT), kExitFailure otherwise.
int exit_with_error(const Status& status);

}  // namespace baton
