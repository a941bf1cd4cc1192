#!/usr/bin/env python3
"""Slow clients against the frontend's HTTP API and /metrics: N connections that send half a
request line and then nothing (slowloris), M more on the metrics port, then one real completion
request and one scrape, each timed. Prints a Markdown table for bench/RESULTS.md.

Run from the repository root after scripts/build.sh, with the test venv (scripts/env.sh):
  $BATON_VENV/bin/python bench/slow_clients.py [--api-conns 2000] [--metrics-conns 200]
      [--http-threads 512] [--model GGUF]
"""

import argparse
import json
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from serving_harness import Server  # noqa: E402


def open_slow(port, n, line):
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(line)
        socks.append(s)
    return socks


def timed(fn):
    t0 = time.monotonic()
    try:
        fn()
        return time.monotonic() - t0, "ok"
    except Exception as e:  # noqa: BLE001 (reported, not raised: the figure is the point)
        return time.monotonic() - t0, type(e).__name__


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=str(REPO / "build" / "baton"))
    ap.add_argument("--model", help="GGUF (default: the real SmolLM2 from scripts/fetch-model.sh)")
    ap.add_argument("--api-conns", type=int, default=2000)
    ap.add_argument("--metrics-conns", type=int, default=200)
    ap.add_argument("--http-threads", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=60, help="the client's limit for each timed request")
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 2 * (a.api_conns + a.metrics_conns) + 256)), hard))
    model = a.model or subprocess.run([str(REPO / "scripts" / "fetch-model.sh")], check=True, capture_output=True,
                                      text=True).stdout.strip().splitlines()[-1]
    srv = Server(a.bin, model, "--http-listen", "127.0.0.1:0", "--http-threads", str(a.http_threads))
    rows = []
    try:
        body = json.dumps({"prompt": "The capital of France is", "max_tokens": 8}).encode()

        def completion():
            req = urllib.request.Request(f"{srv.http_url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=a.timeout) as r:
                assert r.status == 200

        def scrape():
            with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=a.timeout) as r:
                assert b"baton_" in r.read()

        rows.append(("no slow connections", *timed(completion), *timed(scrape)))
        api = open_slow(srv.http_port, a.api_conns, b"POST /v1/compl")
        metrics = open_slow(srv.metrics_port, a.metrics_conns, b"GET /metr")
        time.sleep(1)
        rows.append((f"{a.api_conns} on the API, {a.metrics_conns} on /metrics", *timed(completion), *timed(scrape)))
        for s in api + metrics:
            s.close()
    finally:
        srv.stop()
    print(f"\n--http-threads {a.http_threads}\n")
    print("| slow connections open | completion s | | scrape s | |")
    print("|---|---|---|---|---|")
    for what, tc, rc, ts, rs in rows:
        print(f"| {what} | {tc:.2f} | {rc} | {ts:.2f} | {rs} |")


if __name__ == "__main__":
    main()
