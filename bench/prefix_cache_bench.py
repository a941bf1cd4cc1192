#!/usr/bin/env python3
"""The prefix cache, on against off, side by side in one run, on `baton local` with one and with two
prefill workers:

1. chat: `batonctl bench --workload chat` (C conversations of T turns sharing one S-token system
   prompt, each turn resending the history): TTFT p50/p99 overall and per turn, the server's
   prefill and KV transfer p50, prompt tokens the prefill workers computed (the growth of
   baton_prefill_step_tokens_sum), the hit ratio (cached / prompt tokens, from the final messages'
   Timing.cached_prompt_tokens; the workers' hit/lookup counters are checked to agree) and how the
   hits split over the workers.
2. system prompt: one conversation turn at a time (concurrency 1): the first request finds the
   S-token system prompt cold, the others (a new user message each) warm; with the cache off every
   one is cold. Server prefill and TTFT, cold against warm, and the KV hand-off after the first
   token, with the KV streamed as it is computed (the default) and sent after the first token
   (--kv-stream false: then the whole transfer, cached part included, is visible).

Prints Markdown tables for bench/RESULTS.md and writes every batonctl JSON under --out.
Run from the repository root after scripts/build.sh, with the test venv (scripts/env.sh):
  $BATON_VENV/bin/python bench/prefix_cache_bench.py [--model GGUF] [--conversations 16] [--turns 6]
      [--system-prompt-tokens 1000] [--prompt-tokens 64] [--output-tokens 32] [--concurrency 4]
      [--chat-configs 1on,1off,2on,2off] [--chat-flags '--kv-stream false'] [--skip-chat] [--skip-system]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from serving_harness import Server, metric_values  # noqa: E402


def prefill_sum(text, name):
    return sum(v for k, v in metric_values(text, name).items() if 'role="prefill"' in k)


def per_worker(text, name):
    return {k: v for k, v in metric_values(text, name).items() if 'role="prefill"' in k}


def bench(a, server, args, out):
    before = server.metrics()
    cmd = [a.batonctl, "bench", "--address", server.address, "--json", str(out), "--seed", str(a.seed), *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr}")
    after = server.metrics()
    report = json.loads(Path(out).read_text())
    report["metrics"] = {
        "prefill_tokens": prefill_sum(after, "baton_prefill_step_tokens_sum") -
                          prefill_sum(before, "baton_prefill_step_tokens_sum"),
        "hit_tokens": prefill_sum(after, "baton_prefix_cache_hit_tokens_total") -
                      prefill_sum(before, "baton_prefix_cache_hit_tokens_total"),
        "lookup_tokens": prefill_sum(after, "baton_prefix_cache_lookup_tokens_total") -
                         prefill_sum(before, "baton_prefix_cache_lookup_tokens_total"),
        "hits_by_worker": {k: v - per_worker(before, "baton_prefix_cache_hit_tokens_total").get(k, 0)
                           for k, v in per_worker(after, "baton_prefix_cache_hit_tokens_total").items()},
        "evicted_blocks": prefill_sum(after, "baton_prefix_cache_evicted_blocks_total") -
                          prefill_sum(before, "baton_prefix_cache_evicted_blocks_total"),
    }
    Path(out).write_text(json.dumps(report, indent=1))
    return report


def start(a, workers, cache, *extra):
    flags = ["--prefill-workers", str(workers)]
    if not cache:
        flags += ["--prefix-cache-blocks", "0"]
    return Server(a.bin, a.model, *flags, *extra)


def fmt(x, digits=0):
    return "-" if x is None else f"{x:,.{digits}f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/baton/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--bin", default=str(REPO / "build" / "baton"))
    ap.add_argument("--batonctl", default=str(REPO / "build" / "batonctl"))
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-prompt-tokens", type=int, default=1000)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--single", type=int, default=8, help="system prompt part: requests, one at a time")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="baton-prefix-bench-"))
    ap.add_argument("--skip-chat", action="store_true")
    ap.add_argument("--skip-system", action="store_true")
    ap.add_argument("--chat-configs", default="1on,1off,2on,2off",
                    help="chat runs: prefill workers and cache, e.g. 1on,2on")
    ap.add_argument("--chat-flags", default="", help="more baton local flags for the chat runs, e.g. '--kv-stream false'")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"JSON reports under {out}", flush=True)

    chat_args = ["--workload", "chat", "--conversations", a.conversations, "--turns", a.turns,
                 "--system-prompt-tokens", a.system_prompt_tokens, "--prompt-tokens", a.prompt_tokens,
                 "--output-tokens", a.output_tokens, "--concurrency", a.concurrency, "--timeout", 600]
    rows, turns = [], {}
    if not a.skip_chat:
        for i, config in enumerate(a.chat_configs.split(",")):
            workers, cache = int(config[0]), config[1:] == "on"
            name = f"chat-{i}-{workers}w-{'on' if cache else 'off'}"
            print(f"{name} ...", flush=True)
            s = start(a, workers, cache, *a.chat_flags.split())
            try:
                r = bench(a, s, chat_args, out / f"{name}.json")
            finally:
                s.stop()
            lat, m = r["latency_ms"], r["metrics"]
            prompt = r["tokens"]["prompt"]
            cached = r["tokens"]["cached_prompt"] or 0
            assert m["hit_tokens"] == cached, (m, cached)  # the counters agree with the final messages
            rows.append((workers, cache, r["requests"]["ok"], r["wall_seconds"], lat["ttft"]["p50"],
                         lat["ttft"]["p99"], lat["server_prefill"]["p50"], lat["server_kv_transfer"]["p50"],
                         prompt, m["prefill_tokens"], cached / prompt if prompt else 0, m["hits_by_worker"],
                         m["evicted_blocks"]))
            turns[(i, workers, cache)] = [(t["turn"], t["prompt_tokens_mean"], t["ttft_ms"]["p50"],
                                           t["ttft_ms"]["p99"]) for t in r["turns"]]
        print("\n| prefill workers | cache | requests | wall s | TTFT p50 / p99 ms | server prefill p50 ms | "
              "KV transfer p50 ms | prompt tokens | computed | hit ratio | hits per worker | evicted blocks |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for (w, c, ok, wall, t50, t99, pre, kv, prompt, computed, ratio, by_worker, ev) in rows:
            split = " / ".join(fmt(v) for _, v in sorted(by_worker.items())) if c else "-"
            print(f"| {w} | {'on' if c else 'off'} | {ok} | {wall:.1f} | {fmt(t50)} / {fmt(t99)} | {fmt(pre)} | "
                  f"{fmt(kv, 1)} | {fmt(prompt)} | {fmt(computed)} | {100 * ratio:.1f} % | {split} | {fmt(ev)} |")
        print("\nTTFT p50 / p99 (ms) by turn:\n")
        keys = list(turns)
        print("| turn | prompt tokens | " + " | ".join(f"{w} prefill, cache {'on' if c else 'off'}" for _, w, c in keys) +
              " |")
        print("|---|---|" + "---|" * len(keys))
        for i in range(a.turns):
            t, n = turns[keys[0]][i][0], turns[keys[0]][i][1]
            cells = [f"{fmt(turns[k][i][2])} / {fmt(turns[k][i][3])}" for k in keys]
            print(f"| {t} | {fmt(n)} | " + " | ".join(cells) + " |")

    if a.skip_system:
        return
    # 2. The system prompt cold and warm, one request at a time.
    single_args = ["--workload", "chat", "--conversations", a.single, "--turns", 1, "--system-prompt-tokens",
                   a.system_prompt_tokens, "--prompt-tokens", 32, "--output-tokens", 8, "--concurrency", 1,
                   "--timeout", 600]
    print("\n| KV sent | cache | request | cached tokens | server prefill ms | TTFT ms | KV transfer after the first token ms |")
    print("|---|---|---|---|---|---|---|")
    summary = {}
    for stream in (True, False):
        for cache in (True, False):
            name = f"system-{'stream' if stream else 'after'}-{'on' if cache else 'off'}"
            print(f"{name} ...", file=sys.stderr, flush=True)
            s = start(a, 1, cache, *([] if stream else ["--kv-stream", "false"]))
            try:
                r = bench(a, s, single_args, out / f"{name}.json")
            finally:
                s.stop()
            reqs = sorted(r["per_request"], key=lambda x: x["sent_seconds"])
            cold, warm = reqs[0], reqs[1:]
            for label, group in (("first (cold)", [cold]), ("the others (median)", warm)):
                pre = statistics.median(x["server_ms"]["prefill"] for x in group)
                ttft = statistics.median(x["ttft_ms"] for x in group)
                kv = statistics.median(x["server_ms"]["kv_transfer"] for x in group)
                hit = statistics.median(x.get("cached_prompt_tokens") or 0 for x in group)
                summary[(stream, cache, label)] = (pre, ttft, kv)
                print(f"| {'streamed' if stream else 'after the first token'} | {'on' if cache else 'off'} | {label} | "
                      f"{fmt(hit)} | {fmt(pre, 1)} | {fmt(ttft, 1)} | {fmt(kv, 1)} |", flush=True)
    cold = summary[(True, False, "the others (median)")]
    warm = summary[(True, True, "the others (median)")]
    print(f"\nwarm / cold (streamed, medians): server prefill {100 * warm[0] / cold[0]:.1f} %, "
          f"TTFT {100 * warm[1] / cold[1]:.1f} %")


if __name__ == "__main__":
    main()
