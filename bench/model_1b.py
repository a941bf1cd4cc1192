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
Prints a Markdown report (bench/RESULTS.md keeps the measured ones) and writes --json.

  bench/model_1b.py [--dir /tmp/baton-1b] [--threads N] [--peer-bench PATH] [--json out.json] [--make-only]
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

SHAPE = dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn=8192, vocab=128256, ctx=4096)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def make_weights(seed: int) -> dict[str, np.ndarray]:
    """HF-named tensors as bf16 bits (uint16), N(0, 1/fan_in) so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    s = SHAPE
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


def write_hf(out: Path, w: dict[str, np.ndarray]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    byte_level_tokenizer(out)
    s = SHAPE
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s["dim"],
        "intermediate_size": s["ffn"], "num_hidden_layers": s["n_layers"], "num_attention_heads": s["n_heads"],
        "num_key_value_heads": s["n_kv_heads"], "head_dim": s["dim"] // s["n_heads"], "vocab_size": s["vocab"],
        "max_position_embeddings": s["ctx"], "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "bfloat16"}))
    write_safetensors(out / "model.safetensors", {k: (bf16_to_f32(v), "BF16") for k, v in w.items()})


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF q/k rows -> GGUF's order (llama.cpp's converter)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, w: dict[str, np.ndarray], qtype: str) -> None:
    import gguf
    s = SHAPE
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
    g.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if qtype == "BF16" else gguf.LlamaFileType.MOSTLY_Q4_0)
    # A byte-level vocabulary of the 256 byte symbols, EOS, and placeholders up to the embeddings.
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


def stream_bandwidth(threads: int) -> float:
    """GB/s of `threads` numpy reductions over 1 GiB each, run at once: the best of three passes of
    each of sum, max and an integer xor (numpy's reductions differ by up to a third here)."""
    arrays = [np.ones(1 << 28, dtype=np.float32) for _ in range(threads)]
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
            best = max(best, threads * (1 << 30) / (time.perf_counter() - t0) / 1e9)
    return best


def run(cmd: list[str], timeout: int = 1800) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr[-2000:]}")
    return p.stdout


def load_and_rss(baton: Path, model: Path, threads: int) -> tuple[float, float]:
    """Wall seconds and peak RSS (GiB) of `baton generate` of one token."""
    t0 = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-f", "maxrss_kb=%M", str(baton), "generate", "--model", str(model),
                        "--prompt-ids", "1,2,3", "--max-tokens", "1", "--threads", str(threads), "--block-size", "16"],
                       capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    rss = int(re.search(r"maxrss_kb=(\d+)", p.stderr).group(1)) * 1024 / 2**30
    return wall, rss


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| dtype") and not line.startswith("| batch")]


def weight_bytes_per_step(path: Path) -> int:
    """Bytes of every matrix a decode step reads (all but the norms; the tied embedding as the LM head)."""
    if path.is_dir():
        return sum(v * 2 for v in param_counts().values())
    import gguf
    r = gguf.GGUFReader(str(path))
    return sum(int(t.n_bytes) for t in r.tensors if "norm" not in t.name)


def param_counts() -> dict[str, int]:
    s = SHAPE
    hd = s["dim"] // s["n_heads"]
    per_layer = s["dim"] * (s["n_heads"] * hd * 2 + s["n_kv_heads"] * hd * 2) + 3 * s["dim"] * s["ffn"]
    return {"layers": s["n_layers"] * per_layer, "embedding": s["vocab"] * s["dim"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/baton-1b")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--build", default=str(REPO / "build"))
    ap.add_argument("--peer-bench", help="../shared/tools/peer-bench, to run llama.cpp on the GGUFs")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--make-only", action="store_true", help="write the three forms and stop")
    a = ap.parse_args()
    out, build = Path(a.dir), Path(a.build)
    out.mkdir(parents=True, exist_ok=True)
    forms = {"hf-bf16": out / "hf", "gguf-bf16": out / "model-bf16.gguf", "gguf-q4_0": out / "model-q4_0.gguf"}
    if not all(p.exists() for p in forms.values()):
        t0 = time.perf_counter()
        w = make_weights(a.seed)
        if not forms["hf-bf16"].exists():
            write_hf(forms["hf-bf16"], w)
        for form, qtype in (("gguf-bf16", "BF16"), ("gguf-q4_0", "Q4_0")):
            if not forms[form].exists():
                write_gguf(forms[form], w, qtype)
        del w
        print(f"made the three forms in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if a.make_only:
        return 0
    n = param_counts()
    print(f"model: Llama 3.2 1B shape, {sum(n.values()) / 1e9:.3f} B parameters (tied embeddings), threads {a.threads}")
    bw = stream_bandwidth(a.threads)
    print(f"streaming read bandwidth: {bw:.1f} GB/s ({a.threads} threads)")
    results = {"threads": a.threads, "bandwidth_gb_s": bw, "forms": {}}
    print("\n| form | file GiB | load s | peak RSS GiB | prefill 512 bf16 tok/s | prefill 512 f32 tok/s | "
          "decode tok/s | bytes/step GB | roofline | llama.cpp pp512 | llama.cpp tg128 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, path in forms.items():
        size = (sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size) / 2**30
        load_s, rss = load_and_rss(build / "baton", path, a.threads)
        prefill = {}
        for dtype in ("bf16", "f32"):
            rows = table_rows(run([str(build / "bench" / "baton_bench_prefill"), str(path), "--dtype", dtype, "512"]))
            prefill[dtype] = float(rows[0][3])
        rows = table_rows(run([str(build / "bench" / "baton_bench_decode"), str(path), "--batch", "1", "--context", "512",
                               "--steps", "64", "--threads", str(a.threads)]))
        step_ms, decode = float(rows[0][4]), float(rows[0][5])
        step_bytes = weight_bytes_per_step(path)
        roofline = step_bytes / (step_ms / 1e3) / 1e9 / bw
        peer = {}
        if a.peer_bench and path.suffix == ".gguf":
            peer = json.loads(run([a.peer_bench, str(path), str(a.threads)], timeout=3600).strip().splitlines()[-1])
        results["forms"][name] = dict(file_gib=size, load_s=load_s, rss_gib=rss, prefill_bf16=prefill["bf16"],
                                      prefill_f32=prefill["f32"], decode_tok_s=decode, step_ms=step_ms,
                                      step_bytes=step_bytes, roofline=roofline, peer=peer)
        pp, tg = peer.get("pp512_tok_s"), peer.get("tg128_tok_s")
        print(f"| {name} | {size:.2f} | {load_s:.1f} | {rss:.2f} | {prefill['bf16']:.0f} | {prefill['f32']:.0f} | "
              f"{decode:.2f} | {step_bytes / 1e9:.2f} | {roofline:.0%} | {pp if pp else '-'} | {tg if tg else '-'} |",
              flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
