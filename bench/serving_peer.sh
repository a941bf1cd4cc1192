#!/usr/bin/env bash
# Serving one GGUF beside llama-server, at c=1 and c=8, in interleaved rounds: `baton local` (its
# defaults: disaggregated, decode on core 0, prefill on core 1), `baton local` colocated
# (--prefill-workers 0 --local-prefill-max-tokens 1000000) and llama-server (-np C -t THREADS
# -c 4096·C/… , no prompt cache), each fresh per run and driven the same way: closed loop, random
# prompt ids (a fresh seed per run, so no run is served from a prefix cache), ignore_eos.
# baton is driven by `batonctl bench`, llama-server by ../shared/tools/peer-bench --server-bench.
# Prints output tok/s, TTFT and ITL p50/p99 and the server's RSS after the run (and its peak,
# VmHWM) per run; the full
# reports go to $OUT (default /tmp/serving-peer).
#   bench/serving_peer.sh MODEL.gguf LLAMA_SERVER PEER_BENCH [ROUNDS] [PROMPT] [OUTPUT]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
source bench/start_local.sh
usage="usage: bench/serving_peer.sh MODEL.gguf LLAMA_SERVER PEER_BENCH [ROUNDS] [PROMPT_TOKENS] [OUTPUT_TOKENS]"
model=${1:?$usage} llama=${2:?$usage} peer=${3:?$usage}
rounds=${4:-2} prompt=${5:-256} output=${6:-64}
baton="$PWD/build/baton" ctl="$PWD/build/batonctl"
out="${OUT:-/tmp/serving-peer}"
mkdir -p "$out"
threads=$(nproc)
vocab=$("$BATON_VENV/bin/python" -c "import gguf,sys; r=gguf.GGUFReader(sys.argv[1]); print(len(r.fields['tokenizer.ggml.tokens'].data))" "$model" 2>/dev/null || echo 32000)
seed=$((RANDOM * 1000))

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
rss_mib() { awk -v k="$2:" '$1 == k {print int($2 / 1024)}' "/proc/$1/status" 2>/dev/null || echo "?"; }

# requests per run: 8 at c=1, 24 at c=8 (three per slot)
for round in $(seq 1 "$rounds"); do
  for conc in 1 8; do
    n=$((conc == 1 ? 8 : 24))
    for side in baton colocated llama; do
      log="$out/$side-c$conc-$round.log"
      seed=$((seed + 1))
      if [ "$side" = llama ]; then
        port=$(free_port)
        "$llama" -m "$model" -np "$conc" -t "$threads" -c $((conc * (prompt + output + 64))) --host 127.0.0.1 \
          --port "$port" --no-cache-prompt >"$log" 2>&1 &
        pid=$!
        for _ in $(seq 1 240); do
          curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
          sleep 0.5
        done
        # llama_server_bench.py draws its prompts from a fixed seed: the prompt cache is off instead.
        "$peer" --server-bench "127.0.0.1:$port" "$n" "$conc" "$prompt" "$output" "$vocab" >"$out/bench-$side-c$conc-$round.txt" 2>&1
        line=$(tr '\n' ' ' <"$out/bench-$side-c$conc-$round.txt")
      else
        extra=()
        [ "$side" = colocated ] && extra=(--prefill-workers 0 --local-prefill-max-tokens 1000000)
        start_local "$log" "$baton" --model "$model" "${extra[@]}"
        "$ctl" bench --address "127.0.0.1:$port" --requests "$n" --concurrency "$conc" --prompt-tokens "$prompt" \
          --output-tokens "$output" --warmup 1 --seed "$seed" >"$out/bench-$side-c$conc-$round.txt" 2>&1
        line=$(grep -E '^throughput|^  ttft|^  itl|^cached' "$out/bench-$side-c$conc-$round.txt" | tr -s ' ' | tr '\n' '|')
      fi
      rss="$(rss_mib "$pid" VmRSS) MiB (peak $(rss_mib "$pid" VmHWM))"
      kill -TERM "$pid"
      wait "$pid" || true
      echo "round $round c=$conc $side: RSS $rss | $line"
    done
  done
done
