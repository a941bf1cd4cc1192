#!/usr/bin/env python3
"""Disaggregated against colocated baton on the same machine, as DistServe measures it: at each
offered load (open loop, Poisson arrivals, `batonctl bench --rate R`), goodput = requests per
second that met both SLOs (TTFT and per-request p99 inter-token latency), with TTFT and ITL p99.

  disaggregated  `baton local`: one prefill and one decode worker, each engine on its own cores
                 (the default split), KV streamed layer by layer over loopback gRPC
  colocated      `baton local --prefill-workers 0 --local-prefill-max-tokens 1000000`: one decode
                 worker that prefills every prompt itself in its decode steps (chunked, the
                 --local-prefill-token-budget tokens a step), on every core

Every point is measured cold: a fresh server per (configuration, rate), and fresh prompts per
rate (the seed is --seed + the rate's index, the same for both configurations, so both see the
same prompts). Nothing is served from another point's prefix cache, and the cached prompt tokens
of each point are reported beside it. (With one server per configuration and one seed for every
rate, every point after the first was a cache benchmark on the disaggregated side only: its
prefill worker has a prefix cache, the colocated decode worker's local prefill has none.)

Writes a Markdown table to stdout and an SVG (goodput, ITL p99, TTFT p99 against the offered
rate, both configurations) to --plot.

Run from the repository root after scripts/build.sh, with the test venv (scripts/env.sh):
  $BATON_VENV/bin/python bench/goodput.py [--model GGUF] [--rates 0.5 1 2 3] [--requests 40]
      [--prompt-tokens 256] [--output-tokens 64] [--slo-ttft 1.0] [--slo-itl 0.05] [--plot goodput.svg]
"""

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from serving_harness import Server  # noqa: E402

CONFIGS = {
    "disaggregated": [],
    "colocated": ["--prefill-workers", "0", "--local-prefill-max-tokens", "1000000"],
}


def bench(a, srv, rate, seed, tmp):
    out = Path(tmp) / f"r{rate}.json"
    cmd = [a.batonctl, "bench", "--address", srv.address, "--rate", str(rate), "--requests", str(a.requests),
           "--warmup", "2", "--prompt-tokens", str(a.prompt_tokens), "--output-tokens", str(a.output_tokens),
           "--slo-ttft", str(a.slo_ttft), "--slo-itl", str(a.slo_itl), "--seed", str(seed), "--json", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600)
    j = json.loads(out.read_text())
    return {
        "goodput": j["slo"]["goodput_requests_per_second"],
        "attainment": j["slo"]["attainment"],
        "throughput": j["throughput"]["requests_per_second"],
        "ttft_p50": j["latency_ms"]["ttft"]["p50"], "ttft_p99": j["latency_ms"]["ttft"]["p99"],
        "itl_p50": j["latency_ms"]["itl"]["p50"], "itl_p99": j["latency_ms"]["itl"]["p99"],
        "failed": j["requests"]["failed"],
        "cached": j["tokens"]["cached_prompt"], "prompt": j["tokens"]["prompt"],
    }


def svg_plot(results, rates, path, a):
    """Three panels side by side: goodput, ITL p99, TTFT p99 against the offered rate."""
    colours = {"disaggregated": "#1f77b4", "colocated": "#d62728"}
    panels = [("goodput (req/s)", "goodput"), ("ITL p99 (ms)", "itl_p99"), ("TTFT p99 (ms)", "ttft_p99")]
    w, h, pad = 300, 220, 45
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{3 * w + 20}" height="{h + 60}" '
             'font-family="sans-serif" font-size="11">',
             f'<text x="10" y="16" font-size="13">baton: disaggregated vs colocated, {a.prompt_tokens}+'
             f'{a.output_tokens} tokens, SLO TTFT {a.slo_ttft * 1e3:.0f} ms, ITL p99 {a.slo_itl * 1e3:.0f} ms</text>']
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
        if key == "itl_p99":
            parts.append(f'<line x1="{sx(0)}" y1="{sy(a.slo_itl * 1e3)}" x2="{sx(xmax)}" y2="{sy(a.slo_itl * 1e3)}" '
                         'stroke="grey" stroke-dasharray="4 3"/>')
        if key == "ttft_p99":
            parts.append(f'<line x1="{sx(0)}" y1="{sy(a.slo_ttft * 1e3)}" x2="{sx(xmax)}" y2="{sy(a.slo_ttft * 1e3)}" '
                         'stroke="grey" stroke-dasharray="4 3"/>')
        for name, by_rate in results.items():
            pts = " ".join(f"{sx(r)},{sy(by_rate[r][key])}" for r in rates)
            parts.append(f'<polyline fill="none" stroke="{colours[name]}" stroke-width="2" points="{pts}"/>')
            for r in rates:
                parts.append(f'<circle cx="{sx(r)}" cy="{sy(by_rate[r][key])}" r="3" fill="{colours[name]}"/>')
    for j, name in enumerate(results):
        parts.append(f'<rect x="{20 + 150 * j}" y="{h + 42}" width="12" height="4" fill="{colours[name]}"/>'
                     f'<text x="{36 + 150 * j}" y="{h + 48}">{name}</text>')
    parts.append("</svg>")
    Path(path).write_text("\n".join(parts) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the real SmolLM2 from scripts/fetch-model.sh)")
    ap.add_argument("--bin", default=str(REPO / "build" / "baton"))
    ap.add_argument("--batonctl", default=str(REPO / "build" / "batonctl"))
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 2, 3])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    ap.add_argument("--slo-itl", type=float, default=0.05, help="seconds, per-request p99 inter-token gap")
    ap.add_argument("--seed", type=int, default=1, help="the first rate's prompts; rate i uses seed + i")
    ap.add_argument("--extra", default="", help="more `baton local` flags for both configurations")
    ap.add_argument("--plot", help="SVG to write")
    a = ap.parse_args()
    model = a.model or subprocess.run([str(REPO / "scripts" / "fetch-model.sh")], check=True, capture_output=True,
                                      text=True).stdout.strip().splitlines()[-1]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, rate in enumerate(a.rates):
            for name, flags in CONFIGS.items():
                srv = Server(a.bin, model, *flags, *shlex.split(a.extra))
                try:
                    results.setdefault(name, {})[rate] = bench(a, srv, rate, a.seed + i, tmp)
                finally:
                    srv.stop()
    print(f"{a.requests} requests per point, {a.prompt_tokens}+{a.output_tokens} tokens, Poisson arrivals; SLO: "
          f"TTFT <= {a.slo_ttft * 1e3:.0f} ms and per-request ITL p99 <= {a.slo_itl * 1e3:.0f} ms")
    print("| rate req/s | config | goodput req/s | attainment | throughput req/s | TTFT p50 / p99 ms | "
          "ITL p50 / p99 ms | failed | cached prompt tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rate in a.rates:
        for name in CONFIGS:
            r = results[name][rate]
            print(f"| {rate:g} | {name} | {r['goodput']:.2f} | {100 * r['attainment']:.0f} % | {r['throughput']:.2f} | "
                  f"{r['ttft_p50']:.0f} / {r['ttft_p99']:.0f} | {r['itl_p50']:.1f} / {r['itl_p99']:.1f} | "
                  f"{r['failed']} | {r['cached']} of {r['prompt']} |")
    if a.plot:
        svg_plot(results, a.rates, a.plot, a)
        print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
