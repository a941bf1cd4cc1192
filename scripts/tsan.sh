#!/usr/bin/env bash
# ThreadSanitizer over the threaded parts that do not go through gRPC (which is not instrumented,
# so TSan would report inside it, or miss its synchronisation): builds build-tsan/ with
# -DBATON_RACE_TESTS=ON and runs baton_race_tests — the request pipeline against its fake
# workers, the scheduler, the prefill and decode engines with their step and sender threads, the
# KV block pool and the prefix cache. Any report fails the run. scripts/test.sh runs it.
#
# OMP_NUM_THREADS=1: the kernels' OpenMP regions run on the calling thread. libgomp is not
# instrumented, so TSan cannot see its barriers, and every write a kernel thread makes to an
# output the caller then reads would be a false report; the races to find are between baton's own
# threads (engine, senders, callers), which this keeps. tests/tsan.supp holds the suppressions,
# each with its reason.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
flags="-fsanitize=thread -fno-omit-frame-pointer"
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" -DBATON_CUDA=OFF -DBATON_NATIVE=ON \
  -DBATON_WERROR=OFF -DBATON_RACE_TESTS=ON >/dev/null
cmake --build build-tsan -j "$(nproc)" --target baton_race_tests
export OMP_NUM_THREADS=1
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/tsan.supp"
build-tsan/tests/baton_race_tests "$@"
