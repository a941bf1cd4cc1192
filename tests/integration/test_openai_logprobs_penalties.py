"""Log-probabilities and sampling penalties through both APIs, checked against the numpy reference.

`baton local --dtype f32` on the random test model. The reference (tests/e2e/reference.py) runs the
same GGUF in float64 numpy and shares no code with baton:
  * logprobs: each token's value and its top alternatives are log_softmax of the reference's
    logits at that position (raw: before temperature, top-k/p and penalties), within twice the
    logit tolerance the f32 path is held to (log_softmax moves by at most 2 x max |logit error|);
  * penalties: greedy output with presence, frequency and repetition penalties equals the
    reference's argmax over the penalised logits (OpenAI's and Hugging Face's definitions, written
    out below), step by step, except where the top two are within that tolerance;
  * the OpenAI shapes, whole and streamed (streamed chunks carry the logprobs of their tokens), and
    refusals naming the field.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest

from serving_harness import HTTP, REPO, TEST_MODEL, Server, client, random_ids

sys.path.insert(0, str(REPO / "tests" / "e2e"))
import reference as numpy_reference  # noqa: E402

LOGITS_TOL = 1e-3  # x the reference's logit range: what the f32 path is held to (tests/e2e)


@pytest.fixture(scope="module")
def api(baton_bin, test_model):
    s = Server(baton_bin, test_model, "--dtype", "f32", *HTTP)
    yield s
    s.stop_clean()


@pytest.fixture(scope="module")
def ref(test_model):
    return numpy_reference.load(str(test_model))


def grpc_generate(pb, address, prompt, max_tokens, **sampling):
    req = pb.gen.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)
    req.sampling.CopyFrom(pb.gen.SamplingParams(**sampling))
    with grpc.insecure_channel(address) as ch:
        msgs = list(pb.gen_grpc.GenerationStub(ch).Generate(req, timeout=120))
    ids = [t for m in msgs for t in m.token_ids]
    lps = [lp for m in msgs for lp in m.logprobs]
    return ids, lps


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def reference_rows(ref, prompt, out):
    """The reference's logits at each generated position: row i predicts out[i]."""
    logits = ref.forward(list(prompt) + list(out[:-1])).astype(np.float64)
    return logits[len(prompt) - 1:]


def test_logprobs_over_grpc_are_the_reference_log_softmax(pb, api, ref, rng):
    for temperature, top in ((0.0, 5), (1.0, 20), (0.7, 0)):
        prompt = random_ids(rng, rng.randrange(3, 60))
        ids, lps = grpc_generate(pb, api.address, prompt, 12, temperature=temperature, seed=rng.randrange(1 << 32),
                                 top_logprobs=top)
        assert len(ids) == 12 and len(lps) == 12
        rows = reference_rows(ref, prompt, ids)
        for i, (tok, lp) in enumerate(zip(ids, lps)):
            want = log_softmax(rows[i])
            tol = 2 * LOGITS_TOL * float(rows[i].max() - rows[i].min())
            assert lp.token_id == tok
            assert abs(lp.logprob - want[tok]) <= tol, (i, lp.logprob, want[tok], tol)
            assert len(lp.top_token_ids) == top == len(lp.top_logprobs)
            # The alternatives: the reference's best `top`, in order, up to ties within the tolerance.
            best = np.sort(want)[::-1][:top]
            assert np.all(np.abs(np.array(lp.top_logprobs) - best) <= tol), (i, list(lp.top_logprobs), best)
            for t, v in zip(lp.top_token_ids, lp.top_logprobs):
                assert abs(v - want[t]) <= tol
            assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)


def penalised(logits, prompt, out, presence, frequency, repetition):
    """OpenAI's presence/frequency penalties over the output, after Hugging Face's repetition
    penalty over prompt and output."""
    x = np.array(logits, dtype=np.float64)
    seen = sorted(set(prompt) | set(out))
    if seen:
        v = x[seen]
        x[seen] = np.where(v < 0, v * repetition, v / repetition)
    counts = {}
    for t in out:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        x[t] -= frequency * c + presence
    return x


@pytest.mark.parametrize("presence,frequency,repetition", [(1.5, 0.0, 1.0), (0.0, 0.8, 1.0), (0.0, 0.0, 1.8),
                                                           (-0.5, 0.6, 1.3)])
def test_penalised_greedy_equals_the_reference(pb, api, ref, rng, presence, frequency, repetition):
    kw = dict(temperature=0.0, presence_penalty=presence, frequency_penalty=frequency)
    if repetition != 1.0:
        kw["repetition_penalty"] = repetition
    # Prompts until one where the penalties change some step's choice (most do at once): on one
    # where they change nothing, the comparison would not show they were applied.
    for attempt in range(8):
        prompt = random_ids(rng, rng.randrange(5, 40))
        ids, _ = grpc_generate(pb, api.address, prompt, 24, **kw)
        # The reference runs over baton's own sequence, so every step is checked on the same context.
        rows = reference_rows(ref, prompt, ids)
        exact = 0
        for i, tok in enumerate(ids):
            x = penalised(rows[i], prompt, ids[:i], presence, frequency, repetition)
            best = int(np.argmax(x))
            tol = 2 * LOGITS_TOL * float(rows[i].max() - rows[i].min())
            # Another token only where it ties the best within the tolerance.
            assert tok == best or x[tok] >= x[best] - tol, (i, tok, best, x[tok] - x[best], ids)
            exact += tok == best
        assert exact >= len(ids) - 2
        raw_best = [int(np.argmax(rows[i])) for i in range(len(ids))]
        if raw_best != ids:
            return
    pytest.fail("8 prompts and no step where the penalties changed the choice: the test shows nothing")


def test_completions_logprobs_whole_and_streamed(api, rng):
    c = client(api)
    prompt = random_ids(rng, 20)
    k = rng.randrange(0, 6)
    r = c.completions.create(model=TEST_MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=k,
                             extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(v <= 0 for v in lp.token_logprobs)
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tok in top and top[tok] == v  # the sampled token is always among them
        assert 1 <= len(top) <= k + 1  # k alternatives, and the token when it is not one of them
        # Greedy: the token is the most likely one.
        assert v >= max(top.values()) - 1e-6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    if not any(t.startswith("bytes:") for t in lp.tokens):
        assert "".join(lp.tokens) == r.choices[0].text
    # Streamed: the chunks' logprobs, in order, are the whole response's.
    chunks = list(c.completions.create(model=TEST_MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=k,
                                       stream=True, extra_body={"ignore_eos": True}))
    tokens, values, offsets = [], [], []
    for ch in chunks:
        if ch.choices and ch.choices[0].logprobs:
            tokens += ch.choices[0].logprobs.tokens
            values += ch.choices[0].logprobs.token_logprobs
            offsets += ch.choices[0].logprobs.text_offset
    assert tokens == lp.tokens
    assert np.allclose(values, lp.token_logprobs, atol=1e-5)
    assert offsets == lp.text_offset


def test_chat_logprobs_whole_and_streamed(api, rng):
    c = client(api)
    messages = [{"role": "user", "content": "why is the sky blue"}]
    k = rng.randrange(0, 21)
    r = c.chat.completions.create(model=TEST_MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True,
                                  top_logprobs=k, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    # The tokens' bytes are the text's, exactly.
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace") == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == k
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        if k:
            assert t.logprob >= t.top_logprobs[0].logprob - 1e-6  # greedy: the best
    chunks = list(c.chat.completions.create(model=TEST_MODEL, messages=messages, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=k, stream=True,
                                            extra_body={"ignore_eos": True}))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert np.allclose([t.logprob for t in streamed], [t.logprob for t in content], atol=1e-5)
    # Without logprobs: null, as OpenAI answers.
    r = c.chat.completions.create(model=TEST_MODEL, messages=messages, max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None


def test_penalties_through_the_openai_client_and_seed_repeats(api, rng):
    c = client(api)
    prompt = random_ids(rng, 15)
    kw = dict(model=TEST_MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=rng.randrange(1 << 31),
              presence_penalty=0.7, frequency_penalty=0.4, extra_body={"ignore_eos": True, "repetition_penalty": 1.2})
    a = c.completions.create(**kw).choices[0].text
    b = c.completions.create(**kw).choices[0].text
    assert a == b  # seed + penalties: reproducible


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3), ("logprobs", 6),
                                         ("repetition_penalty", 0)])
def test_out_of_range_is_refused_naming_the_field(api, field, value):
    c = client(api)
    body = {"ignore_eos": True, field: value}
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=TEST_MODEL, prompt="hi", max_tokens=2, extra_body=body)
    assert e.value.body["param"] == field
    assert field in e.value.body["message"]


def test_grpc_refuses_out_of_range_naming_the_field(pb, api):
    for sampling, field in (({"presence_penalty": 9}, "sampling.presence_penalty"),
                            ({"top_logprobs": 21}, "sampling.top_logprobs"),
                            ({"repetition_penalty": -1}, "sampling.repetition_penalty")):
        with pytest.raises(grpc.RpcError) as e:
            grpc_generate(pb, api.address, [5, 6, 7], 2, **sampling)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith(field), e.value.details()
