#!/usr/bin/env python3
"""How often a re-prefill changes the rest of a generation, in one process (`baton generate`).

A failover re-prefills prompt + the tokens already streamed: positions the decode path computed
one at a time are computed again by the prefill path as one matrix. Draws are keyed by (seed,
position), so the continuation is the same unless the two paths' rounding moves a logit across a
decision: a near-tie of the top two logits (greedy), or a cumulative-probability boundary within
rounding of the draw's uniform number (sampling). This measures that rate: for random prompts,
seeds and re-prefill points k, it compares generate(prompt, n)[k:] with
generate(prompt + first k tokens, n - k).

  python3 bench/reprefill_drift.py --model GGUF [--trials 20] [--tokens 300] [--temperature 0.8]
"""

import argparse
import random
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def generate(a, prompt, n, seed):
    out = subprocess.run([a.bin, "generate", "--model", a.model, "--prompt-ids", ",".join(map(str, prompt)),
                          "--max-tokens", str(n), "--ignore-eos", "--print-ids", "--dtype", a.dtype, "--temperature",
                          str(a.temperature), "--seed", str(seed), "--threads", str(a.threads)],
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    return [int(x) for x in out.split(",")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--bin", default=str(REPO / "build" / "baton"))
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--vocab", type=int, default=270, help="prompt ids are drawn from [3, 3 + vocab)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    diverged, compared = 0, 0
    for trial in range(a.trials):
        prompt = [3 + rng.randrange(a.vocab) for _ in range(a.prompt_tokens)]
        seed = rng.randrange(1, 1 << 31)
        full = generate(a, prompt, a.tokens, seed)
        k = rng.randrange(a.tokens // 10, a.tokens // 2)
        rest = generate(a, prompt + full[:k], a.tokens - k, seed)
        d = next((i for i, (x, y) in enumerate(zip(full[k:], rest)) if x != y), None)
        compared += (a.tokens - k) if d is None else d + 1
        diverged += d is not None
        print(f"trial {trial}: re-prefill at {k}: " + ("same to the end" if d is None else f"differs at {k + d}"))
    print(f"{Path(a.model).name} {a.dtype} T={a.temperature}: {diverged} of {a.trials} continuations differ; "
          f"{compared} tokens compared up to the first difference")


if __name__ == "__main__":
    main()
