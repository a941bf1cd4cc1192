#!/usr/bin/env bash
# Two `baton` binaries side by side at c=8 (256 prompt + 64 output tokens, 32 requests after 8
# warm-up), interleaved: each run gets a fresh `baton local` (its defaults) and a fresh --seed, so
# no run is served from another's prefix cache. Prints each run's output tok/s and ITL line; the
# full reports go to $OUT (default /tmp/ab-serving).
#   bench/ab_serving.sh OLD_BATON NEW_BATON [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
source bench/start_local.sh
old=${1:?usage: bench/ab_serving.sh OLD_BATON NEW_BATON [ROUNDS]} new=${2:?usage: bench/ab_serving.sh OLD_BATON NEW_BATON [ROUNDS]}
rounds=${3:-3}
model="${BATON_MODEL:-$(./scripts/fetch-model.sh)}"
ctl="$PWD/build/batonctl"
out="${OUT:-/tmp/ab-serving}"
mkdir -p "$out"
seed=$((RANDOM * 1000))
for round in $(seq 1 "$rounds"); do
  for side in old new; do
    bin=$old
    [ "$side" = new ] && bin=$new
    log="$out/server-$side-$round.log"
    start_local "$log" "$bin" --model "$model"
    seed=$((seed + 1))
    "$ctl" bench --address "127.0.0.1:$port" --requests 32 --concurrency 8 --prompt-tokens 256 --output-tokens 64 \
      --warmup 8 --seed "$seed" --json "$out/$side-$round.json" >"$out/bench-$side-$round.txt" 2>&1
    kill -TERM "$pid"
    wait "$pid" || true
    echo "$side round $round (seed $seed): $(grep -E '^throughput|^  itl|^cached' "$out/bench-$side-$round.txt" | tr -s ' ' | tr '\n' '|')"
  done
done
