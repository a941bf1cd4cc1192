#!/usr/bin/env python3
"""bench/model_1b: baton at 1B scale, beside llama.cpp, on one random-weight model in three forms.

The model has Llama 3.2 1B's shape (hidden 2048, 16 layers, 32 heads / 8 KV heads, head dim 64,
FFN 8192, vocab 128256, tied embeddings) and random weights, written as
  - a Hugging Face directory (config.json, model.safetensors in bf16, a byte-level tokenizer.json);
  - a GGUF with the same bf16 values (q/k rows permuted as llama.cpp's converter does);
  - a GGUF in Q4_0 (quantised from the same values; norms f32).
On the same threads, in one run, it measures
  - the machine's streaming read bandwidth (numpy reductions over 1 GiB per thread, all threads at once);
  - load time and peak RSS of `baton generate` (one token), against the weights' bytes;
  - prefill of 512 tokens (baton_bench_prefill, bf16 and f32) and single-stream decode
    (baton_bench_decode, batch 1, context 512, 64 steps: the median step);
  - decode against the memory roofline: the bytes of weights a step reads / step time, as a
    fraction of the measured bandwidth;
  - llama.cpp's llama-bench pp512 / tg128 on the GGUFs (../shared/tools/peer-bench, which builds
    llama.cpp outside the repository), when --peer-bench names it.
Prints a Markdown report (bench/RESULTS.md keeps the measured ones) and writes --json. The benches'
tables are read by the names in their headers: a column missing stops the run, saying which.

--small runs the same code on a tiny model of the same architecture (hidden 256, 2 layers, 4 heads
/ 2 KV heads, head dim 64, FFN 512, vocab 2048; prefill 64 tokens, decode context 64 and 16 steps,
the bandwidth over 256 MiB per thread) in seconds, without llama.cpp: tests/e2e/test_bench_model_1b.py
runs it so that the script keeps working. Its figures say nothing of 1B (the weights fit in cache).

  bench/model_1b.py [--small] [--dir /tmp/baton-1b] [--threads N] [--build DIR] [--baton PATH]
                    [--peer-bench PATH] [--json out.json] [--make-only]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
from hf_models import byte_level_tokenizer, to_bf16_bits, write_safetensors  # noqa: E402

# The model's shape and the runs' sizes: the prefill's prompt tokens, the decode's context and steps,
# and the GiB per thread the bandwidth reads. Every matrix row of both shapes is a whole number of
# Q4_0's 32-value blocks (hidden and FFN widths are multiples of 32).
SIZES = {
    "1b": dict(shape=dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn=8192, vocab=128256, ctx=4096),
               prefill=512, context=512, steps=64, stream_gib=1.0),
    "small": dict(shape=dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn=512, vocab=2048, ctx=512),
                  prefill=64, context=64, steps=16, stream_gib=0.25),
}


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def make_weights(s: dict, seed: int) -> dict[str, np.ndarray]:
    """HF-named tensors of shape `s` as bf16 bits (uint16), N(0, 1/fan_in) so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    head_dim = s["dim"] // s["n_heads"]

    def mat(rows, cols):
        return to_bf16_bits(rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(cols ** -0.5))

    def norm(n):
        return to_bf16_bits((1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32))

    w = {"model.embed_tokens.weight": mat(s["vocab"], s["dim"]), "model.norm.weight": norm(s["dim"])}
    for i in range(s["n_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(s["dim"])
        w[p + "post_attention_layernorm.weight"] = norm(s["dim"])
        w[p + "self_attn.q_proj.weight"] = mat(s["n_heads"] * head_dim, s["dim"])
        w[p + "self_attn.k_proj.weight"] = mat(s["n_kv_heads"] * head_dim, s["dim"])
        w[p + "self_attn.v_proj.weight"] = mat(s["n_kv_heads"] * head_dim, s["dim"])
        w[p + "self_attn.o_proj.weight"] = mat(s["dim"], s["n_heads"] * head_dim)
        w[p + "mlp.gate_proj.weight"] = mat(s["ffn"], s["dim"])
        w[p + "mlp.up_proj.weight"] = mat(s["ffn"], s["dim"])
        w[p + "mlp.down_proj.weight"] = mat(s["dim"], s["ffn"])
    return w


def hf_config(s: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s["dim"],
        "intermediate_size": s["ffn"], "num_hidden_layers": s["n_layers"], "num_attention_heads": s["n_heads"],
        "num_key_value_heads": s["n_kv_heads"], "head_dim": s["dim"] // s["n_heads"], "vocab_size": s["vocab"],
        "max_position_embeddings": s["ctx"], "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "bfloat16"}


def write_hf(out: Path, s: dict, w: dict[str, np.ndarray]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    byte_level_tokenizer(out)
    (out / "config.json").write_text(json.dumps(hf_config(s)))
    write_safetensors(out / "model.safetensors", {k: (bf16_to_f32(v), "BF16") for k, v in w.items()})


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF q/k rows -> GGUF's order (llama.cpp's converter)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_gguf_writer(path: Path, s: dict, file_type):
    """A GGUFWriter at `path` with a Llama of shape `s`'s metadata and a byte-level vocabulary (the 256 byte
    symbols, EOS, placeholders up to the embeddings); the caller adds the tensors."""
    import gguf
    g = gguf.GGUFWriter(str(path), "llama")
    g.add_context_length(s["ctx"])
    g.add_embedding_length(s["dim"])
    g.add_block_count(s["n_layers"])
    g.add_feed_forward_length(s["ffn"])
    g.add_head_count(s["n_heads"])
    g.add_head_count_kv(s["n_kv_heads"])
    g.add_rope_dimension_count(s["dim"] // s["n_heads"])
    g.add_rope_freq_base(500000.0)
    g.add_layer_norm_rms_eps(1e-5)
    g.add_vocab_size(s["vocab"])
    g.add_file_type(file_type)
    alphabet = [chr(c) for c in sorted(set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100)))]
    extra = [chr(0x100 + n) for n in range(256 - len(alphabet))]
    tokens = alphabet + extra + ["<|endoftext|>", "\u0120t"]  # one merge: GGUF readers require the list
    tokens += [f"<unused_{i}>" for i in range(s["vocab"] - len(tokens))]
    types = [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL, gguf.TokenType.NORMAL]
    types += [gguf.TokenType.UNUSED] * (s["vocab"] - len(types))
    g.add_tokenizer_model("gpt2")
    g.add_tokenizer_pre("gpt-2")
    g.add_token_list(tokens)
    g.add_token_types(types)
    g.add_token_merges(["\u0120 t"])
    g.add_eos_token_id(256)
    g.add_bos_token_id(256)
    g.add_add_bos_token(False)
    return g


def write_gguf(path: Path, s: dict, w: dict[str, np.ndarray], qtype: str) -> None:
    import gguf
    g = llama_gguf_writer(path, s, gguf.LlamaFileType.MOSTLY_BF16 if qtype == "BF16" else gguf.LlamaFileType.MOSTLY_Q4_0)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}

    def add(name: str, bits: np.ndarray, is_norm: bool) -> None:
        if is_norm:
            g.add_tensor(name, bf16_to_f32(bits))
        elif qtype == "BF16":
            g.add_tensor(name, bits, raw_shape=bits.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            q = gguf.quants.quantize(bf16_to_f32(bits), gguf.GGMLQuantizationType.Q4_0)
            g.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q4_0)

    add("token_embd.weight", w["model.embed_tokens.weight"], False)
    add("output_norm.weight", w["model.norm.weight"], True)
    for i in range(s["n_layers"]):
        for hf, gg in names.items():
            bits = w[f"model.layers.{i}.{hf}.weight"]
            if hf == "self_attn.q_proj":
                bits = permute(bits, s["n_heads"])
            elif hf == "self_attn.k_proj":
                bits = permute(bits, s["n_kv_heads"])
            add(f"blk.{i}.{gg}.weight", bits, hf.endswith("layernorm"))
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()


def stream_bandwidth(threads: int, gib: float) -> float:
    """GB/s of `threads` numpy reductions over `gib` GiB each, run at once: the best of three passes of
    each of sum, max and an integer xor (numpy's reductions differ by up to a third here)."""
    n = int(gib * (1 << 28))  # float32s
    arrays = [np.ones(n, dtype=np.float32) for _ in range(threads)]
    best = 0.0
    for reduce in (np.sum, np.max, lambda a: np.bitwise_xor.reduce(a.view(np.uint64))):
        for _ in range(3):
            barrier = threading.Barrier(threads + 1)

            def work(a):
                barrier.wait()
                reduce(a)

            ts = [threading.Thread(target=work, args=(a,)) for a in arrays]
            for t in ts:
                t.start()
            barrier.wait()
            t0 = time.perf_counter()
            for t in ts:
                t.join()
            best = max(best, threads * n * 4 / (time.perf_counter() - t0) / 1e9)
    return best


def run(cmd: list[str], timeout: int = 1800) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr[-2000:]}")
    return p.stdout


# Runs argv[1:] and adds its wall seconds and peak RSS to stderr's end, as /usr/bin/time -f would
# (which a bare Debian lacks). A small process of its own spawns the command: at exec Linux carries
# the spawning process's peak RSS into the child's, and this script's is gigabytes.
TIME_CMD = ("import os, sys, time; t0 = time.perf_counter(); "
            "pid = os.posix_spawnp(sys.argv[1], sys.argv[1:], os.environ); _, status, usage = os.wait4(pid, 0); "
            "print(f'wall_s={time.perf_counter() - t0} maxrss_kb={usage.ru_maxrss}', file=sys.stderr); "
            "sys.exit(os.waitstatus_to_exitcode(status))")


def load_and_rss(baton: Path, model: Path, threads: int) -> tuple[float, float]:
    """Wall seconds and peak RSS (GiB) of `baton generate` of one token."""
    p = subprocess.run([sys.executable, "-c", TIME_CMD, str(baton), "generate", "--model", str(model),
                        "--prompt-ids", "1,2,3", "--max-tokens", "1", "--threads", str(threads), "--block-size", "16"],
                       capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    m = re.search(r"wall_s=([\d.e+-]+) maxrss_kb=(\d+)", p.stderr)
    return float(m.group(1)), int(m.group(2)) * 1024 / 2**30


def bench_table(cmd: list[str], columns: tuple[str, ...]) -> list[dict[str, float]]:
    """Runs a bench that prints a Markdown table; its rows as {column: value} for `columns`, each found
    by its name in the table's header. Exits, naming the bench and the columns it has, where one is
    missing, a row's cells do not match the header or a value is no number: a table that changes
    stops the run instead of giving another column's figures."""
    text = run(cmd)
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("|")]

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip("|").split("|")]

    bench = Path(cmd[0]).name
    heads = [i for i in range(len(lines) - 1) if set(lines[i + 1]) <= set("|-: ")]
    if not heads:
        sys.exit(f"model_1b: {bench} printed no Markdown table (a header, then |---|):\n{text}")
    header = cells(lines[heads[0]])
    missing = [c for c in columns if c not in header]
    if missing:
        sys.exit(f"model_1b: {bench}'s table has no column {', '.join(map(repr, missing))} "
                 f"(its columns: {', '.join(map(repr, header))})")
    rows = []
    for line in lines[heads[0] + 2:]:
        row = cells(line)
        if len(row) != len(header):
            sys.exit(f"model_1b: {bench}'s row has {len(row)} cells, its header {len(header)}:\n{text}")
        try:
            rows.append({c: float(row[header.index(c)]) for c in columns})
        except ValueError:
            sys.exit(f"model_1b: {bench}: a value in {', '.join(map(repr, columns))} is no number:\n{text}")
    if not rows:
        sys.exit(f"model_1b: {bench}'s table has no rows:\n{text}")
    return rows


def row_where(rows: list[dict[str, float]], column: str, value: float, bench: str) -> dict[str, float]:
    """The row of a bench_table whose `column` is `value`; exits where there is none."""
    for row in rows:
        if row[column] == value:
            return row
    sys.exit(f"model_1b: {bench}'s table has no row of {column} {value}: {rows}")


def weight_bytes_per_step(path: Path, s: dict) -> int:
    """Bytes of every matrix a decode step reads (all but the norms; the tied embedding as the LM head)."""
    if path.is_dir():
        return sum(v * 2 for v in param_counts(s).values())
    import gguf
    r = gguf.GGUFReader(str(path))
    return sum(int(t.n_bytes) for t in r.tensors if "norm" not in t.name)


def param_counts(s: dict) -> dict[str, int]:
    hd = s["dim"] // s["n_heads"]
    per_layer = s["dim"] * (s["n_heads"] * hd * 2 + s["n_kv_heads"] * hd * 2) + 3 * s["dim"] * s["ffn"]
    return {"layers": s["n_layers"] * per_layer, "embedding": s["vocab"] * s["dim"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="a tiny model of the same architecture, short runs")
    ap.add_argument("--dir", help="where the three forms are written (/tmp/baton-1b, with --small /tmp/baton-1b-small)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--build", default=str(REPO / "build"))
    ap.add_argument("--baton", help="the baton binary (default: BUILD/baton)")
    ap.add_argument("--peer-bench", help="../shared/tools/peer-bench, to run llama.cpp on the GGUFs")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--make-only", action="store_true", help="write the three forms and stop")
    a = ap.parse_args()
    if a.small and a.peer_bench:
        ap.error("--peer-bench runs llama-bench's pp512 / tg128, sized for the 1B model: not with --small")
    size = "small" if a.small else "1b"
    z = SIZES[size]
    s = z["shape"]
    out = Path(a.dir or ("/tmp/baton-1b-small" if a.small else "/tmp/baton-1b"))
    build = Path(a.build)
    baton = Path(a.baton) if a.baton else build / "baton"
    out.mkdir(parents=True, exist_ok=True)
    forms = {"hf-bf16": out / "hf", "gguf-bf16": out / "model-bf16.gguf", "gguf-q4_0": out / "model-q4_0.gguf"}
    made = forms["hf-bf16"] / "config.json"
    if made.exists() and json.loads(made.read_text()) != hf_config(s):
        sys.exit(f"model_1b: {out} holds a model of another shape: remove it, or name another --dir")
    if not all(p.exists() for p in forms.values()):
        t0 = time.perf_counter()
        w = make_weights(s, a.seed)
        if not forms["hf-bf16"].exists():
            write_hf(forms["hf-bf16"], s, w)
        for form, qtype in (("gguf-bf16", "BF16"), ("gguf-q4_0", "Q4_0")):
            if not forms[form].exists():
                write_gguf(forms[form], s, w, qtype)
        del w
        print(f"made the three forms in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if a.make_only:
        return 0
    n = param_counts(s)
    what = "Llama 3.2 1B shape" if size == "1b" else (
        "Llama 3.2 1B's architecture, small: hidden {dim}, {n_layers} layers, {n_heads}/{n_kv_heads} heads, "
        "FFN {ffn}, vocab {vocab}".format(**s))
    print(f"model: {what}, {sum(n.values()) / 1e9:.3g} B parameters (tied embeddings), threads {a.threads}")
    bw = stream_bandwidth(a.threads, z["stream_gib"])
    print(f"streaming read bandwidth: {bw:.1f} GB/s ({a.threads} threads)")
    t, ctx, steps = z["prefill"], z["context"], z["steps"]
    results = {"size": size, "shape": s, "prefill_tokens": t, "decode_context": ctx, "decode_steps": steps,
               "threads": a.threads, "bandwidth_gb_s": bw, "forms": {}}
    print(f"\n| form | file GiB | load s | peak RSS GiB | prefill {t} bf16 tok/s | prefill {t} f32 tok/s | "
          "decode tok/s | bytes/step GB | roofline | llama.cpp pp512 | llama.cpp tg128 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, path in forms.items():
        size_gib = (sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size) / 2**30
        load_s, rss = load_and_rss(baton, path, a.threads)
        prefill = {}
        for dtype in ("bf16", "f32"):
            rows = bench_table([str(build / "bench" / "baton_bench_prefill"), str(path), "--dtype", dtype, str(t)],
                               ("prompt tokens", "prefill tok/s"))
            prefill[dtype] = row_where(rows, "prompt tokens", t, "baton_bench_prefill")["prefill tok/s"]
        # "ms per step" is the median step, "output tok/s" batch / median.
        rows = bench_table([str(build / "bench" / "baton_bench_decode"), str(path), "--batch", "1", "--context",
                            str(ctx), "--steps", str(steps), "--threads", str(a.threads)],
                           ("batch", "ms per step", "output tok/s"))
        row = row_where(rows, "batch", 1, "baton_bench_decode")
        step_ms, decode = row["ms per step"], row["output tok/s"]
        step_bytes = weight_bytes_per_step(path, s)
        roofline = step_bytes / (step_ms / 1e3) / 1e9 / bw
        peer = {}
        if a.peer_bench and path.suffix == ".gguf":
            peer = json.loads(run([a.peer_bench, str(path), str(a.threads)], timeout=3600).strip().splitlines()[-1])
        results["forms"][name] = dict(file_gib=size_gib, load_s=load_s, rss_gib=rss, prefill_bf16=prefill["bf16"],
                                      prefill_f32=prefill["f32"], decode_tok_s=decode, step_ms=step_ms,
                                      step_bytes=step_bytes, roofline=roofline, peer=peer)
        pp, tg = peer.get("pp512_tok_s"), peer.get("tg128_tok_s")
        print(f"| {name} | {size_gib:.3g} | {load_s:.2f} | {rss:.3g} | {prefill['bf16']:.0f} | {prefill['f32']:.0f} | "
              f"{decode:.2f} | {step_bytes / 1e9:.3g} | {roofline:.0%} | {pp if pp else '-'} | {tg if tg else '-'} |",
              flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
