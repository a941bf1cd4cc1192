#!/usr/bin/env bash
# Builds the libFuzzer targets over a request's logic with clang (ASan + UBSan, in build-fuzz/:
# the engine alone, which is all they need) and runs each for N seconds (default 180; CI runs 60
# through scripts/test.sh) on the corpus kept in the repository, then the GGUF reader's fuzzer
# (scripts/fuzz-gguf.sh) for as long:
#   request  an OpenAI body or a GenerateRequest's fields through the request builder, the chat
#            template, the tokenizer, the schema compiler, the worker's constraint and a walk of its
#            masks, and the tool-call parser (tests/fuzz/request_fuzz.cpp; structure-aware mutator)
#   kv       a KV stream of any headers, chunks and ends through KvIncoming, against a receiver
#            that checks its contract (tests/fuzz/kv_fuzz.cpp)
# The request target uses the real model's tokenizer and chat template when BATON_MODEL names it.
# New inputs and crashes land in fuzz-out/<target>/ (ignored by git); exit status non-zero on a
# crash. To keep what a long run found (minimised):
#   build-fuzz/tests/fuzz/baton_fuzz_request -merge=1 tests/fuzz/corpus/request fuzz-out/request/corpus
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]   (targets: request kv gguf; default all)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
seconds="${1:-180}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(request kv gguf)
flags="-fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
build=()
for t in "${targets[@]}"; do [ "$t" = gguf ] || build+=("baton_fuzz_$t"); done
if [ ${#build[@]} -gt 0 ]; then
  CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
    -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" -DBATON_ENGINE_ONLY=ON -DBATON_CUDA=OFF \
    -DBATON_TESTS=OFF -DBATON_FUZZERS=ON -DBATON_WERROR=OFF >/dev/null
  cmake --build build-fuzz -j "$(nproc)" --target "${build[@]}"
fi
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export BATON_FUZZ_MODEL="${BATON_MODEL:-}"
for t in "${targets[@]}"; do
  if [ "$t" = gguf ]; then
    ./scripts/fuzz-gguf.sh "$seconds"
    continue
  fi
  out="fuzz-out/$t"
  mkdir -p "$out/corpus"
  # request: bodies up to 256 KiB (widened and deepened ones are that large); 10 s for one input
  # (the refusals here take milliseconds); 2 GiB of memory at the most.
  max_len=262144
  [ "$t" = kv ] && max_len=8192
  echo "fuzz: $t for ${seconds} s"
  "build-fuzz/tests/fuzz/baton_fuzz_$t" -max_total_time="$seconds" -max_len="$max_len" -timeout=10 \
    -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$out/" "$out/corpus" "tests/fuzz/corpus/$t"
done
