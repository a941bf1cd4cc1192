#!/usr/bin/env bash
# Sets up baton, starts `baton local` (frontend + prefill worker + decode worker in one process,
# over loopback gRPC) with the real SmolLM2-135M-Instruct model, sends one chat request with
# batonctl (the answer streams to stdout, the timing breakdown goes to stderr), asks the same
# through the OpenAI-compatible HTTP API with curl, shows the TTFT metrics, and stops the server.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
./scripts/install-deps.sh
./scripts/build.sh
model="$(./scripts/fetch-model.sh)"
port="${BATON_PORT:-50051}"
metrics_port="${BATON_METRICS_PORT:-9090}"
http_port="${BATON_HTTP_PORT:-8080}"
question="${1:-Explain in two sentences why the sky is blue.}"
log="$(mktemp)"
./build/baton local --model "$model" --listen "127.0.0.1:$port" --metrics-listen "127.0.0.1:$metrics_port" \
  --http-listen "127.0.0.1:$http_port" >"$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 1 300); do
  grep -q "listening on port" "$log" && break
  kill -0 "$server" 2>/dev/null || { cat "$log" >&2; exit 1; }
  sleep 0.2
done
./build/batonctl generate --address "127.0.0.1:$port" --max-tokens 128 --chat "$question"
echo "--- the same through the OpenAI-compatible HTTP API (POST /v1/chat/completions) ---" >&2
request="$(python3 -c 'import json, sys; print(json.dumps({"messages": [{"role": "user", "content": sys.argv[1]}],
                                                           "max_tokens": 128, "temperature": 0}))' "$question")"
curl -s "http://127.0.0.1:$http_port/v1/chat/completions" -H 'Content-Type: application/json' -d "$request" |
  python3 -c 'import json, sys; r = json.load(sys.stdin); print(r["choices"][0]["message"]["content"])
print("timing:", json.dumps(r["baton"]["timing"]), file=sys.stderr)'
echo "--- /metrics (TTFT histogram count and sum) ---" >&2
curl -s "http://127.0.0.1:$metrics_port/metrics" | grep -E '^baton_time_to_first_token_seconds_(count|sum)' >&2 || true
