#!/usr/bin/env bash
# Builds the GGUF reader's libFuzzer target with clang (ASan + UBSan) and runs it for N seconds
# (default 180; CI runs 60 through scripts/test.sh) on the corpus kept in the repository
# (tests/fuzz/corpus/gguf: small test models and the inputs earlier runs found interesting,
# minimised with -merge=1) plus fresh test models that `baton tools make-test-model` writes.
# New inputs and crashes land in fuzz-out/ (ignored by git); exit status non-zero on a crash.
# To grow the kept corpus after a long run:
#   fuzz-out/gguf_fuzz -merge=1 tests/fuzz/corpus/gguf fuzz-out/corpus
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-180}"
out=fuzz-out
mkdir -p "$out/corpus"
srcs=(common/check.cpp common/status.cpp model/file_mapping.cpp model/gguf.cpp model/config.cpp model/tokenizer.cpp model/tokenizer_vocab.cpp
      model/utf8.cpp tests/fuzz/gguf_fuzz.cpp)
clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I. \
  $(pkg-config --cflags libpcre2-8) "${srcs[@]}" $(pkg-config --libs libpcre2-8) -o "$out/gguf_fuzz"
if [[ ! -x build/baton ]]; then ./scripts/build.sh; fi
for seed in 1 2 3; do
  ./build/baton tools make-test-model --out "$out/corpus/seed$seed.gguf" --seed "$seed" \
    --layers 1 --dim 32 --heads 2 --kv-heads 1 --ffn 32 --ctx 64
done
./build/baton tools make-test-model --out "$out/corpus/qwen2.gguf" --arch qwen2 --layers 1 --dim 32 --heads 2 \
  --kv-heads 2 --ffn 32 --ctx 64 --tied
"$out/gguf_fuzz" -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix="$out/" "$out/corpus" tests/fuzz/corpus/gguf
