"""baton's f32 forward on random `baton tools make-test-model` models of each architecture it
supports, against the independent numpy reference (reference.py):

  * llama: RoPE on ADJACENT pairs (x[2i], x[2i+1]), no biases;
  * qwen2: NEOX RoPE on pairs (x[i], x[i + d/2]), biases on q, k and v;
  * qwen3: NEOX RoPE, an RMSNorm of every q and k head before it, and a head dim of its own
    (n_heads · head_dim differs from the embedding width).

For each, a model of random shape (heads, GQA ratio, head dim, layers, FFN width, tied or separate
LM head) and random weights is written with a fresh seed each run (printed: rerun with
BATON_REFERENCE_SEED=<seed>), and `baton generate --dtype f32 --logits-all-out` on a random prompt
must give every prompt position's logits within LOGITS_TOL x the reference's logit range, and the
same greedy continuation (EOS ignored) unless the reference's top-2 margin at the first differing
step is within the tolerance (a near-tie that f32 rounding may flip).

Tolerance: baton computes in f32 (f32 GEMM, attention, norms); the reference in float64 from the
same f32 weights. f32 rounding (2^-24 relative per operation) over dot products of at most a few
hundred terms and three layers leaves errors near 1e-6 of the logit range (measured: 2e-7 to
1e-6), so 1e-4 leaves a 100x margin. The mistakes this test is for are far larger (measured on
three seeds by breaking the reference on purpose): adjacent-pair RoPE on qwen2 is off by 0.4-0.6
of the range, dropped q/k/v biases by 0.1-0.2. Position 0 is rotated by angle 0 under either
pairing, so every position is compared.
"""

from __future__ import annotations

import os
import random
import subprocess

import numpy as np
import pytest

import reference

LOGITS_TOL = 1e-4  # x the reference's logit range over the prompt
N_GEN = 16
TIMEOUT = 300  # seconds, per baton invocation


@pytest.fixture(scope="module")
def seed() -> int:
    s = int(os.environ.get("BATON_REFERENCE_SEED", random.randrange(1 << 31)))
    print(f"random seed {s} (BATON_REFERENCE_SEED={s} replays it)")
    return s


def make_model(baton_bin, path, arch, rng):
    """Writes a random model of `arch` with a random shape; returns its make-test-model flags."""
    n_heads = rng.choice([2, 4, 8])
    n_kv_heads = rng.choice([k for k in (1, 2, 4, 8) if n_heads % k == 0])
    head_dim = rng.choice([8, 16, 32])
    dim = n_heads * head_dim
    flags = ["--arch", arch, "--seed", str(rng.randrange(1 << 31)), "--layers", str(rng.randint(1, 3)),
             "--dim", str(dim), "--heads", str(n_heads), "--kv-heads", str(n_kv_heads),
             "--ffn", str(rng.choice([64, 96, 192])), "--ctx", "256"]
    if arch == "qwen3":
        flags[flags.index("--dim") + 1] = str(rng.choice([d for d in (24, 48, 64, 96, 160) if d != dim]))
        flags += ["--head-dim", str(head_dim)]
    if rng.random() < 0.5:
        flags.append("--tied")
    p = subprocess.run([baton_bin, "tools", "make-test-model", "--out", str(path), *flags],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr
    return flags


def baton_generate(baton_bin, model, ids, logits_path):
    """(every prompt position's logits [T, vocab] float32, N_GEN greedy ids) from baton, f32."""
    p = subprocess.run(
        [baton_bin, "generate", "--model", str(model), "--dtype", "f32", "--prompt-ids", ",".join(map(str, ids)),
         "--max-tokens", str(N_GEN), "--print-ids", "--ignore-eos", "--logits-all-out", str(logits_path)],
        capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"baton generate exited {p.returncode}: {p.stderr[-2000:]}"
    logits = np.load(logits_path)
    assert logits.dtype == np.float32 and logits.shape[0] == len(ids), (logits.dtype, logits.shape)
    return logits, [int(t) for t in p.stdout.strip().split(",") if t]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_logits_and_greedy_match_the_reference(baton_bin, tmp_path, seed, arch):
    rng = random.Random(f"{seed}/{arch}")
    model = tmp_path / f"{arch}.gguf"
    flags = make_model(baton_bin, model, arch, rng)
    ref = reference.Reference(str(model))
    print(f"{arch}: make-test-model {' '.join(flags)}")
    # The model exercises what sets the architecture apart, read from the GGUF alone.
    assert ref.arch == arch and ref.neox == (arch in ("qwen2", "qwen3"))
    assert all((L["attn_q_norm"] is not None) == (arch == "qwen3") for L in ref.layers)
    if arch == "qwen3":
        assert ref.n_head * ref.head_dim != ref.dim
    has_bias = [L[k] is not None for L in ref.layers for k in ("attn_q_b", "attn_k_b", "attn_v_b")]
    assert all(has_bias) if arch == "qwen2" else not any(has_bias)

    ids = [rng.randrange(ref.vocab) for _ in range(rng.randint(24, 64))]
    want_logits, want_ids, margins = ref.run(ids, N_GEN)
    got_logits, got_ids = baton_generate(baton_bin, model, ids, tmp_path / f"{arch}.npy")
    assert got_logits.shape == want_logits.shape

    logit_range = float(want_logits.max() - want_logits.min())
    err = np.abs(got_logits.astype(np.float64) - want_logits.astype(np.float64))
    worst = np.unravel_index(np.argmax(err), err.shape)
    print(f"{arch}: {len(ids)} positions, max |error| {err.max():.3g} = {err.max() / logit_range:.3g} x range "
          f"{logit_range:.3g} (at position {worst[0]})")
    assert err.max() <= LOGITS_TOL * logit_range, (
        f"{arch}: logits differ by {err.max() / logit_range:.3g} x range at position {worst[0]}, "
        f"token {worst[1]} (tolerance {LOGITS_TOL})")

    assert len(got_ids) == N_GEN
    if got_ids != want_ids:
        i = next(i for i, (g, w) in enumerate(zip(got_ids, want_ids)) if g != w)
        assert margins[i] <= LOGITS_TOL * logit_range, (
            f"{arch}: greedy ids differ at step {i} ({got_ids[i]} vs reference {want_ids[i]}) where the reference's "
            f"top-2 margin {margins[i]:.3g} is no near-tie\nbaton     {got_ids}\nreference {want_ids}")
        print(f"{arch}: greedy ids part at step {i}, a near-tie (margin {margins[i]:.3g})")


# ---- K-quant weights ------------------------------------------------------------------------
# The same comparison on models whose GEMM weights are K-quant blocks (make-test-model
# --gemm-type): the reference dequantises them with the `gguf` package, baton with its own
# decoders (model/dequant.cpp), so the f32 forward must agree as closely as on f32 weights. Then
# baton's native kernels (the blocks kept quantised, int8 activations) against baton's own dense
# forward: int8 activations cost ~1/254 of each block's largest value per term; measured on
# these models 0.5-1 % of the logit range, so 3 % bounds it while a wrong scale or a misplaced
# nibble costs far more (measured: taking each Q4_K sub-block's neighbour's scale gives 45-57 %).
# Q5_K has no native kernel: it stays dense, and the two agree exactly.
NATIVE_TOL = 3e-2


def baton_logits(baton_bin, model, ids, path, weights):
    p = subprocess.run(
        [baton_bin, "generate", "--model", str(model), "--dtype", "f32", "--weights", weights,
         "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "1", "--logits-all-out", str(path)],
        capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"baton generate exited {p.returncode}: {p.stderr[-2000:]}"
    return np.load(path)


@pytest.mark.parametrize("gemm_type", ["q4_k", "q5_k", "q6_k", "mixed"])
def test_kquant_weights_match_the_reference_and_native_kernels_match_dense(baton_bin, tmp_path, seed, gemm_type):
    rng = random.Random(f"{seed}/{gemm_type}")
    n_heads = rng.choice([4, 8])
    flags = ["--seed", str(rng.randrange(1 << 31)), "--layers", str(rng.randint(1, 2)), "--dim", "256",
             "--heads", str(n_heads), "--kv-heads", str(rng.choice([k for k in (1, 2, 4) if n_heads % k == 0])),
             "--ffn", str(rng.choice([256, 512])), "--ctx", "256", "--gemm-type", gemm_type]
    model = tmp_path / f"{gemm_type}.gguf"
    p = subprocess.run([baton_bin, "tools", "make-test-model", "--out", str(model), *flags],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr
    print(f"{gemm_type}: make-test-model {' '.join(flags)}")
    ref = reference.Reference(str(model))
    ids = [rng.randrange(ref.vocab) for _ in range(rng.randint(16, 48))]
    want_logits, _, _ = ref.run(ids, 1)

    dense = baton_logits(baton_bin, model, ids, tmp_path / "dense.npy", "dense")
    logit_range = float(want_logits.max() - want_logits.min())
    err = np.abs(dense.astype(np.float64) - want_logits.astype(np.float64)).max()
    print(f"{gemm_type}: dense vs reference {err / logit_range:.3g} x range")
    assert err <= LOGITS_TOL * logit_range

    native = baton_logits(baton_bin, model, ids, tmp_path / "native.npy", "native")
    err = np.abs(native.astype(np.float64) - dense.astype(np.float64)).max()
    top1 = float(np.mean(native.argmax(1) == dense.argmax(1)))
    print(f"{gemm_type}: native vs dense {err / logit_range:.3g} x range, top-1 agreement {top1:.3f}")
    assert err <= NATIVE_TOL * logit_range
