#!/usr/bin/env bash
# Configures and builds baton into build/ (Release, Ninja, ccache when present).
# Extra arguments go to cmake's configure step, e.g. -DBATON_CUDA=OFF.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build build -j "$(nproc)"
