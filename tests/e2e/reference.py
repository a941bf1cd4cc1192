#!/usr/bin/env python3
"""Independent numpy reference forward pass for llama-family GGUF models.

This file shares no code with the C++ engine: it reads the GGUF with the `gguf` Python package
(GGUFReader + gguf.quants.dequantize) and runs the decoder in numpy.

Numerics: every weight is dequantised by the `gguf` package to float32 (the exact values the
quantised blocks encode) and then held as float64; all activations, matmuls, RoPE, softmax and
norms are computed in float64 end to end. Only the returned logits are cast to float32.

Supported: architectures `llama` (also Mistral / SmolLM2 / Llama 2-3 GGUFs, which use arch
`llama`), `qwen2` (q/k/v biases) and `qwen3` (an RMSNorm of each q and k head before RoPE,
blk.N.attn_q_norm / attn_k_norm, as llama.cpp's qwen3 graph and transformers' Qwen3Attention
apply it; head_dim from key_length, so n_head · head_dim may differ from the embedding width). Hyper-parameters come from the GGUF metadata:
  {arch}.block_count, .embedding_length, .attention.head_count, .attention.head_count_kv,
  .rope.freq_base (default 10000), .attention.layer_norm_rms_epsilon,
  .rope.dimension_count (optional, default head_dim), .attention.key_length (optional).
Tensors: token_embd, output_norm, optional output (else tied to token_embd), optional
rope_freqs (Llama 3.1 frequency factors), blk.N.{attn_norm, attn_q, attn_k, attn_v,
attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down} and optional blk.N.attn_{q,k,v,output}.bias.

RoPE modes: llama.cpp's converter permutes the Q/K rows of `llama` models so that the GGUF uses
the "normal" mode, rotating ADJACENT pairs (x[2i], x[2i+1]); `qwen2` GGUFs use the NEOX mode,
rotating (x[i], x[i + n_rot/2]). Both use frequency theta_i = base^(-2i / n_rot).

CLI:
  python3 reference.py --model PATH --prompt-ids 1,2,3 [--logits-out F.npy] [--greedy N]
  (--logits-out writes the logits of every prompt position, float32 [T, vocab];
   --greedy N prints N greedily generated ids (EOS ignored) comma-separated on stdout.)
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

# Architectures whose GGUF stores Q/K for NEOX-style rotation (llama.cpp LLAMA_ROPE_TYPE_NEOX).
_NEOX_ARCHS = {"qwen2", "qwen3"}
_NORMAL_ARCHS = {"llama"}


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


class Reference:
    """A loaded llama-family model. Weights are dequantised once, at construction."""

    def __init__(self, path: str):
        import gguf  # imported here so `--help` works without the package

        self.path = path
        r = gguf.GGUFReader(path, "r")
        arch = _field(r, "general.architecture")
        if arch not in _NEOX_ARCHS | _NORMAL_ARCHS:
            raise ValueError(f"reference: unsupported architecture {arch!r}")
        self.arch = arch
        self.neox = arch in _NEOX_ARCHS

        def hp(name, default=None):
            v = _field(r, f"{arch}.{name}", default)
            if v is None:
                raise ValueError(f"reference: missing metadata {arch}.{name}")
            return v

        self.n_layer = int(hp("block_count"))
        self.dim = int(hp("embedding_length"))
        self.n_head = int(hp("attention.head_count"))
        self.n_kv_head = int(hp("attention.head_count_kv", self.n_head))
        self.head_dim = int(hp("attention.key_length", self.dim // self.n_head))
        self.rope_base = float(hp("rope.freq_base", 10000.0))
        self.eps = float(hp("attention.layer_norm_rms_epsilon"))
        self.n_rot = int(hp("rope.dimension_count", self.head_dim))
        if self.n_head % self.n_kv_head:
            raise ValueError("reference: head_count is not a multiple of head_count_kv")
        if self.n_rot % 2 or self.n_rot > self.head_dim:
            raise ValueError("reference: bad rope.dimension_count")

        w = {}
        for t in r.tensors:
            a = gguf.quants.dequantize(t.data, t.tensor_type)
            # GGUF lists dims fastest-first: gguf shape [in, out] -> numpy (out, in).
            shape = tuple(int(s) for s in reversed(t.shape))
            w[t.name] = np.asarray(a, dtype=np.float32).reshape(shape).astype(np.float64)
        self.w = w

        self.tok_embd = w["token_embd.weight"]  # (vocab, dim)
        self.vocab = self.tok_embd.shape[0]
        self.output = w.get("output.weight", self.tok_embd)  # tied when absent
        self.output_norm = w["output_norm.weight"]

        # Rotary inverse frequencies, float64.
        i = np.arange(self.n_rot // 2, dtype=np.float64)
        inv_freq = self.rope_base ** (-2.0 * i / self.n_rot)
        if "rope_freqs.weight" in w:  # Llama 3.1 style frequency factors
            inv_freq = inv_freq / w["rope_freqs.weight"].reshape(-1)[: self.n_rot // 2]
        self.inv_freq = inv_freq

        self.layers = []
        for n in range(self.n_layer):
            p = f"blk.{n}."
            L = {k: w[p + k + ".weight"] for k in (
                "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
            for k in ("attn_q", "attn_k", "attn_v", "attn_output"):
                L[k + "_b"] = w.get(p + k + ".bias")
            for k in ("attn_q_norm", "attn_k_norm"):
                L[k] = w.get(p + k + ".weight")
            assert (L["attn_q_norm"] is not None) == (arch == "qwen3"), "q/k norms are qwen3's"
            assert L["attn_q"].shape == (self.n_head * self.head_dim, self.dim), L["attn_q"].shape
            assert L["attn_k"].shape == (self.n_kv_head * self.head_dim, self.dim)
            assert L["attn_v"].shape == (self.n_kv_head * self.head_dim, self.dim)
            self.layers.append(L)

    # ---- building blocks -------------------------------------------------------------------

    def _rms_norm(self, x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * weight

    @staticmethod
    def _linear(x, weight, bias=None):
        y = x @ weight.T
        if bias is not None:
            y = y + bias
        return y

    def _rope(self, x, pos):
        """x: (T, H, head_dim); pos: (T,) absolute positions. Returns a rotated copy."""
        ang = pos.astype(np.float64)[:, None] * self.inv_freq[None, :]  # (T, n_rot/2)
        cos = np.cos(ang)[:, None, :]
        sin = np.sin(ang)[:, None, :]
        out = x.copy()
        if self.neox:
            h = self.n_rot // 2
            a, b = x[..., :h], x[..., h:self.n_rot]
            out[..., :h] = a * cos - b * sin
            out[..., h:self.n_rot] = a * sin + b * cos
        else:
            a, b = x[..., 0:self.n_rot:2], x[..., 1:self.n_rot:2]
            out[..., 0:self.n_rot:2] = a * cos - b * sin
            out[..., 1:self.n_rot:2] = a * sin + b * cos
        return out

    def new_cache(self):
        return [{"k": np.zeros((0, self.n_kv_head, self.head_dim)),
                 "v": np.zeros((0, self.n_kv_head, self.head_dim))} for _ in range(self.n_layer)]

    def _step(self, ids, cache, all_logits: bool):
        """Runs tokens `ids` after the cache's contents. Returns logits (T or 1, vocab) float64."""
        ids = np.asarray(ids, dtype=np.int64)
        T = ids.shape[0]
        start = cache[0]["k"].shape[0]
        pos = np.arange(start, start + T)
        S = start + T
        D, H, KV = self.head_dim, self.n_head, self.n_kv_head
        G = H // KV
        # mask[i, j]: query i (position start+i) may see key j iff j <= start+i.
        mask = np.arange(S)[None, :] <= pos[:, None]
        scale = 1.0 / np.sqrt(D)

        x = self.tok_embd[ids]  # (T, dim)
        for L, c in zip(self.layers, cache):
            h = self._rms_norm(x, L["attn_norm"])
            q = self._linear(h, L["attn_q"], L["attn_q_b"]).reshape(T, H, D)
            k = self._linear(h, L["attn_k"], L["attn_k_b"]).reshape(T, KV, D)
            v = self._linear(h, L["attn_v"], L["attn_v_b"]).reshape(T, KV, D)
            if L["attn_q_norm"] is not None:  # per head, over head_dim
                q = self._rms_norm(q, L["attn_q_norm"])
                k = self._rms_norm(k, L["attn_k_norm"])
            q = self._rope(q, pos)
            k = self._rope(k, pos)
            c["k"] = np.concatenate([c["k"], k], axis=0)
            c["v"] = np.concatenate([c["v"], v], axis=0)
            K, V = c["k"], c["v"]  # (S, KV, D)
            # q head h uses kv head h // G.
            qg = q.reshape(T, KV, G, D).transpose(1, 2, 0, 3)  # (KV, G, T, D)
            Kt = K.transpose(1, 0, 2)  # (KV, S, D)
            s = np.einsum("kgtd,ksd->kgts", qg, Kt) * scale
            s = np.where(mask[None, None], s, -np.inf)
            s = s - s.max(axis=-1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(axis=-1, keepdims=True)
            o = np.einsum("kgts,ksd->kgtd", p, V.transpose(1, 0, 2))  # (KV, G, T, D)
            o = o.transpose(2, 0, 1, 3).reshape(T, H * D)
            x = x + self._linear(o, L["attn_output"], L["attn_output_b"])

            h = self._rms_norm(x, L["ffn_norm"])
            g = self._linear(h, L["ffn_gate"])
            u = self._linear(h, L["ffn_up"])
            x = x + self._linear(g / (1.0 + np.exp(-g)) * u, L["ffn_down"])

        if not all_logits:
            x = x[-1:]
        return self._linear(self._rms_norm(x, self.output_norm), self.output)

    # ---- public API --------------------------------------------------------------------------

    def forward(self, token_ids) -> np.ndarray:
        """Logits of every position, float32 [T, vocab]."""
        if len(token_ids) == 0:
            raise ValueError("reference: empty prompt")
        return self._step(token_ids, self.new_cache(), True).astype(np.float32)

    def run(self, token_ids, n: int, all_logits: bool = True):
        """One pass: prompt logits (float32 [T, vocab], or None) and n greedy ids (EOS ignored).

        Also returns the top-1 minus top-2 logit margin of each greedy step (float64 logits),
        useful to judge whether a mismatch against another implementation is a near-tie.
        """
        if len(token_ids) == 0:
            raise ValueError("reference: empty prompt")
        cache = self.new_cache()
        logits = self._step(token_ids, cache, all_logits)
        prompt_logits = logits.astype(np.float32) if all_logits else None
        last = logits[-1]
        out, margins = [], []
        for i in range(n):
            nxt = int(np.argmax(last))
            top2 = np.partition(last, -2)[-2:]
            margins.append(float(top2[1] - top2[0]))
            out.append(nxt)
            if i + 1 < n:
                last = self._step([nxt], cache, False)[-1]
        return prompt_logits, out, margins

    def greedy(self, token_ids, n: int) -> list[int]:
        """n greedily generated token ids (argmax, ties to the lowest id, EOS ignored)."""
        return self.run(token_ids, n, all_logits=False)[1]


_CACHE: dict[str, Reference] = {}


def load(path: str) -> Reference:
    """Loads (once per process) the reference model for `path`."""
    if path not in _CACHE:
        _CACHE[path] = Reference(path)
    return _CACHE[path]


def build_hf_tokenizer(path: str):
    """HF `tokenizers.Tokenizer` built from the GGUF's vocabulary, without torch."""
    import gguf
    from tokenizers import pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    r = gguf.GGUFReader(path, "r")
    f = lambda k: _field(r, k)  # noqa: E731
    d = {"tokenizer_type": f("tokenizer.ggml.model"), "pre_tokenizer_type": f("tokenizer.ggml.pre"),
         "tokens": f("tokenizer.ggml.tokens"), "merges": f("tokenizer.ggml.merges"),
         "token_type": f("tokenizer.ggml.token_type"),
         "bos_token_id": f("tokenizer.ggml.bos_token_id") if f("tokenizer.ggml.bos_token_id") is not None else 1,
         "eos_token_id": f("tokenizer.ggml.eos_token_id") if f("tokenizer.ggml.eos_token_id") is not None else 2}
    tok, _ = convert_gguf_tokenizer("llama", d)
    # SmolLM2's real tokenizer.json isolates digits first; transformers leaves 'smollm' at plain
    # ByteLevel.
    if d["pre_tokenizer_type"] == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return tok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    src.add_argument("--prompt", help="text, tokenized with the HF tokenizer built from the GGUF")
    ap.add_argument("--logits-out", help="write float32 [T, vocab] logits of every prompt position")
    ap.add_argument("--greedy", type=int, default=0, help="print N greedy ids (EOS ignored)")
    ap.add_argument("--text", action="store_true", help="also print the decoded continuation on stderr")
    a = ap.parse_args(argv)

    tok = None
    if a.prompt is not None:
        tok = build_hf_tokenizer(a.model)
        ids = tok.encode(a.prompt, add_special_tokens=False).ids
    else:
        ids = [int(s) for s in a.prompt_ids.split(",") if s.strip()]
    if not ids:
        print("reference: empty prompt", file=sys.stderr)
        return 2

    t0 = time.time()
    ref = load(a.model)
    t1 = time.time()
    logits, gen, _ = ref.run(ids, a.greedy, all_logits=a.logits_out is not None)
    t2 = time.time()
    if a.logits_out:
        np.save(a.logits_out, logits)
    if a.greedy:
        print(",".join(str(i) for i in gen))
        if a.text:
            tok = tok or build_hf_tokenizer(a.model)
            print(repr(tok.decode(gen, skip_special_tokens=False)), file=sys.stderr)
    print(f"reference: {len(ids)} prompt tokens, load {t1 - t0:.1f}s, run {t2 - t1:.1f}s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
