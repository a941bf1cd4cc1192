"""Hugging Face model directories (`--model DIR`: config.json, safetensors, tokenizer.json) of
each architecture baton loads, against hf_reference.py, a numpy forward written from
transformers' modelling code (rotate_half RoPE on unpermuted q/k, repeat_kv, llama3 scaling):

- random-weight models of random small shapes (a fresh seed each run, printed;
  BATON_REFERENCE_SEED replays it): Llama with llama3 RoPE scaling in BF16, Llama with tied
  embeddings in F16 across two shards, Qwen2 with q/k/v biases, Qwen3 (q/k norms, its own
  head_dim, tied embeddings), Mistral with a sliding window.
  `baton generate --dtype f32 --logits-all-out` gives every prompt position's logits within
  LOGITS_TOL x the reference's logit range (the derivation is test_reference_archs.py's: f32
  against float64 over a few layers; measured ~5e-7), and the same greedy ids unless the
  reference's top-2 margin is within the tolerance where they part;
- the same models served by `baton local`: a Generate through gRPC gives the reference's greedy
  ids and a completion through the OpenAI API their text;
- SmolLM2-135M-Instruct converted here from its GGUF (weights dequantised, q/k permutation
  undone, tokenizer and chat template carried over) gives the GGUF's greedy ids for a chat;
- what baton cannot honour is refused at load, naming the key or the tensor.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hf_models
from hf_reference import HfReference

LOGITS_TOL = 1e-4
N_GEN = 12
TIMEOUT = 300

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

MODELS = {
    "llama-llama3-bf16": ("llama", dict(dtype="BF16", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "llama-tied-f16-shards": ("llama", dict(dtype="F16", tied=True, shards=2)),
    "qwen2-biases": ("qwen2", dict(dtype="BF16")),
    "qwen3-qk-norm": ("qwen3", dict(dtype="BF16", tied=True)),
    "mistral-window": ("mistral", dict(sliding_window=128)),
}


@pytest.fixture(scope="module")
def seed() -> int:
    s = int(os.environ.get("BATON_REFERENCE_SEED", random.randrange(1 << 31)))
    print(f"random seed {s} (BATON_REFERENCE_SEED={s} replays it)")
    return s


@pytest.fixture(scope="module")
def models(seed, tmp_path_factory):
    """{name: (directory, its reference)}."""
    out = {}
    for name, (arch, kw) in MODELS.items():
        path = tmp_path_factory.mktemp(name)
        config = hf_models.random_model(path, arch, random.Random(f"{seed}/{name}"), **kw)
        print(f"{name}: {json.dumps({k: config[k] for k in ('hidden_size', 'num_hidden_layers', 'num_attention_heads', 'num_key_value_heads', 'intermediate_size', 'vocab_size')})}")
        out[name] = (path, HfReference(path))
    return out


def generate(baton_bin, model, ids, logits_path=None, extra=()):
    args = [baton_bin, "generate", "--model", str(model), "--dtype", "f32", "--prompt-ids", ",".join(map(str, ids)),
            "--max-tokens", str(N_GEN), "--print-ids", "--ignore-eos", *extra]
    if logits_path:
        args += ["--logits-all-out", str(logits_path)]
    p = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"baton generate exited {p.returncode}: {p.stderr[-2000:]}"
    return [int(t) for t in p.stdout.strip().split(",") if t]


def assert_same_greedy(name, got, want, margins, logit_range):
    if got == want:
        return
    i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    assert margins[i] <= LOGITS_TOL * logit_range, (
        f"{name}: greedy ids part at step {i} where the reference's top-2 margin {margins[i]:.3g} is no near-tie\n"
        f"baton     {got}\nreference {want}")


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_and_greedy_ids_match_the_reference(baton_bin, models, seed, tmp_path, name):
    path, ref = models[name]
    rng = random.Random(f"{seed}/{name}/prompt")
    ids = [rng.randrange(257) for _ in range(rng.randint(24, 64))]
    want = ref.logits(ids)
    got_ids = generate(baton_bin, path, ids, tmp_path / "logits.npy")
    got = np.load(tmp_path / "logits.npy").astype(np.float64)
    assert got.shape == want.shape
    logit_range = float(want.max() - want.min())
    err = np.abs(got - want).max()
    print(f"{name}: {len(ids)} positions, max |error| = {err / logit_range:.3g} x range")
    assert err <= LOGITS_TOL * logit_range, f"{name}: logits differ by {err / logit_range:.3g} x range"
    want_ids, margins = ref.greedy(ids, N_GEN)
    assert_same_greedy(name, got_ids, want_ids, margins, logit_range)


def test_served_by_baton_local_through_grpc_and_the_openai_api(baton_bin, models, seed, pb):
    """Each model served: the reference's greedy ids through gRPC, their text through the OpenAI
    completions API (the reference's ids decoded by the model's own tokenizer.json)."""
    import grpc
    from openai import OpenAI
    from tokenizers import Tokenizer

    from serving_harness import Server

    for name, (path, ref) in models.items():
        rng = random.Random(f"{seed}/{name}/served")
        ids = [rng.randrange(257) for _ in range(rng.randint(8, 32))]
        want_ids, _ = ref.greedy(ids, N_GEN)
        srv = Server(Path(baton_bin), path, "--dtype", "f32", "--http-listen", "127.0.0.1:0")
        try:
            req = pb.gen.GenerateRequest(prompt_token_ids=ids, max_tokens=N_GEN, ignore_eos=True)
            with grpc.insecure_channel(srv.address) as ch:
                msgs = list(pb.gen_grpc.GenerationStub(ch).Generate(req, timeout=120))
            assert [t for m in msgs for t in m.token_ids] == want_ids, name
            client = OpenAI(base_url=f"{srv.http_url}/v1", api_key="unused")
            model_name = client.models.list().data[0].id
            r = client.completions.create(model=model_name, prompt=ids, max_tokens=N_GEN, temperature=0,
                                          extra_body={"ignore_eos": True})
            text = Tokenizer.from_file(str(path / "tokenizer.json")).decode(want_ids, skip_special_tokens=False)
            assert r.choices[0].text == text, name
        finally:
            srv.stop()


def test_smollm2_converted_to_a_directory_gives_the_ggufs_greedy_ids(baton_bin, model_path, tmp_path):
    """The conversion dequantises the weights to F32 and undoes the GGUF's q/k permutation: in the
    directory baton rotates halves (Hugging Face's layout), in the GGUF adjacent pairs."""
    out = tmp_path / "smollm2"
    hf_models.gguf_to_hf(model_path, out)
    for chat in ("What is the capital of France?", "Name three colours."):
        args = ["generate", "--dtype", "f32", "--chat", chat, "--max-tokens", "32", "--print-ids"]
        from_gguf = subprocess.run([baton_bin, *args, "--model", model_path], capture_output=True, text=True,
                                   timeout=TIMEOUT)
        from_dir = subprocess.run([baton_bin, *args, "--model", str(out)], capture_output=True, text=True,
                                  timeout=TIMEOUT)
        assert from_gguf.returncode == 0 and from_dir.returncode == 0, from_dir.stderr
        print(f"{chat!r}: {from_gguf.stdout.strip()}")
        assert from_dir.stdout == from_gguf.stdout, chat
    shutil.rmtree(out)


def refused(baton_bin, path, *, contains):
    p = subprocess.run([baton_bin, "generate", "--model", str(path), "--prompt-ids", "1,2", "--max-tokens", "1"],
                       capture_output=True, text=True, timeout=TIMEOUT)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert contains in lines[0], lines[0]


def test_what_baton_cannot_honour_is_refused_by_name(baton_bin, tmp_path, seed):
    rng = random.Random(f"{seed}/refusals")

    def variant(name, arch="llama", **kw):
        path = tmp_path / name
        hf_models.random_model(path, arch, rng, **kw)
        return path

    def edit_config(path, **changes):
        config = json.loads((path / "config.json").read_text())
        config.update(changes)
        (path / "config.json").write_text(json.dumps(config))

    p = variant("gemma")
    edit_config(p, architectures=["GemmaForCausalLM"])
    refused(baton_bin, p, contains="GemmaForCausalLM")
    for key, value in (("attention_bias", True), ("mlp_bias", True), ("partial_rotary_factor", 0.5),
                       ("hidden_act", "gelu"), ("quantization_config", {"quant_method": "gptq"})):
        p = variant(key)
        edit_config(p, **{key: value})
        refused(baton_bin, p, contains=key)
    p = variant("yarn")
    edit_config(p, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    refused(baton_bin, p, contains="yarn")
    # A tensor baton does not know: o_proj's bias would be silently dropped.
    p = variant("o_bias")
    weights = hf_models.hf_reference_weights(p)
    weights["model.layers.0.self_attn.o_proj.bias"] = np.zeros(weights["model.norm.weight"].shape, np.float32)
    hf_models.write_weights(p, {n: (a.astype(np.float32), "F32") for n, a in weights.items()}, shards=1)
    refused(baton_bin, p, contains="model.layers.0.self_attn.o_proj.bias")
    # Untied without an LM head.
    p = variant("no_head")
    edit_config(p, tie_word_embeddings=False)
    weights = hf_models.hf_reference_weights(p)
    weights.pop("lm_head.weight", None)
    hf_models.write_weights(p, {n: (a.astype(np.float32), "F32") for n, a in weights.items()}, shards=1)
    refused(baton_bin, p, contains="lm_head.weight")
    # Integer weights are not read as floats.
    p = variant("int8")
    data = (p / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["model.norm.weight"]["dtype"] = "I8"
    header["model.norm.weight"]["data_offsets"][1] = header["model.norm.weight"]["data_offsets"][0] + \
        int(np.prod(header["model.norm.weight"]["shape"]))
    text = json.dumps(header).encode()
    (p / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])
    refused(baton_bin, p, contains="I8")
    # A model too long for its sliding window is served only up to it (said in the log), not refused.
    p = variant("window", arch="mistral", sliding_window=64)
    r = subprocess.run([baton_bin, "generate", "--model", str(p), "--prompt-ids", ",".join(["5"] * 70),
                        "--max-tokens", "1"], capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode != 0 and "64" in r.stderr, r.stderr
