#!/usr/bin/env bash
# Sets up and runs every test: installs dependencies, builds, fetches the real model, then the
# unit tests (ctest, full build and engine-only build), the end-to-end tests against independent
# references, the serving tests over real processes and the deployment tests (pytest), the three
# fuzzers for 60 s each, the unit and serving tests again under ASan + UBSan, and the gRPC-free
# threaded parts under ThreadSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
./scripts/install-deps.sh --tests
./scripts/build.sh
BATON_MODEL="$(./scripts/fetch-model.sh)"
export BATON_MODEL BATON_BIN="$PWD/build/baton"
(cd build && ctest --output-on-failure -j 1)
# The CUDA build is compiled and linked here (nvcc is enough); its [gpu] tests need a device and
# skip themselves without one (ctest reports them as skipped). Say which it was.
if [ -x build/tests/gpu/baton_gpu_tests ]; then
  build/tests/gpu/baton_gpu_tests "[gpu]" || [ $? -eq 77 ] || exit 1
else
  echo "CUDA backend not built (no nvcc): the GPU tests were not compiled"
fi
# The engine alone (-DBATON_ENGINE_ONLY=ON: no gRPC, protobuf, spdlog or Prometheus) must keep
# building and passing its tests: that is how it is built on a GPU machine without Debian packages.
# With the CUDA toolkit present this is the GPU machine's build: -DBATON_ENGINE_ONLY=ON with CUDA.
cmake -S . -B build-engine -G Ninja -DCMAKE_BUILD_TYPE=Release -DBATON_ENGINE_ONLY=ON -DBATON_CUDA=AUTO >/dev/null
cmake --build build-engine -j "$(nproc)"
(cd build-engine && ctest --output-on-failure -j 1)
"$BATON_VENV/bin/python" -m pytest -q -rs tests/e2e tests/integration tests/deploy
# The fuzzers for a bounded time each on their kept corpora (ASan + UBSan, libFuzzer): a request
# through the frontend's and a worker's logic, the KV stream, the GGUF reader.
./scripts/fuzz.sh 60
# ASan + UBSan over the unit tests and the serving tests.
./scripts/sanitize.sh
# TSan over the pipeline, the scheduler, both engines, the KV pool and the prefix cache.
./scripts/tsan.sh
