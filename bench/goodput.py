#!/usr/bin/env python3
"""Colocated, disaggregated and adaptive baton on the same machine, as DistServe measures it: at
each offered load (open loop, Poisson arrivals, `batonctl bench --rate R`), goodput = requests per
second that met both SLOs (TTFT and per-request p99 inter-token latency), with TTFT and ITL p99,
the requests refused at admission, and the frontend's TTFT predictor error.

  colocated      `baton local --prefill-workers 0 --local-prefill-max-tokens 1000000`: one decode
                 worker that prefills every prompt itself in its decode steps (chunked, the
                 --local-prefill-token-budget tokens a step), on every core
  disaggregated  `baton local`: one prefill and one decode worker, each engine on its own cores
                 (the default split), KV streamed layer by layer over loopback gRPC (static: every
                 prompt to the prefill worker)
  adaptive       the same two workers, the decode worker able to prefill too, and the frontend
                 choosing per request (--prefill-placement adaptive, scheduler/scheduler.h)
  ...+slo        the same with --ttft-slo (the TTFT SLO): requests predicted to miss it are
                 refused at once (429 / RESOURCE_EXHAUSTED), and prompts wait at the frontend

Every point is measured cold: a fresh server per (configuration, rate), and fresh prompts per
rate (the seed is --seed + the rate's index, the same for every configuration, so all see the
same prompts). Nothing is served from another point's prefix cache, and the cached prompt tokens
of each point are reported beside it. (With one server per configuration and one seed for every
rate, every point after the first was a cache benchmark on the disaggregated side only: its
prefill worker has a prefix cache, the colocated decode worker's local prefill has none.)

A mixed workload (--long-prompt-tokens N --long-fraction F): a share F of the prompts N tokens
long, the rest --prompt-tokens.

Writes a Markdown table to stdout and an SVG (goodput, TTFT p99, ITL p99 and refusals against the
offered rate, every configuration) to --plot.

Run from the repository root after scripts/build.sh, with the test venv (scripts/env.sh):
  $BATON_VENV/bin/python bench/goodput.py [--model GGUF] [--rates 0.5 1 2 4 8] [--requests 20]
      [--min-seconds S] [--configs colocated disaggregated adaptive adaptive+slo] [--prompt-tokens 256]
      [--long-prompt-tokens 1024 --long-fraction 0.2] [--output-tokens 64] [--slo-ttft 1.0]
      [--slo-itl 0.05] [--plot goodput.svg]
"""

import argparse
import json
import math
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from serving_harness import Server  # noqa: E402

BASE = {
    "colocated": ["--prefill-workers", "0", "--local-prefill-max-tokens", "1000000"],
    "disaggregated": [],
    "adaptive": ["--local-prefill-max-tokens", "1000000", "--prefill-placement", "adaptive"],
}
ALL_CONFIGS = ["colocated", "colocated+slo", "disaggregated", "disaggregated+slo", "adaptive", "adaptive+slo"]


def config_flags(name, a):
    base, _, slo = name.partition("+")
    return BASE[base] + (["--ttft-slo", str(a.slo_ttft)] if slo else [])


def histogram_quantile(text, name, q):
    """Prometheus' histogram_quantile over every series of `name` (linear within a bucket)."""
    buckets = {}
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split(',le="' if ',le="' in line else '{le="', 1)[1].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0) + float(line.rsplit(" ", 1)[1])
    if not buckets or buckets.get(float("inf"), 0) == 0:
        return None
    bounds = sorted(buckets)
    total = buckets[float("inf")]
    rank, prev_bound, prev_count = q * total, 0.0, 0.0
    for b in bounds:
        if buckets[b] >= rank:
            if b == float("inf"):
                return prev_bound
            return prev_bound + (b - prev_bound) * (rank - prev_count) / max(buckets[b] - prev_count, 1e-9)
        prev_bound, prev_count = b, buckets[b]
    return prev_bound


def n_requests(a, rate):
    """--requests, or more at a high rate: a point lasts --min-seconds of arrivals at least (goodput is
    requests met over the run's wall time, which a short run's last requests' tail would dominate)."""
    return max(a.requests, math.ceil(rate * a.min_seconds))


def bench(a, srv, rate, seed, tmp):
    out = Path(tmp) / f"r{rate}.json"
    cmd = [a.batonctl, "bench", "--address", srv.address, "--rate", str(rate), "--requests", str(n_requests(a, rate)),
           "--warmup", "2", "--prompt-tokens", str(a.prompt_tokens), "--output-tokens", str(a.output_tokens),
           "--slo-ttft", str(a.slo_ttft), "--slo-itl", str(a.slo_itl), "--seed", str(seed), "--json", str(out)]
    if a.long_prompt_tokens:
        cmd += ["--long-prompt-tokens", str(a.long_prompt_tokens), "--long-fraction", str(a.long_fraction)]
    # Refused requests make batonctl exit 1: they are part of the result, read from the JSON.
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if not out.exists():
        raise RuntimeError(f"batonctl bench failed: {run.stdout}{run.stderr}")
    j = json.loads(out.read_text())
    metrics = srv.metrics()
    ok, total = j["requests"]["ok"], j["requests"]["total"]
    met = j["slo"]["attainment"] * total
    return {
        "goodput": j["slo"]["goodput_requests_per_second"],
        "attainment": j["slo"]["attainment"],
        "admitted_attainment": met / ok if ok else 0.0,
        "throughput": j["throughput"]["requests_per_second"],
        "ttft_p50": j["latency_ms"]["ttft"]["p50"] or 0, "ttft_p99": j["latency_ms"]["ttft"]["p99"] or 0,
        "itl_p50": j["latency_ms"]["itl"]["p50"] or 0, "itl_p99": j["latency_ms"]["itl"]["p99"] or 0,
        "failed": j["requests"]["failed"],
        "refused": j["requests"]["failed_by_code"].get("RESOURCE_EXHAUSTED", 0),
        "cached": j["tokens"]["cached_prompt"], "prompt": j["tokens"]["prompt"],
        "pred_p50": histogram_quantile(metrics, "baton_ttft_prediction_error_ratio", 0.5),
        "pred_p90": histogram_quantile(metrics, "baton_ttft_prediction_error_ratio", 0.9),
    }


def svg_plot(results, rates, path, a):
    """Four panels side by side: goodput, TTFT p99, ITL p99 and refusals against the offered rate."""
    colours = {"colocated": "#d62728", "disaggregated": "#1f77b4", "adaptive": "#2ca02c"}
    panels = [("goodput (req/s)", "goodput"), ("TTFT p99 (ms)", "ttft_p99"), ("ITL p99 (ms)", "itl_p99"),
              ("refused (of requests)", "refused")]
    w, h, pad = 280, 220, 45
    workload = (f"{a.prompt_tokens} ({100 * a.long_fraction:.0f} % {a.long_prompt_tokens})"
                if a.long_prompt_tokens else f"{a.prompt_tokens}")
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{len(panels) * w + 20}" height="{h + 60}" '
             'font-family="sans-serif" font-size="11">',
             f'<text x="10" y="16" font-size="13">baton: {workload}+{a.output_tokens} tokens, SLO TTFT '
             f'{a.slo_ttft * 1e3:.0f} ms, ITL p99 {a.slo_itl * 1e3:.0f} ms; dashed: with --ttft-slo</text>']
    xmax = max(rates) * 1.05
    for i, (title, key) in enumerate(panels):
        x0, y0 = 10 + i * w, 30
        ymax = max(r[key] for c in results.values() for r in c.values()) * 1.1 or 1
        sx = lambda v: x0 + pad + (w - pad - 10) * v / xmax  # noqa: E731
        sy = lambda v: y0 + h - pad + 20 - (h - pad) * v / ymax  # noqa: E731
        parts.append(f'<text x="{x0 + pad}" y="{y0 + 8}">{title}</text>')
        parts.append(f'<line x1="{sx(0)}" y1="{sy(0)}" x2="{sx(xmax)}" y2="{sy(0)}" stroke="black"/>')
        parts.append(f'<line x1="{sx(0)}" y1="{sy(0)}" x2="{sx(0)}" y2="{sy(ymax)}" stroke="black"/>')
        for k in range(5):
            v = ymax * k / 4
            parts.append(f'<text x="{sx(0) - 4}" y="{sy(v) + 4}" text-anchor="end">{v:.3g}</text>')
        for r in rates:
            parts.append(f'<text x="{sx(r)}" y="{sy(0) + 14}" text-anchor="middle">{r:g}</text>')
        parts.append(f'<text x="{sx(xmax / 2)}" y="{sy(0) + 28}" text-anchor="middle">offered rate (req/s)</text>')
        slo_line = {"itl_p99": a.slo_itl * 1e3, "ttft_p99": a.slo_ttft * 1e3}.get(key)
        if slo_line is not None and slo_line <= ymax:
            parts.append(f'<line x1="{sx(0)}" y1="{sy(slo_line)}" x2="{sx(xmax)}" y2="{sy(slo_line)}" '
                         'stroke="grey" stroke-dasharray="4 3"/>')
        for name, by_rate in results.items():
            colour = colours[name.partition("+")[0]]
            dash = ' stroke-dasharray="6 3"' if "+slo" in name else ""
            pts = " ".join(f"{sx(r)},{sy(by_rate[r][key])}" for r in rates)
            parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2"{dash} points="{pts}"/>')
            for r in rates:
                parts.append(f'<circle cx="{sx(r)}" cy="{sy(by_rate[r][key])}" r="3" fill="{colour}"/>')
    for j, name in enumerate(results):
        colour = colours[name.partition("+")[0]]
        dash = ' stroke-dasharray="6 3"' if "+slo" in name else ""
        parts.append(f'<line x1="{20 + 150 * j}" y1="{h + 46}" x2="{34 + 150 * j}" y2="{h + 46}" stroke="{colour}" '
                     f'stroke-width="3"{dash}/><text x="{38 + 150 * j}" y="{h + 50}">{name}</text>')
    parts.append("</svg>")
    Path(path).write_text("\n".join(parts) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the real SmolLM2 from scripts/fetch-model.sh)")
    ap.add_argument("--bin", default=str(REPO / "build" / "baton"))
    ap.add_argument("--batonctl", default=str(REPO / "build" / "batonctl"))
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 2, 4, 8])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--min-seconds", type=float, default=0,
                    help="at least this many seconds of arrivals a point (more requests at high rates)")
    ap.add_argument("--configs", nargs="+", default=ALL_CONFIGS, choices=ALL_CONFIGS)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--long-prompt-tokens", type=int, default=0, help="a mixed workload: some prompts this long")
    ap.add_argument("--long-fraction", type=float, default=0.2, help="the share of long prompts")
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    ap.add_argument("--slo-itl", type=float, default=0.05, help="seconds, per-request p99 inter-token gap")
    ap.add_argument("--seed", type=int, default=1, help="the first rate's prompts; rate i uses seed + i")
    ap.add_argument("--extra", default="", help="more `baton local` flags for every configuration")
    ap.add_argument("--plot", help="SVG to write")
    ap.add_argument("--save", help="write every point's results to this JSON file")
    ap.add_argument("--reuse", help="a --save file of an earlier run (same flags): its points of configurations "
                                    "not in --configs join the table and the plot")
    a = ap.parse_args()
    model = a.model or subprocess.run([str(REPO / "scripts" / "fetch-model.sh")], check=True, capture_output=True,
                                      text=True).stdout.strip().splitlines()[-1]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, rate in enumerate(a.rates):
            for name in a.configs:
                srv = Server(a.bin, model, *config_flags(name, a), *shlex.split(a.extra))
                try:
                    results.setdefault(name, {})[rate] = bench(a, srv, rate, a.seed + i, tmp)
                finally:
                    srv.stop()
                print(f"  {rate:g} req/s {name}: {results[name][rate]}", file=sys.stderr, flush=True)
    if a.save:
        Path(a.save).write_text(json.dumps({n: {str(r): v for r, v in by.items()} for n, by in results.items()},
                                           indent=1) + "\n")
    configs = list(a.configs)
    if a.reuse:
        for name, by_rate in json.loads(Path(a.reuse).read_text()).items():
            if name not in results:
                results[name] = {float(r): v for r, v in by_rate.items()}
        configs = [c for c in ALL_CONFIGS if c in results]
        results = {c: results[c] for c in configs}
    workload = (f"{a.prompt_tokens} ({100 * a.long_fraction:.0f} % of them {a.long_prompt_tokens})"
                if a.long_prompt_tokens else f"{a.prompt_tokens}")
    per_point = (f"{a.requests} requests per point (at least {a.min_seconds:g} s of arrivals)" if a.min_seconds
                 else f"{a.requests} requests per point")
    print(f"{per_point}, {workload}+{a.output_tokens} tokens, Poisson arrivals; SLO: "
          f"TTFT <= {a.slo_ttft * 1e3:.0f} ms and per-request ITL p99 <= {a.slo_itl * 1e3:.0f} ms")
    print("| rate req/s | config | goodput req/s | attainment (of admitted) | throughput req/s | TTFT p50 / p99 ms | "
          "ITL p50 / p99 ms | refused | other failures | TTFT prediction error p50 / p90 | cached prompt tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v: "-" if v is None else f"{100 * v:.0f} %"  # noqa: E731
    for rate in a.rates:
        for name in configs:
            r = results[name][rate]
            print(f"| {rate:g} | {name} | {r['goodput']:.2f} | {100 * r['attainment']:.0f} % "
                  f"({100 * r['admitted_attainment']:.0f} %) | {r['throughput']:.2f} | "
                  f"{r['ttft_p50']:.0f} / {r['ttft_p99']:.0f} | {r['itl_p50']:.1f} / {r['itl_p99']:.1f} | "
                  f"{r['refused']} | {r['failed'] - r['refused']} | {fmt(r['pred_p50'])} / {fmt(r['pred_p90'])} | "
                  f"{r['cached']} of {r['prompt']} |")
    if a.plot:
        svg_plot(results, a.rates, a.plot, a)
        print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
