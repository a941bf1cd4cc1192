#!/usr/bin/env python3
"""Failover cost: `baton serve` roles on loopback (one prefill worker, two decode workers, one
frontend), N concurrent greedy streams run twice on the same deployment — undisturbed, then with
one decode worker killed (SIGKILL) once every stream is under way. Prints, per stream, TTFT, e2e,
failovers and the time from the kill to the stream's next token, whether each stream equals its
undisturbed run token for token, and a summary as a Markdown table for bench/RESULTS.md.

Run from the repository root after scripts/build.sh, with the test venv (scripts/env.sh):
  $BATON_VENV/bin/python bench/failover_bench.py [--model GGUF] [--streams 8] [--max-tokens 256]
      [--prompt-tokens 64] [--kill-after 32] [--dtype f32|bf16] [--threads 1]
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from serving_harness import Server, Stream, compile_protos  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the real SmolLM2 from scripts/fetch-model.sh)")
    ap.add_argument("--bin", default=str(REPO / "build" / "baton"))
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--kill-after", type=int, default=32, help="kill once every stream has this many tokens")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--threads", type=int, default=1, help="threads per worker")
    a = ap.parse_args()
    model = a.model or subprocess.run([str(REPO / "scripts" / "fetch-model.sh")], check=True, capture_output=True,
                                      text=True).stdout.strip().splitlines()[-1]
    pb = compile_protos(Path(tempfile.mkdtemp(prefix="baton-pb-")))
    flags = ("--dtype", a.dtype, "--threads", str(a.threads))
    roles = []
    try:
        prefill = Server(a.bin, model, *flags, subcommand=("serve", "--role", "prefill"))
        roles.append(prefill)
        decode = [Server(a.bin, model, *flags, subcommand=("serve", "--role", "decode")) for _ in range(2)]
        roles += decode
        front = Server(a.bin, model, "--prefill-addresses", prefill.address, "--decode-addresses",
                       ",".join(d.address for d in decode), subcommand=("serve", "--role", "frontend"))
        roles.append(front)
        # Distinct prompts of ordinary token ids (the same on both runs).
        work = [[1000 + (i * 997 + j * 31) % 20000 for j in range(a.prompt_tokens)] for i in range(a.streams)]

        def run(kill=False):
            streams = [Stream(pb, front.address, p, a.max_tokens, timeout=900) for p in work]
            killed_at = None
            if kill:
                while min(len(s.ids) for s in streams) < a.kill_after:
                    time.sleep(0.002)
                decode[0].proc.kill()
                killed_at = time.monotonic()
            for s in streams:
                s.join()
            for i, s in enumerate(streams):
                if s.error is not None:
                    raise SystemExit(f"stream {i} failed: {s.error.code()} {s.error.details()}")
            return streams, killed_at

        base, _ = run()
        hit, killed_at = run(kill=True)
    finally:
        for r in roles:
            if r.proc.poll() is None:
                r.stop()

    rows = []
    for i, (b, h) in enumerate(zip(base, hit)):
        gap = next((t - killed_at for t in h.times if t >= killed_at), None)
        rows.append(dict(i=i, moved=h.final.timing.failovers > 0, same=b.ids == h.ids,
                         ttft=h.final.timing.ttft_seconds, e2e=h.final.timing.e2e_seconds,
                         base_e2e=b.final.timing.e2e_seconds, gap=gap, n=len(h.ids)))
    print(f"model {Path(model).name}, dtype {a.dtype}, {a.streams} streams x {a.max_tokens} tokens, prompt "
          f"{a.prompt_tokens}, kill after {a.kill_after} tokens per stream")
    print("| stream | failed over | same tokens as undisturbed | TTFT s | e2e s | e2e undisturbed s | kill → next token ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        gap = f"{r['gap'] * 1000:.0f}" if r["gap"] is not None else "-"
        print(f"| {r['i']} | {'yes' if r['moved'] else 'no'} | {'yes' if r['same'] else 'NO'} | {r['ttft']:.3f} | "
              f"{r['e2e']:.3f} | {r['base_e2e']:.3f} | {gap} |")
    moved = [r for r in rows if r["moved"]]
    stayed = [r for r in rows if not r["moved"]]

    def mean(xs):
        return statistics.mean(xs) if xs else float("nan")

    print()
    print(f"failed over: {len(moved)}, mean e2e {mean([r['e2e'] for r in moved]):.3f} s "
          f"(undisturbed {mean([r['base_e2e'] for r in moved]):.3f} s); stayed: {len(stayed)}, mean e2e "
          f"{mean([r['e2e'] for r in stayed]):.3f} s (undisturbed {mean([r['base_e2e'] for r in stayed]):.3f} s)")
    gaps = sorted(r["gap"] for r in moved if r["gap"] is not None)
    if gaps:
        print(f"kill → next token on the moved streams: median {statistics.median(gaps) * 1000:.0f} ms, "
              f"max {gaps[-1] * 1000:.0f} ms")
    print(f"identical to undisturbed: {sum(r['same'] for r in rows)} of {len(rows)}")
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
