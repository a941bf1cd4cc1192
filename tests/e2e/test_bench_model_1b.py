"""bench/model_1b.py --small: the 1B benchmark's whole path (the three forms written, load and peak
RSS, prefill, decode against the bandwidth) on a tiny model of the same architecture, so that the
script keeps running; its full run is in bench/RESULTS.md, "At 1B scale". The script reads the
benches' tables by their header's column names: a column renamed or gone fails it here, and a
column added elsewhere in a table does not move what it reads."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "build"
SCRIPT = REPO / "bench" / "model_1b.py"
FORMS = ("hf-bf16", "gguf-bf16", "gguf-q4_0")


def model_1b(baton_bin: str, out: Path, build: Path = BUILD) -> subprocess.CompletedProcess:
    # Two threads: the bandwidth's arrays are 256 MiB per thread.
    return subprocess.run([sys.executable, str(SCRIPT), "--small", "--dir", str(out / "model"), "--threads", "2",
                           "--build", str(build), "--baton", baton_bin, "--json", str(out / "results.json")],
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def benches() -> None:
    for name in ("baton_bench_prefill", "baton_bench_decode"):
        if not (BUILD / "bench" / name).exists():
            pytest.skip(f"{BUILD / 'bench' / name} not built (scripts/build.sh)")


def test_model_1b_small_measures_every_form(baton_bin, benches, tmp_path, measure):
    p = model_1b(baton_bin, tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["size"] == "small" and r["threads"] == 2 and r["bandwidth_gb_s"] > 0.1, r
    assert sorted(r["forms"]) == sorted(FORMS), r
    for name, f in r["forms"].items():
        assert f["prefill_bf16"] > 0 and f["prefill_f32"] > 0, (name, f)
        assert f["decode_tok_s"] > 0 and 0 < f["step_ms"] < 1000, (name, f)
        # batch 1: tok/s is 1 / the median step; the bench prints the step to 0.01 ms, tok/s to 0.1
        ms = 1e3 / f["decode_tok_s"]
        assert abs(ms - f["step_ms"]) <= 0.0051 + ms * 0.051 / f["decode_tok_s"], (name, f)
        assert f["step_bytes"] > 0 and f["roofline"] > 0 and f["peer"] == {}, (name, f)
        assert 0 < f["load_s"] < 60, (name, f)
        weights = f["file_gib"] * 2**30
        assert weights < f["rss_gib"] * 2**30 < 8 * 2**30, (name, f)  # baton's own peak, not the script's
        assert f["step_bytes"] < weights, (name, f)  # the matrices, less the norms and the file's metadata
        measure(f"bench/model_1b.py --small {name}: prefill {r['prefill_tokens']} bf16 {f['prefill_bf16']:.0f} tok/s, "
                f"decode {f['decode_tok_s']:.0f} tok/s, peak RSS {f['rss_gib'] * 1024:.0f} MiB")
    # The same matrices: bf16 as the directory holds them (2 bytes a value), Q4_0 18 bytes per 32 values.
    q4, bf16 = r["forms"]["gguf-q4_0"]["step_bytes"], r["forms"]["gguf-bf16"]["step_bytes"]
    assert r["forms"]["hf-bf16"]["step_bytes"] == bf16 and q4 == bf16 // 2 // 32 * 18, r
    assert "| form |" in p.stdout and p.stdout.count("| gguf-") == 2, p.stdout


def test_model_1b_small_writes_q4_0_of_the_bf16_values(baton_bin, benches, tmp_path):
    """Every matrix of the Q4_0 GGUF is Q4_0 of the bf16 GGUF's values, row for row (the small shape's
    rows are whole blocks of 32); the norms stay f32."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    p = subprocess.run([sys.executable, str(SCRIPT), "--small", "--dir", str(tmp_path), "--make-only"],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-4000:]
    q4 = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "model-q4_0.gguf")).tensors}
    bf16 = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "model-bf16.gguf")).tensors}
    assert sorted(q4) == sorted(bf16) and len(q4) == 2 + 2 * 9, sorted(q4)
    for name, t in q4.items():
        assert list(t.shape) == list(bf16[name].shape), name
        if "norm" in name:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
            continue
        assert t.tensor_type == gguf.GGMLQuantizationType.Q4_0, name
        got = dequantize(t.data, t.tensor_type)
        want = (bf16[name].data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(got.shape)
        # Q4_0: per block of 32, d = max / -8 and values in [-8, 7]: each within one step d of the value
        blocks = want.reshape(-1, 32)
        step = np.abs(blocks).max(axis=1, keepdims=True) / 8
        assert np.all(np.abs(got.reshape(-1, 32) - blocks) <= step * 1.001 + 1e-7), name


def fake_bench(path: Path, table: str) -> None:
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{table}EOF\n")
    path.chmod(0o755)


PREFILL = """| dtype | threads | prompt tokens | prefill ms | prefill tok/s | achieved GFLOP/s | GEMM alone GFLOP/s | ratio |
|---|---|---|---|---|---|---|---|
| bf16 | 2 | 64 | 0.5 | 12345 | 10 | 20 | 50 % |
"""
DECODE = """| batch | context | KV | weights | sampling | new | ms per step | output tok/s | mean ms per step | masks |
|---|---|---|---|---|---|---|---|---|---|
| 1 | 64–80 | f32 | native | greedy | 7 | 0.25 | 4000.0 | 0.30 | – |
"""


def test_model_1b_reads_the_bench_tables_by_column_name(baton_bin, benches, tmp_path):
    """Benches whose tables gained columns before the ones read: the same figures. One whose table
    lost a column: the script stops, naming it."""
    build = tmp_path / "build"
    (build / "bench").mkdir(parents=True)
    fake_bench(build / "bench" / "baton_bench_prefill", PREFILL)
    fake_bench(build / "bench" / "baton_bench_decode", DECODE)
    p = model_1b(baton_bin, tmp_path, build)
    assert p.returncode == 0, p.stderr[-4000:]
    for name, f in json.loads((tmp_path / "results.json").read_text())["forms"].items():
        got = f["prefill_bf16"], f["prefill_f32"], f["step_ms"], f["decode_tok_s"]
        assert got == (12345, 12345, 0.25, 4000), (name, f)

    fake_bench(build / "bench" / "baton_bench_decode", DECODE.replace("| output tok/s |", "| tok/s |"))
    p = model_1b(baton_bin, tmp_path, build)
    assert p.returncode != 0, p.stdout
    assert "baton_bench_decode's table has no column 'output tok/s'" in p.stderr, p.stderr[-4000:]
    assert "Traceback" not in p.stderr, p.stderr[-4000:]


def test_model_8b_small_writes_random_q4_0_and_decodes(benches, tmp_path):
    """bench/model_8b.py --small: its random Q4_0 blocks read back through `gguf`'s dequantiser with
    the spread it promises (std fan_in^-1/2 per matrix), an untied output, and a decode round whose
    table the script reads."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    out = tmp_path / "m8b.gguf"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "model_8b.py"), "--small", "--out", str(out), "--keep",
                        "--rounds", "1", "--threads", "2", "--build", str(BUILD)],
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-4000:]
    (row,) = [line for line in p.stdout.splitlines() if line.startswith("| 1 |")]
    assert float(row.split("|")[2]) > 0, p.stdout
    tensors = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    assert "output.weight" in tensors and len(tensors) == 3 + 2 * 9, sorted(tensors)
    for name, t in tensors.items():
        if "norm" in name:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
            continue
        assert t.tensor_type == gguf.GGMLQuantizationType.Q4_0, name
        values = dequantize(t.data, t.tensor_type)
        fan_in = values.shape[-1]
        assert abs(values.std() * fan_in ** 0.5 - 1) < 0.05, (name, values.std(), fan_in)
