"""An independent numpy forward pass for Hugging Face model directories (LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM), written from transformers' modelling
code, not from baton's: it reads config.json and the safetensors files itself (its own parser,
F32/F16/BF16), and follows modeling_llama / modeling_qwen2 / modeling_qwen3 step by step:

  embed -> per layer: RMSNorm, q/k/v projections (+ biases for Qwen2; Qwen3: q_norm and k_norm,
  an RMSNorm over each head's head_dim, before RoPE), RoPE by rotate_half on the
  unpermuted weights with cos/sin of cat(freqs, freqs), repeat_kv for GQA, causal softmax
  attention scaled by 1/sqrt(head_dim), o_proj, residual; RMSNorm, down(silu(gate) * up),
  residual -> final RMSNorm -> lm_head (or the embeddings when tied).

RoPE scaling as transformers' _compute_default / _compute_linear / _compute_llama3_parameters.
All in float64 from the stored values; the logits are returned as float64.

Why numpy and not transformers with torch: torch is a large download for CI, and the point is a
second implementation that shares nothing with baton's; this one is written from the modelling
code and checked on its own against SmolLM2 (the GGUF reference's logits, tests/e2e).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        lo, hi = e["data_offsets"]
        raw = data[8 + n + lo:8 + n + hi]
        if e["dtype"] == "F32":
            a = np.frombuffer(raw, dtype="<f4")
        elif e["dtype"] == "F16":
            a = np.frombuffer(raw, dtype="<f2").astype(np.float32)
        elif e["dtype"] == "BF16":
            a = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(f"{path}: {name} is {e['dtype']}")
        out[name] = a.reshape(e["shape"]).astype(np.float64)
    return out


def load_weights(model_dir: Path) -> dict[str, np.ndarray]:
    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]
    weights = {}
    for f in files:
        weights.update(read_safetensors(model_dir / f))
    return weights


def inv_freq(config: dict, head_dim: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies, position scale), as transformers computes them."""
    base = config.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return freqs, 1.0
    if kind == "linear":
        return freqs / scaling["factor"], 1.0
    assert kind == "llama3", kind
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / freqs
    llama = np.where(wavelen > low_wavelen, freqs / factor, freqs)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * llama / factor + smooth * llama
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, llama), 1.0


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class HfReference:
    def __init__(self, model_dir: Path):
        self.dir = Path(model_dir)
        self.config = json.loads((self.dir / "config.json").read_text())
        self.w = load_weights(self.dir)
        c = self.config
        self.n_heads, self.n_kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.n_heads
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.vocab = c["vocab_size"]
        self.freqs, _ = inv_freq(c, self.head_dim)

    def logits(self, ids: list[int]) -> np.ndarray:
        """Every position's logits, [T, vocab] float64."""
        c, w = self.config, self.w
        T, H, KV, D = len(ids), self.n_heads, self.n_kv, self.head_dim
        x = w["model.embed_tokens.weight"][ids]
        angles = np.outer(np.arange(T, dtype=np.float64), self.freqs)  # [T, D/2]
        emb = np.concatenate([angles, angles], axis=-1)
        cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]  # broadcast over heads
        mask = np.triu(np.full((T, T), -np.inf), k=1)
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], self.eps)

            def proj(name):
                y = h @ w[p + f"self_attn.{name}.weight"].T
                bias = w.get(p + f"self_attn.{name}.bias")
                return y if bias is None else y + bias

            q = proj("q_proj").reshape(T, H, D)
            k = proj("k_proj").reshape(T, KV, D)
            v = proj("v_proj").reshape(T, KV, D)
            if p + "self_attn.q_norm.weight" in w:  # Qwen3Attention: q_norm / k_norm over head_dim
                q = rms_norm(q, w[p + "self_attn.q_norm.weight"], self.eps)
                k = rms_norm(k, w[p + "self_attn.k_norm.weight"], self.eps)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k = np.repeat(k, H // KV, axis=1)  # repeat_kv
            v = np.repeat(v, H // KV, axis=1)
            scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(D) + mask
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs = scores / scores.sum(axis=-1, keepdims=True)
            att = np.einsum("hts,shd->thd", probs, v).reshape(T, H * D)
            x = x + att @ w[p + "self_attn.o_proj.weight"].T
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], self.eps)
            gate = h @ w[p + "mlp.gate_proj.weight"].T
            up = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
        x = rms_norm(x, w["model.norm.weight"], self.eps)
        head = w.get("lm_head.weight") if not c.get("tie_word_embeddings", False) else None
        return x @ (w["model.embed_tokens.weight"] if head is None else head).T

    def greedy(self, ids: list[int], n: int) -> tuple[list[int], list[float]]:
        """n greedy ids (no EOS stop) and the top-2 margin of each step."""
        seq, out, margins = list(ids), [], []
        for _ in range(n):
            last = self.logits(seq)[-1]
            top = np.sort(last)[-2:]
            margins.append(float(top[1] - top[0]))
            out.append(int(np.argmax(last)))
            seq.append(out[-1])
        return out, margins
