"""Hugging Face model directories for the tests, made here: random-weight models of each
architecture baton loads (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) and
SmolLM2-135M-Instruct converted from its GGUF. Written with this module's own safetensors writer
(F32, F16 and BF16), which hf_reference.py reads with its own reader: neither shares code with
baton's loader.

Layout written: config.json, model.safetensors or shards (model-0000k-of-0000n.safetensors) with
model.safetensors.index.json, tokenizer.json, tokenizer_config.json.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np

ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3": "Qwen3ForCausalLM"}
DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None}


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def stored_values(a: np.ndarray, dtype: str) -> np.ndarray:
    """What a tensor of `dtype` holds once written: `a` rounded to it, back in float32."""
    if dtype == "BF16":
        return (to_bf16_bits(a).astype(np.uint32) << 16).view(np.float32)
    return a.astype(DTYPES[dtype]).astype(np.float32)


def tensor_bytes(a: np.ndarray, dtype: str) -> bytes:
    if dtype == "BF16":
        return to_bf16_bits(a).tobytes()
    return np.ascontiguousarray(a.astype(DTYPES[dtype])).tobytes()


def write_safetensors(path: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> None:
    """{name: (array, dtype)} -> a safetensors file (header, then the tensors in name order)."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        array, dtype = tensors[name]
        data = tensor_bytes(array, dtype)
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def write_weights(out: Path, tensors: dict[str, tuple[np.ndarray, str]], shards: int) -> None:
    if shards <= 1:
        write_safetensors(out / "model.safetensors", tensors)
        return
    names = sorted(tensors)
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for k in range(shards):
        part = names[k * per:(k + 1) * per]
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(out / file, {n: tensors[n] for n in part})
        weight_map.update({n: file for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def byte_level_tokenizer(out: Path, n_merges: int = 0) -> int:
    """A byte-level BPE tokenizer.json of the 256 bytes plus <|endoftext|> (eos); returns its size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "add_bos_token": False}))
    return tok.get_vocab_size()


def random_model(out: Path, arch: str, rng, *, dtype="F32", tied=False, shards=1, rope_scaling=None,
                 sliding_window=None, extra_config=None) -> dict:
    """A random-weight model of `arch` with a random small shape; returns its config."""
    out.mkdir(parents=True, exist_ok=True)
    n_vocab_tok = byte_level_tokenizer(out)
    n_heads = rng.choice([2, 4, 8])
    n_kv = rng.choice([k for k in (1, 2, 4, 8) if n_heads % k == 0])
    head_dim = rng.choice([8, 16, 32])
    dim = n_heads * head_dim
    if arch == "qwen3":  # its head_dim is its own: n_heads · head_dim need not be the width
        dim = rng.choice([d for d in (24, 48, 64, 96, 160) if d != dim])
    config = {
        "architectures": [ARCHS[arch]], "model_type": arch, "hidden_size": dim,
        "intermediate_size": rng.choice([64, 96, 192]), "num_hidden_layers": rng.randint(1, 3),
        "num_attention_heads": n_heads, "num_key_value_heads": n_kv, "vocab_size": n_vocab_tok + rng.randint(0, 40),
        "max_position_embeddings": 512, "rms_norm_eps": rng.choice([1e-5, 1e-6]),
        "rope_theta": rng.choice([10000.0, 500000.0]), "hidden_act": "silu", "tie_word_embeddings": tied,
        "torch_dtype": {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[dtype],
    }
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if arch == "mistral":
        config["sliding_window"] = sliding_window
    if arch == "qwen2":
        config["use_sliding_window"] = False
        config["sliding_window"] = 4096
    if arch == "qwen3":  # Qwen3-0.6B's config keys, at this size
        config.update(head_dim=head_dim, attention_bias=False, use_sliding_window=False, sliding_window=None,
                      max_window_layers=config["num_hidden_layers"], attention_dropout=0.0)
    config.update(extra_config or {})
    nrng = np.random.default_rng(rng.randrange(1 << 31))
    ffn, kv_dim, q_dim = config["intermediate_size"], n_kv * head_dim, n_heads * head_dim

    def mat(rows, cols):
        return (nrng.standard_normal((rows, cols)) / math.sqrt(cols)).astype(np.float32)

    def norm(n):
        return (1 + 0.1 * nrng.standard_normal(n)).astype(np.float32)

    t = {"model.embed_tokens.weight": mat(config["vocab_size"], dim), "model.norm.weight": norm(dim)}
    if not tied:
        t["lm_head.weight"] = mat(config["vocab_size"], dim)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(dim)
        t[p + "post_attention_layernorm.weight"] = norm(dim)
        t[p + "self_attn.q_proj.weight"] = mat(q_dim, dim)
        t[p + "self_attn.k_proj.weight"] = mat(kv_dim, dim)
        t[p + "self_attn.v_proj.weight"] = mat(kv_dim, dim)
        t[p + "self_attn.o_proj.weight"] = mat(dim, q_dim)
        if arch == "qwen3":
            t[p + "self_attn.q_norm.weight"] = norm(head_dim)
            t[p + "self_attn.k_norm.weight"] = norm(head_dim)
        if arch == "qwen2":
            for name, n in (("q_proj", dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
                t[p + f"self_attn.{name}.bias"] = (0.5 * nrng.standard_normal(n)).astype(np.float32)
        t[p + "mlp.gate_proj.weight"] = mat(ffn, dim)
        t[p + "mlp.up_proj.weight"] = mat(ffn, dim)
        t[p + "mlp.down_proj.weight"] = mat(dim, ffn)
    write_weights(out, {n: (a, dtype) for n, a in t.items()}, shards)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return config


def hf_reference_weights(model_dir: Path) -> dict[str, np.ndarray]:
    """A directory's weights as float32 arrays, by Hugging Face name (to edit and write back)."""
    import hf_reference

    return {n: a.astype(np.float32) for n, a in hf_reference.load_weights(Path(model_dir)).items()}


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's converter, which permutes Q/K rows for rotation of adjacent pairs."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_to_hf(gguf_path: str, out: Path) -> None:
    """A llama-architecture GGUF (SmolLM2) as a Hugging Face directory: weights dequantised to F32
    (the values the file encodes), Q/K rows unpermuted, config, tokenizer and chat template."""
    import gguf

    import reference

    out.mkdir(parents=True, exist_ok=True)
    r = gguf.GGUFReader(gguf_path, "r")
    f = lambda key: reference._field(r, key)  # noqa: E731
    arch = f("general.architecture")
    assert arch == "llama", arch
    n_heads, n_kv = f(f"{arch}.attention.head_count"), f(f"{arch}.attention.head_count_kv")
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    layer = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    tensors = {}
    for t in r.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        values = values.reshape([int(d) for d in reversed(t.shape.tolist())])
        if t.name.startswith("blk."):
            _, i, kind, _ = t.name.split(".")
            if kind == "attn_q":
                values = unpermute(values, n_heads)
            elif kind == "attn_k":
                values = unpermute(values, n_kv)
            name = f"model.layers.{i}.{layer[kind]}.weight"
        else:
            name = names[t.name]
        tensors[name] = (values, "F32")
    tied = "lm_head.weight" not in tensors
    write_weights(out, tensors, shards=2)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": f(f"{arch}.embedding_length"), "intermediate_size": f(f"{arch}.feed_forward_length"),
        "num_hidden_layers": f(f"{arch}.block_count"), "num_attention_heads": n_heads, "num_key_value_heads": n_kv,
        "vocab_size": tensors["model.embed_tokens.weight"][0].shape[0],
        "max_position_embeddings": f(f"{arch}.context_length"),
        "rms_norm_eps": f(f"{arch}.attention.layer_norm_rms_epsilon"), "rope_theta": f(f"{arch}.rope.freq_base"),
        "hidden_act": "silu", "tie_word_embeddings": tied, "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tok = reference.build_hf_tokenizer(gguf_path)
    tok.save(str(out / "tokenizer.json"))
    tokens = f("tokenizer.ggml.tokens")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tokens[f("tokenizer.ggml.bos_token_id")], "eos_token": tokens[f("tokenizer.ggml.eos_token_id")],
        "add_bos_token": False, "chat_template": f("tokenizer.chat_template")}))
