#!/usr/bin/env python3
"""bench/model_8b: single-stream decode at 8B scale, Q4_0, beside llama.cpp, in interleaved rounds.

The model has Llama 3 8B's shape (hidden 4096, 32 layers, 32 heads / 8 KV heads, head dim 128, FFN
14336, vocab 128256, an output matrix of its own) as a Q4_0 GGUF whose blocks are random: each
block's 16 bytes of nibbles uniform, its fp16 scale ±fan_in^-1/2 / 4.64 (the standard deviation
of q − 8 for uniform q), so activations stay O(1). No float weights are made: the 4.5 GB file is
written in about a minute. Norms are f32 near 1.

Each round runs baton_bench_decode (batch 1, context 512, the median step, native weights alone: a
dense copy of 8B would not fit beside them in 24 GiB) and, with --llama-bench,
llama.cpp's `llama-bench -p 0 -n 128` (tg128) on the same file and threads, one after the other;
the machine's memory bandwidth drifts, so the ratio is reported round by round and as the median.

--small writes the same architecture at hidden 256, 2 layers, 4 / 2 heads (head dim 64), FFN 512,
vocab 2048, and decodes 8 steps at context 32: tests/e2e/test_bench_model_1b.py runs it so that the
script keeps working. Its figures say nothing of 8B.

  bench/model_8b.py [--small] [--out PATH] [--rounds N] [--threads N] [--build DIR]
                    [--llama-bench PATH] [--keep]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_1b import REPO, bench_table, llama_gguf_writer, row_where, run  # noqa: E402

SIZES = {
    "8b": dict(shape=dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn=14336, vocab=128256, ctx=8192),
               context=512, steps=32),
    "small": dict(shape=dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn=512, vocab=2048, ctx=512),
                  context=32, steps=8),
}


def random_q4_0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """[rows, cols / 32 * 18] bytes of Q4_0 blocks: an fp16 scale, then 16 bytes of nibbles."""
    nb = rows * (cols // 32)
    d = (rng.choice([-1.0, 1.0], size=nb) * cols ** -0.5 / 4.64).astype(np.float16)
    blocks = np.empty((nb, 18), dtype=np.uint8)
    blocks[:, :2] = d.view(np.uint8).reshape(nb, 2)
    blocks[:, 2:] = rng.integers(0, 256, size=(nb, 16), dtype=np.uint8)
    return blocks.reshape(rows, (cols // 32) * 18)


def write_model(path: Path, s: dict, seed: int) -> None:
    import gguf
    rng = np.random.default_rng(seed)
    g = llama_gguf_writer(path, s, gguf.LlamaFileType.MOSTLY_Q4_0)
    hd = s["dim"] // s["n_heads"]
    q4 = gguf.GGMLQuantizationType.Q4_0

    def mat(name: str, rows: int, cols: int) -> None:
        g.add_tensor(name, random_q4_0(rng, rows, cols), raw_dtype=q4)

    def norm(name: str) -> None:
        g.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(s["dim"])).astype(np.float32))

    mat("token_embd.weight", s["vocab"], s["dim"])
    norm("output_norm.weight")
    mat("output.weight", s["vocab"], s["dim"])
    for i in range(s["n_layers"]):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        norm(p + "ffn_norm.weight")
        mat(p + "attn_q.weight", s["n_heads"] * hd, s["dim"])
        mat(p + "attn_k.weight", s["n_kv_heads"] * hd, s["dim"])
        mat(p + "attn_v.weight", s["n_kv_heads"] * hd, s["dim"])
        mat(p + "attn_output.weight", s["dim"], s["n_heads"] * hd)
        mat(p + "ffn_gate.weight", s["ffn"], s["dim"])
        mat(p + "ffn_up.weight", s["ffn"], s["dim"])
        mat(p + "ffn_down.weight", s["dim"], s["ffn"])
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="a tiny model of the same architecture, short runs")
    ap.add_argument("--out", help="the GGUF (/tmp/baton-8b-q4_0.gguf; with --small /tmp/baton-8b-small.gguf)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--build", default=str(REPO / "build"))
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench binary (../shared/tools/peer-bench builds it)")
    ap.add_argument("--keep", action="store_true", help="keep the GGUF (it is removed at the end otherwise)")
    a = ap.parse_args()
    size = "small" if a.small else "8b"
    z = SIZES[size]
    s = z["shape"]
    out = Path(a.out or ("/tmp/baton-8b-small.gguf" if a.small else "/tmp/baton-8b-q4_0.gguf"))
    if not out.exists():
        t0 = time.perf_counter()
        write_model(out, s, a.seed)
        print(f"wrote {out} ({out.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    try:
        print(f"model: Llama 3 8B's shape{' (small)' if a.small else ''}, Q4_0, {out.stat().st_size / 1e9:.2f} GB; "
              f"threads {a.threads}; decode batch 1 at context {z['context']}\n")
        print("| round | baton tok/s | llama.cpp tg128 tok/s | baton / llama.cpp |")
        print("|---|---|---|---|")
        ratios, ours, theirs = [], [], []
        for r in range(1, a.rounds + 1):
            bench = str(Path(a.build) / "bench" / "baton_bench_decode")
            rows = bench_table([bench, str(out), "--batch", "1", "--context", str(z["context"]), "--steps",
                                str(z["steps"]), "--threads", str(a.threads), "--kv-dtype", "bf16", "--weights", "native-only"],
                               ("batch", "output tok/s"))
            tok_s = row_where(rows, "batch", 1, "baton_bench_decode")["output tok/s"]
            ours.append(tok_s)
            peer = "-"
            ratio = "-"
            if a.llama_bench:
                csv = run([a.llama_bench, "-m", str(out), "-p", "0", "-n", "128", "-t", str(a.threads), "-r", "1",
                           "-o", "csv"], timeout=3600).strip().splitlines()
                header, last = csv[0].split(","), csv[-1].split(",")
                tg = float(last[header.index("avg_ts")].strip('"'))
                theirs.append(tg)
                ratios.append(tok_s / tg)
                peer, ratio = f"{tg:.2f}", f"{tok_s / tg:.2f}"
            print(f"| {r} | {tok_s:.2f} | {peer} | {ratio} |", flush=True)
        if ratios:
            print(f"| median | {statistics.median(ours):.2f} | {statistics.median(theirs):.2f} | "
                  f"{statistics.median(ratios):.2f} |")
    finally:
        if not a.keep:
            out.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
