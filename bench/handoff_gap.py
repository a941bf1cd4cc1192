#!/usr/bin/env python3
"""The hand-off's cost to a stream: at concurrency 1, the gap between a request's first token (from
the prefill worker) and its second (the decode worker's first step, once the KV is there), minus
the stream's ordinary inter-token latency (the median gap after the second token). With the KV
streamed layer by layer while the prompt is prefilled (--kv-stream true, the default) only the
last layer is left to move after the first token; with --kv-stream false all of it is.

Also: single-process `baton generate` decode speed on the same cores, for the ITL of `baton local`
to be compared with (cores that do not fight).

Run from the repository root after scripts/build.sh, with the test venv (scripts/env.sh):
  $BATON_VENV/bin/python bench/handoff_gap.py [--model GGUF] [--requests 20] [--prompt-tokens 256]
      [--output-tokens 64] [--kv-dtype bf16] [--extra "--decode-cpus 0 --prefill-cpus 1"]
"""

import argparse
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from serving_harness import Server, Stream, compile_protos  # noqa: E402


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def run_config(a, pb, model, kv_stream):
    srv = Server(a.bin, model, "--kv-stream", kv_stream, "--kv-dtype", a.kv_dtype, *shlex.split(a.extra))
    try:
        gaps, itls, ttfts, kv = [], [], [], []
        for i in range(a.warmup + a.requests):
            prompt = [100 + (i * 7919 + j * 31) % 170 for j in range(a.prompt_tokens)]  # valid in any vocabulary >= 270
            s = Stream(pb, srv.address, prompt, a.output_tokens, timeout=600)
            s.join()
            assert s.error is None and len(s.ids) == a.output_tokens, s.error
            if i < a.warmup:
                continue
            t = s.times
            # Tokens arriving in one message share a time: use distinct arrivals only.
            gap1 = t[1] - t[0]
            rest = [t[k + 1] - t[k] for k in range(1, len(t) - 1)]
            itl = statistics.median(rest)
            gaps.append(gap1 - itl)
            itls.append(itl)
            ttfts.append(t[0] - s.started)
            kv.append(s.final.timing.kv_transfer_seconds)
        return gaps, itls, ttfts, kv
    finally:
        srv.stop()


def generate_speed(a, model):
    """Decode tokens/s of single-process `baton generate` with each given --threads."""
    out = {}
    for threads in a.generate_threads:
        speeds = []
        for _ in range(3):
            p = subprocess.run([a.bin, "generate", "--model", model, "--prompt-ids", "1", "--max-tokens", "128",
                                "--ignore-eos", "--threads", str(threads)], capture_output=True, text=True, check=True)
            line = [x for x in p.stderr.splitlines() if "decode" in x][-1]
            speeds.append(float(line.split("(")[-1].split(" tok/s")[0]))
        out[threads] = speeds
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the real SmolLM2 from scripts/fetch-model.sh)")
    ap.add_argument("--bin", default=str(REPO / "build" / "baton"))
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--kv-dtype", default="bf16", choices=["f32", "bf16", "f16"])  # baton's default under bf16
    ap.add_argument("--extra", default="", help="more `baton local` flags")
    ap.add_argument("--generate-threads", type=int, nargs="*", default=[1, 2])
    a = ap.parse_args()
    model = a.model or subprocess.run([str(REPO / "scripts" / "fetch-model.sh")], check=True, capture_output=True,
                                      text=True).stdout.strip().splitlines()[-1]
    pb = compile_protos(Path(tempfile.mkdtemp(prefix="baton-pb-")))
    print(f"baton local {a.extra} --kv-dtype {a.kv_dtype}, {a.requests} requests at concurrency 1, "
          f"{a.prompt_tokens} prompt + {a.output_tokens} output tokens (ms)")
    print("| --kv-stream | gap(1st→2nd) − ITL p50 / p90 | ITL p50 | TTFT p50 | KV transfer after the first token p50 |")
    print("|---|---|---|---|---|")
    for kv_stream in ("true", "false"):
        gaps, itls, ttfts, kv = run_config(a, pb, model, kv_stream)
        print(f"| {kv_stream} | {1e3 * pct(gaps, 50):.1f} / {1e3 * pct(gaps, 90):.1f} | {1e3 * pct(itls, 50):.2f} | "
              f"{1e3 * pct(ttfts, 50):.1f} | {1e3 * pct(kv, 50):.1f} |")
    for threads, speeds in generate_speed(a, model).items():
        ms = sorted(1e3 / s for s in speeds)
        print(f"baton generate --threads {threads}: decode {', '.join(f'{s:.1f}' for s in speeds)} tok/s "
              f"(ITL {ms[1]:.2f} ms median of 3)")


if __name__ == "__main__":
    main()
