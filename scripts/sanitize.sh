#!/usr/bin/env bash
# ASan + UBSan over baton's own code: builds build-asan/ (CPU only, -O1, frame pointers, UBSan
# aborting on the first report), runs the unit tests (ctest) and the serving tests
# (tests/integration: real baton processes on loopback, driven by the Python gRPC client) with
# that binary. Any sanitizer report fails the run. CI runs it through scripts/test.sh; the Debian
# libraries (gRPC, protobuf, oneDNN) are not instrumented, so reports come from baton's code only.
# Warnings are not errors here (GCC 12's maybe-uninitialized misfires under the sanitizers); the
# Release build in scripts/build.sh keeps -Werror.
# TSan is not run: the uninstrumented gRPC drowns it in reports (see tests/unit/prefill_worker/
# prefill_service_test.cpp for the reactor window it cannot see, closed and stress-tested).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" -DBATON_CUDA=OFF \
  -DBATON_NATIVE=ON -DBATON_WERROR=OFF >/dev/null
cmake --build build-asan -j "$(nproc)"
# detect_leaks: LeakSanitizer at exit. halt_on_error with UBSan's -fno-sanitize-recover: the first
# report ends the process with a non-zero status, which fails the test.
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
(cd build-asan && ctest --output-on-failure -j 1)
# The failover tests' worker outage is shortened here: what it proves under a long outage (the
# capped reconnect backoff) the Release run has shown; here it is the kills that matter.
# The hang tests' time bound is scaled likewise (their progress watchdog follows the slower steps).
# The minute of chaos is a benchmark's short run: the Release pass runs it; here it would only
# add its minute (the faults it makes are the hang and failover tests' own, which run here).
# Structured output's 200 sampled schemas and its greedy comparisons are thousands of real-model
# steps (96 s and 21 s in Release, many times that here); the grammar's code runs here in its unit
# tests and in the same file's streamed, gRPC and tool-call tests. The hostile clients' memory
# plateau over 40 large schemas means nothing under ASan's quarantine of freed memory (its
# refusals, crashes and bounds all run here).
BATON_TEST_OUTAGE_SECONDS=20 BATON_TEST_TIME_SCALE=3 BATON_BIN="$PWD/build-asan/baton" "$BATON_VENV/bin/python" \
  -m pytest -q -rs tests/integration --deselect tests/integration/test_chaos.py::test_a_minute_of_chaos_loses_nothing \
  --deselect tests/integration/test_openai_structured_output.py::test_random_schemas_sampled_at_temperature_1_parse_and_validate \
  --deselect tests/integration/test_openai_structured_output.py::test_greedy_under_a_schema_equals_unconstrained_greedy_where_that_conforms \
  --deselect tests/integration/test_hostile_clients.py::test_l_distinct_large_schemas_keep_a_worker_bounded
