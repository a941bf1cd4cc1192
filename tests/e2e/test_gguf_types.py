"""GGUF tensor types that llama.cpp's presets write besides the ones baton keeps natively: Q2_K
(Q2_K presets), Q3_K (Q3_K_S/M/L), IQ4_NL and IQ4_XS. A Llama-shaped GGUF whose GEMM weights are
random blocks of the type (every quant byte random; the fp16 scales small and finite) is run by
`baton generate --dtype f32`, and every prompt position's logits must match reference.py, which
dequantises the same blocks with the `gguf` package's own dequantisers: the blocks are decoded
the same way, or the logits part by far more than f32 rounding (LOGITS_TOL, as for the other
types in test_reference_archs.py)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import reference

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from model_1b import llama_gguf_writer  # noqa: E402

LOGITS_TOL = 1e-4
TIMEOUT = 300
SHAPE = dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn=512, vocab=512, ctx=256)

# Byte offsets of each block's fp16 scales, and a scale that keeps a row's values near
# fan_in^-1/2 for random quants (the block's largest value times its quant and sub-scale ranges).
SCALES = {
    "Q2_K": ([80, 82], 0.08),     # d, dmin: d·(0..15)·(0..3) − dmin·(0..15)
    "Q3_K": ([108], 0.01),        # d·(−32..31)·(−4..3)
    "IQ4_NL": ([0], 0.015),       # d·(−127..113)
    "IQ4_XS": ([0], 0.0008),      # d·(−32..31)·(−127..113)
}


@pytest.fixture(scope="module")
def seed() -> int:
    s = int(os.environ.get("BATON_REFERENCE_SEED", random.randrange(1 << 31)))
    print(f"random seed {s} (BATON_REFERENCE_SEED={s} replays it)")
    return s


def random_blocks(rng: np.random.Generator, qtype, name: str, rows: int, cols: int) -> np.ndarray:
    import gguf
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    nb = rows * cols // block_elems
    blocks = rng.integers(0, 256, size=(nb, block_bytes), dtype=np.uint8)
    offsets, scale = SCALES[name]
    for at in offsets:
        d = (scale * cols ** -0.5 * rng.uniform(0.5, 1.5, size=nb)).astype(np.float16)
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, cols // block_elems * block_bytes)


def write_model(path: Path, name: str, rng: np.random.Generator) -> None:
    import gguf
    s = SHAPE
    qtype = gguf.GGMLQuantizationType[name]
    g = llama_gguf_writer(path, s, gguf.LlamaFileType.ALL_F32)
    hd = s["dim"] // s["n_heads"]

    def f32(n, rows, cols, std):
        g.add_tensor(n, (rng.standard_normal((rows, cols)) * std).astype(np.float32).squeeze())

    f32("token_embd.weight", s["vocab"], s["dim"], 1.0)
    g.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(s["dim"])).astype(np.float32))
    f32("output.weight", s["vocab"], s["dim"], s["dim"] ** -0.5)
    for i in range(s["n_layers"]):
        p = f"blk.{i}."
        for norm in ("attn_norm", "ffn_norm"):
            g.add_tensor(p + norm + ".weight", (1 + 0.1 * rng.standard_normal(s["dim"])).astype(np.float32))
        for t, rows, cols in (("attn_q", s["n_heads"] * hd, s["dim"]), ("attn_k", s["n_kv_heads"] * hd, s["dim"]),
                              ("attn_v", s["n_kv_heads"] * hd, s["dim"]), ("attn_output", s["dim"], s["n_heads"] * hd),
                              ("ffn_gate", s["ffn"], s["dim"]), ("ffn_up", s["ffn"], s["dim"]),
                              ("ffn_down", s["dim"], s["ffn"])):
            g.add_tensor(p + t + ".weight", random_blocks(rng, qtype, name, rows, cols), raw_dtype=qtype)
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()


@pytest.mark.parametrize("name", list(SCALES))
def test_type_loads_and_decodes_as_gguf_dequantises_it(baton_bin, tmp_path, seed, name):
    import gguf
    rng = np.random.default_rng([seed, list(SCALES).index(name)])
    model = tmp_path / f"{name}.gguf"
    write_model(model, name, rng)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(model)).tensors}
    assert types["blk.0.ffn_down.weight"] == name and types["token_embd.weight"] == "F32", types

    ref = reference.Reference(str(model))
    pr = random.Random(f"{seed}/{name}")
    ids = [pr.randrange(ref.vocab) for _ in range(pr.randint(8, 40))]
    want, _, _ = ref.run(ids, 1)
    assert np.all(np.isfinite(want))
    out = tmp_path / "logits.npy"
    p = subprocess.run([baton_bin, "generate", "--model", str(model), "--dtype", "f32", "--prompt-ids",
                        ",".join(map(str, ids)), "--max-tokens", "1", "--logits-all-out", str(out)],
                       capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-2000:]
    got = np.load(out).astype(np.float64)
    assert got.shape == want.shape
    logit_range = float(want.max() - want.min())
    err = np.abs(got - want.astype(np.float64)).max()
    print(f"{name}: {len(ids)} positions, max |error| {err / logit_range:.3g} x range {logit_range:.3g}")
    assert logit_range > 1.0, "the random model's logits are flat: the test would not see a wrong decoder"
    assert err <= LOGITS_TOL * logit_range
