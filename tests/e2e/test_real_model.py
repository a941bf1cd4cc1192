"""baton on the real SmolLM2-135M-Instruct GGUF, checked against the numpy reference.

Acceptance criteria shown here:
  * f32 prompt logits (every position) of 5 varied prompts within 1e-3 x the reference's logit
    range; 32-token greedy continuations equal to the reference's (EOS ignored);
  * bf16 top-1 agreement with f32 >= 98 % over all prompt positions pooled;
  * --logits-out equals the last row of --logits-all-out;
  * chunked prefill (--prefill-chunk 1, 7, 64) matches the unchunked last-position logits;
  * bad input exits 1 or 2 with exactly one "baton: ..." line on stderr and nothing on stdout.

Measured values are printed (see the "baton e2e measurements" section of the summary).
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

# Five prompts of <= 64 tokens each: plain English, a ChatML chat, multilingual, code, emoji.
PROMPTS = {
    "english": "The history of the Roman Empire spans more than a thousand years. It began when "
               "Augustus became the first emperor in 27 BC, and",
    "chatml": "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
              "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France? Answer in one "
              "sentence.<|im_end|>\n<|im_start|>assistant\n",
    "multilingual": "Bonjour, je m'appelle Marie et j'habite à Paris. 我喜欢学习中文。 "
                    "Москва — столица России. English:",
    "python": "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
              "fibonacci(n - 2)\n\n\nfor i in range(10):\n",
    "emoji": "I love pizza 🍕 and sunny days ☀️! My favourite animals are 🐶, 🐱 and 🦊. "
             "Today I feel",
}

# About 100 tokens, for the chunked-prefill check.
LONG_PROMPT = (
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light into "
    "chemical energy. In the chloroplasts, chlorophyll absorbs sunlight, mostly in the blue and red "
    "parts of the spectrum. The energy splits water molecules, releasing oxygen as a by-product, "
    "and drives the synthesis of ATP and NADPH. In the Calvin cycle these molecules fix carbon "
    "dioxide from the air into sugars, which the plant uses to grow. Almost all life on Earth "
    "depends on this process, because")

N_GEN = 32
LOGITS_TOL = 1e-3       # x the reference's logit range, per prompt
BF16_MIN_AGREEMENT = 0.98
# Native weights quantise the activations to int8 per block of 32 as well; the disagreements are
# near-ties. The figure moves with the kernel's f32 summation order, because a rounding-level
# change flips an activation's int8 rounding in a later layer: 98.05% (201 of 205) when the
# kernel summed the minimum terms apart, 96.59% (198) with the 16-row tile kernel, which sums
# them per block; the largest deviation stayed 3.5-3.7% of the logit range (bf16: 99.0%).
NATIVE_MIN_AGREEMENT = 0.95
NATIVE_MAX_DEVIATION = 0.06   # x the f32 logit range
CHUNK_TOL = 1e-4        # x the unchunked logit range
TIMEOUT = 300           # seconds, per baton invocation


def _baton(baton_bin, *args, timeout=TIMEOUT):
    cmd = [baton_bin, *map(str, args)]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"baton did not finish in {timeout} s: {' '.join(cmd)[:300]}")


def _ok(p):
    assert p.returncode == 0, (
        f"baton exited {p.returncode}\nargs: {' '.join(p.args)[:300]}\nstderr:\n{p.stderr[-3000:]}")
    return p


def _ids_arg(ids):
    return ",".join(str(i) for i in ids)


def _load_npy(path, shape):
    a = np.load(path)
    assert a.dtype == np.float32, f"{path}: dtype {a.dtype}, want float32"
    assert a.shape == shape, f"{path}: shape {a.shape}, want {shape}"
    assert np.isfinite(a).all(), f"{path}: non-finite logits"
    return a


# ---- shared, memoised results ------------------------------------------------------------------

@pytest.fixture(scope="module")
def prompt_ids(hf_tokenizer):
    ids = {name: hf_tokenizer.encode(text, add_special_tokens=False).ids
           for name, text in PROMPTS.items()}
    for name, v in ids.items():
        assert 0 < len(v) <= 64, f"prompt {name!r} is {len(v)} tokens"
    return ids


@pytest.fixture(scope="module")
def ref_run(reference, prompt_ids):
    """ref_run(name) -> (prompt logits float32 [T, V], 32 greedy ids, per-step top-2 margins)."""
    memo = {}

    def get(name):
        if name not in memo:
            memo[name] = reference.run(prompt_ids[name], N_GEN, all_logits=True)
        return memo[name]
    return get


@pytest.fixture(scope="module")
def baton_logits_all(baton_bin, model_path, prompt_ids, reference, tmp_path_factory):
    """baton_logits_all(name, dtype) -> float32 [T, V] of every prompt position."""
    memo = {}
    d = tmp_path_factory.mktemp("logits")

    def get(name, dtype, weights="auto"):
        if (name, dtype, weights) not in memo:
            ids = prompt_ids[name]
            out = d / f"{name}-{dtype}-{weights}.npy"
            _ok(_baton(baton_bin, "generate", "--model", model_path, "--prompt-ids", _ids_arg(ids),
                       "--max-tokens", 0, "--dtype", dtype, "--weights", weights, "--logits-all-out", out))
            memo[name, dtype, weights] = _load_npy(out, (len(ids), reference.vocab))
        return memo[name, dtype, weights]
    return get


# ---- baton against the reference ---------------------------------------------------------------

@pytest.mark.parametrize("name", list(PROMPTS))
def test_prompt_logits_match_reference(name, baton_logits_all, ref_run, measure):
    ref = ref_run(name)[0]
    got = baton_logits_all(name, "f32")
    rng = float(ref.max() - ref.min())
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    worst = float(diff.max())
    pos = int(np.unravel_index(diff.argmax(), diff.shape)[0])
    measure(f"f32 logits {name:13s} T={ref.shape[0]:3d}: max|baton-ref| = {worst:.3e} "
            f"(range {rng:.2f}, {worst / rng:.2e} x range, tol {LOGITS_TOL:.0e}); "
            f"top-1 agreement {np.mean(got.argmax(1) == ref.argmax(1)):.1%}")
    assert worst <= LOGITS_TOL * rng, (
        f"{name}: max |baton - reference| = {worst:.4g} at position {pos} > "
        f"{LOGITS_TOL} x range {rng:.4g}")


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_matches_reference(name, baton_bin, model_path, prompt_ids, ref_run, hf_tokenizer,
                                  measure):
    _, want, margins = ref_run(name)
    p = _ok(_baton(baton_bin, "generate", "--model", model_path, "--prompt-ids",
                   _ids_arg(prompt_ids[name]), "--max-tokens", N_GEN, "--dtype", "f32",
                   "--print-ids", "--ignore-eos"))
    lines = [l for l in p.stdout.splitlines() if l.strip()]
    assert len(lines) == 1, f"want one line of ids on stdout, got:\n{p.stdout[:2000]}"
    got = [int(s) for s in lines[0].replace(" ", "").split(",") if s]
    text = hf_tokenizer.decode(want, skip_special_tokens=False)
    measure(f"greedy {name:13s}: {'equal' if got == want else 'DIFFERENT'} "
            f"(reference min top-2 margin {min(margins):.3f}); {text[:70]!r}")
    if got != want:
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        gap = f", reference top-2 margin there {margins[k]:.4g}" if k < len(margins) else ""
        pytest.fail(f"{name}: baton's {len(got)} ids differ from the reference's {len(want)} at "
                    f"step {k}{gap}\nbaton: {got}\nref:   {want}\n"
                    f"baton text: {hf_tokenizer.decode(got, skip_special_tokens=False)!r}\n"
                    f"ref text:   {text!r}")


# ---- baton against itself ----------------------------------------------------------------------

def agreement_with_f32(baton_logits_all, label, minimum, measure, *mode, max_deviation=None):
    """Top-1 agreement of every prompt position's logits in `mode` (dtype[, weights]) with the f32
    mode's, measured and checked against `minimum`; the largest deviation against `max_deviation`
    (x the logit range) when given."""
    agree = total = 0
    worst = 0.0
    for name in PROMPTS:
        f32 = baton_logits_all(name, "f32")
        other = baton_logits_all(name, *mode)
        agree += int(np.sum(f32.argmax(1) == other.argmax(1)))
        total += f32.shape[0]
        worst = max(worst, float(np.abs(f32 - other).max() / (f32.max() - f32.min())))
    rate = agree / total
    measure(f"{label} vs f32 top-1 agreement: {agree}/{total} = {rate:.2%} (min {minimum:.0%});"
            f" max |{label}-f32| = {worst:.2e} x range")
    assert rate >= minimum
    if max_deviation is not None:
        assert worst <= max_deviation


def test_bf16_top1_agreement_with_f32(baton_logits_all, measure):
    agreement_with_f32(baton_logits_all, "bf16", BF16_MIN_AGREEMENT, measure, "bf16", "dense")


def test_native_weights_agree_with_f32(baton_logits_all, baton_bin, model_path, measure):
    """Native weights (the file's Q4_1/Q8_0 blocks times int8 activations, every step) against the
    f32 reference mode, and the chat answer."""
    agreement_with_f32(baton_logits_all, "native", NATIVE_MIN_AGREEMENT, measure, "bf16", "native",
                       max_deviation=NATIVE_MAX_DEVIATION)
    # Not the bare question: its first token is a near-tie in f32 ("The" 0.08 logits above "L"), which
    # int8 activations decide either way; with "Answer in one sentence." the margin is 1.3-1.5.
    p = _ok(_baton(baton_bin, "generate", "--model", model_path, "--chat",
                   "What is the capital of France? Answer in one sentence.", "--max-tokens", 24, "--weights", "native"))
    assert "Paris" in p.stdout, p.stdout


@pytest.mark.parametrize("name", ["chatml", "python"])
def test_logits_out_is_last_row_of_logits_all(name, baton_bin, model_path, prompt_ids, reference,
                                              baton_logits_all, tmp_path, measure):
    out = tmp_path / "last.npy"
    _ok(_baton(baton_bin, "generate", "--model", model_path, "--prompt-ids",
               _ids_arg(prompt_ids[name]), "--max-tokens", 0, "--dtype", "f32",
               "--logits-out", out))
    last = _load_npy(out, (reference.vocab,))
    row = baton_logits_all(name, "f32")[-1]
    diff = float(np.abs(last - row).max())
    rng = float(row.max() - row.min())
    measure(f"--logits-out vs last row of --logits-all-out ({name}): max diff {diff:.3e}"
            f"{' (bitwise equal)' if np.array_equal(last, row) else ''}")
    # Same prefill; only the LM head's row selection differs (a GEMM of 1 row vs T rows).
    assert diff <= 1e-5 * rng


@pytest.fixture(scope="module")
def long_prompt_ids(hf_tokenizer):
    ids = hf_tokenizer.encode(LONG_PROMPT, add_special_tokens=False).ids
    assert 90 <= len(ids) <= 110, len(ids)
    return ids


@pytest.fixture(scope="module")
def unchunked_last_logits(baton_bin, model_path, long_prompt_ids, reference, tmp_path_factory):
    out = tmp_path_factory.mktemp("chunk") / "unchunked.npy"
    _ok(_baton(baton_bin, "generate", "--model", model_path, "--prompt-ids",
               _ids_arg(long_prompt_ids), "--max-tokens", 0, "--dtype", "f32", "--logits-out", out))
    return _load_npy(out, (reference.vocab,))


def test_long_prompt_last_logits_match_reference(unchunked_last_logits, reference, long_prompt_ids,
                                                 measure):
    ref = reference.forward(long_prompt_ids)[-1]
    rng = float(ref.max() - ref.min())
    worst = float(np.abs(unchunked_last_logits.astype(np.float64) - ref).max())
    measure(f"f32 last logits, {len(long_prompt_ids)}-token prompt: max|baton-ref| = {worst:.3e} "
            f"({worst / rng:.2e} x range)")
    assert worst <= LOGITS_TOL * rng


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_matches_unchunked(chunk, baton_bin, model_path, long_prompt_ids,
                                           unchunked_last_logits, reference, tmp_path, measure):
    out = tmp_path / f"chunk{chunk}.npy"
    _ok(_baton(baton_bin, "generate", "--model", model_path, "--prompt-ids",
               _ids_arg(long_prompt_ids), "--max-tokens", 0, "--dtype", "f32",
               "--prefill-chunk", chunk, "--logits-out", out))
    got = _load_npy(out, (reference.vocab,))
    base = unchunked_last_logits
    rng = float(base.max() - base.min())
    diff = float(np.abs(got - base).max())
    measure(f"--prefill-chunk {chunk:2d} ({len(long_prompt_ids)} tokens): max|chunked-unchunked| = "
            f"{diff:.3e} ({diff / rng:.2e} x range, tol {CHUNK_TOL:.0e} x range)")
    assert diff <= CHUNK_TOL * rng


# ---- bad input -------------------------------------------------------------------------------

BAD_INPUTS = ["missing-model", "truncated-model", "empty-prompt", "prompt-longer-than-context",
              "dtype-f64"]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_fails_cleanly(case, baton_bin, model_path, tmp_path):
    model = model_path
    prompt = ["--prompt-ids", "1,2,3"]
    extra = []
    if case == "missing-model":
        model = str(tmp_path / "does-not-exist.gguf")
    elif case == "truncated-model":
        model = str(tmp_path / "truncated.gguf")
        with open(model_path, "rb") as src, open(model, "wb") as dst:
            dst.write(src.read(1 << 20))
    elif case == "empty-prompt":
        prompt = ["--prompt", ""]
    elif case == "prompt-longer-than-context":
        prompt = ["--prompt-ids", ",".join(["100"] * 9000)]  # the model's context is 8192
    elif case == "dtype-f64":
        extra = ["--dtype", "f64"]
    p = _baton(baton_bin, "generate", "--model", model, *prompt, "--max-tokens", 1, *extra,
               timeout=120)
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    detail = f"exit {p.returncode}\nstdout:\n{p.stdout[:1000]}\nstderr:\n{p.stderr[:2000]}"
    assert p.returncode in (1, 2), detail
    assert p.stdout == "", detail
    assert len(lines) == 1 and lines[0].startswith("baton: ") and len(lines[0]) > len("baton: "), \
        detail
    print(f"{case}: exit {p.returncode}: {lines[0]}")


def test_reference_sanity_chatml_answers_paris(ref_run, hf_tokenizer):
    """The reference itself is sane: the chat prompt is answered with Paris."""
    text = hf_tokenizer.decode(ref_run("chatml")[1], skip_special_tokens=True)
    assert "Paris" in text, text
