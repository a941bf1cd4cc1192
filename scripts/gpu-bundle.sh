#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries here (CUDA toolkit, no GPU needed) and packs them
# with their non-system libraries into .device/bundle (ignored by git) for a GPU machine that
# has no Debian packages:
#
#   scripts/gpu-bundle.sh            # → .device/bundle.tar.gz (+ the model in parts, see below)
#   # there:  tar xzf .device/bundle.tar.gz -C .device && tests/gpu/run.sh --bundle .device/bundle
#
# The build is the full one (so the KV transport tests and their IPC sender come along), portable
# (-DBATON_NATIVE=OFF: the GPU machine's CPU is not this one), for the default -gencode set
# (sm_90a, sm_80, compute_80 PTX). The SmolLM2 file (98 MB) is over the
# device tool's 64 MiB per call, so it is split into .device/model.part-* of 30 MiB: the bundle
# (~27 MiB) with the first part, then two parts per call to the still-warm machine (the script
# prints each file's size; bench/RESULTS.md lists the calls); tests/gpu/run.sh joins and checks them.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle_tool="${DEVICE_BUNDLE:-../shared/tools/device-bundle}"
[ -x "$bundle_tool" ] || { echo "gpu-bundle: device-bundle not found at $bundle_tool (set DEVICE_BUNDLE)" >&2; exit 2; }
cmake -S . -B build-gpu-bundle -G Ninja -DCMAKE_BUILD_TYPE=Release -DBATON_CUDA=ON -DBATON_NATIVE=OFF >/dev/null
targets=(baton baton_gpu_tests baton_bench_gpu baton_bench_attention)
grep -q baton_kv_ipc_sender build-gpu-bundle/build.ninja && targets+=(baton_kv_ipc_sender)
cmake --build build-gpu-bundle -j "$(nproc)" --target "${targets[@]}"
mkdir -p .device
rm -rf .device/bundle .device/bundle.tar.gz
binaries=()
for t in "${targets[@]}"; do binaries+=("$(find build-gpu-bundle -type f -name "$t" -perm -u+x | head -1)"); done
"$bundle_tool" .device/bundle "${binaries[@]}"
rm -rf .device/bundle  # the tarball travels
model="$(./scripts/fetch-model.sh)"
rm -f .device/model.part-*
split -b 30M "$model" .device/model.part-
du -m .device/bundle.tar.gz .device/model.part-*  # MiB; at most 64 per device call
