#!/usr/bin/env bash
# Sets up and runs every test: installs dependencies, builds, fetches the real model, then the
# unit tests (ctest) and the end-to-end tests against independent references (pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh
BATON_MODEL="$(./scripts/fetch-model.sh)"
export BATON_MODEL BATON_BIN="$PWD/build/baton"
(cd build && ctest --output-on-failure -j 1)
python3 -m pytest -q tests/e2e tests/integration tests/deploy
