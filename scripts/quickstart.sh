#!/usr/bin/env bash
# Sets up baton and runs the real SmolLM2-135M-Instruct model on a demo chat request.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh
model="$(./scripts/fetch-model.sh)"
./build/baton generate --model "$model" --chat "${1:-Explain in two sentences why the sky is blue.}" --max-tokens 128
