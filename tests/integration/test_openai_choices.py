"""Several choices in one request: `n` > 1 and completions' prompt lists, through the openai client.

`baton local --dtype f32` on the random test model; each choice is its own pipeline, and the n
choices of a prompt prefill it once and share its KV on one decode worker (the first choice's KV
is forked for the others). They answer as OpenAI answers:
  * a prompt list gives one choice per prompt, in order, each the text the prompt alone gives;
  * n choices of one prompt draw with seeds derived from the request's: choice 0 is the request
    with that seed alone, the others differ from it, and the same seed + n gives the same n again;
  * streamed, every chunk names its choice's index, each choice's chunks concatenate to its whole
    text, each ends with its own finish_reason; usage sums the choices (a prompt counted once);
  * a client that leaves mid-stream ends every choice and the workers free all their KV;
  * choice j is the prompt alone with choice j's derived seed, token for token, while the decode
    worker holds the prompt's full KV blocks once for all n (and the prefill worker computed it once).
"""

from __future__ import annotations

import threading
import time

import pytest

from serving_harness import HTTP, TEST_MODEL, Server, client, metric_values, random_ids, wait_blocks_free


@pytest.fixture(scope="module")
def api(baton_bin, test_model):
    s = Server(baton_bin, test_model, "--dtype", "f32", *HTTP)
    yield s
    s.stop_clean()


def streamed_by_index(chunks, chat):
    texts, finish = {}, {}
    for ch in chunks:
        for c in ch.choices:
            piece = (c.delta.content if chat else c.text) or ""
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                assert c.index not in finish, f"choice {c.index} finished twice"
                finish[c.index] = c.finish_reason
    return texts, finish


def test_a_prompt_list_answers_each_prompt_as_alone(api, rng):
    c = client(api)
    prompts = [random_ids(rng, rng.randrange(3, 30)) for _ in range(rng.randrange(2, 5))]
    alone = [c.completions.create(model=TEST_MODEL, prompt=p, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    r = c.completions.create(model=TEST_MODEL, prompt=prompts, max_tokens=10, temperature=0,
                             extra_body={"ignore_eos": True})
    assert [ch.index for ch in r.choices] == list(range(len(prompts)))
    assert [ch.text for ch in r.choices] == alone
    assert r.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert r.usage.completion_tokens == 10 * len(prompts)
    chunks = list(c.completions.create(model=TEST_MODEL, prompt=prompts, max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts, finish = streamed_by_index(chunks, chat=False)
    assert [texts[i] for i in range(len(prompts))] == alone
    assert finish == {i: "length" for i in range(len(prompts))}
    assert chunks[-1].usage.completion_tokens == 10 * len(prompts)


def test_n_choices_derive_their_seeds_and_repeat(api, rng):
    c = client(api)
    seed = rng.randrange(1 << 31)
    messages = [{"role": "user", "content": "tell me about the sea"}]
    kw = dict(model=TEST_MODEL, messages=messages, max_tokens=12, temperature=1.0, seed=seed,
              extra_body={"ignore_eos": True})
    n = 4
    r = c.chat.completions.create(n=n, **kw)
    texts = [ch.message.content for ch in r.choices]
    assert [ch.index for ch in r.choices] == list(range(n))
    assert texts[0] == c.chat.completions.create(**kw).choices[0].message.content  # choice 0: the seed itself
    assert len(set(texts)) > 1, "n sampled choices all alike"
    assert [ch.message.content for ch in c.chat.completions.create(n=n, **kw).choices] == texts  # seed + n repeats
    assert r.usage.prompt_tokens == c.chat.completions.create(**kw).usage.prompt_tokens  # counted once
    assert r.usage.completion_tokens == 12 * n
    # Streamed: the same n texts, each choice's chunks under its index, the role first in each.
    chunks = list(c.chat.completions.create(n=n, stream=True, **kw))
    got, finish = streamed_by_index(chunks, chat=True)
    assert [got[i] for i in range(n)] == texts
    assert finish == {i: "length" for i in range(n)}
    first_of = {}
    for ch in chunks:
        for choice in ch.choices:
            first_of.setdefault(choice.index, choice)
    assert all(first_of[i].delta.role == "assistant" for i in range(n))


def test_n_with_a_prompt_list_orders_choices_prompt_major(api, rng):
    c = client(api)
    prompts = [random_ids(rng, 8), random_ids(rng, 9)]
    r = c.completions.create(model=TEST_MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0,
                             extra_body={"ignore_eos": True})
    alone = [c.completions.create(model=TEST_MODEL, prompt=p, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    # Greedy: a prompt's n choices are alike; index = prompt * n + j.
    assert [ch.text for ch in r.choices] == [alone[0], alone[0], alone[1], alone[1]]


def test_a_client_that_leaves_ends_every_choice_and_frees_the_kv(test_model, server_factory):
    srv = server_factory(test_model, *HTTP)
    c = client(srv)
    stream = c.completions.create(model=TEST_MODEL, prompt=[[5, 6, 7], [8, 9, 10, 11]], n=3, max_tokens=1000,
                                  stream=True, extra_body={"ignore_eos": True})
    got = 0
    for _ in stream:
        got += 1
        if got == 12:
            break
    stream.close()
    closed_at = time.monotonic()
    assert wait_blocks_free(srv, timeout=10, roles=("decode", "prefill")), "KV blocks not freed after a disconnect"
    print(f"6 choices: KV free {time.monotonic() - closed_at:.3f} s after the disconnect")
    codes = metric_values(srv.metrics(), "baton_requests_total")
    assert codes.get('{code="CANCELLED"}') == 6, codes


def choice_seed(seed, j):
    """server/openai_request.cpp's choice_seed: choice j's seed from the request's."""
    if j == 0:
        return seed
    m = (1 << 64) - 1
    x = (seed + j * 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_forked_choices_equal_the_prompt_alone_with_their_seeds(api, rng):
    c = client(api)
    seed = rng.randrange(1 << 63)
    prompt = random_ids(rng, rng.randrange(20, 90))
    kw = dict(model=TEST_MODEL, prompt=prompt, max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    n = 3
    r = c.completions.create(n=n, seed=seed, **kw)
    choices = r.model_dump()["choices"]
    for j in range(n):
        alone = c.completions.create(seed=choice_seed(seed, j), **kw).choices[0].text
        assert choices[j]["text"] == alone, f"choice {j}"
    # Choice 0 went through the prefill worker; the others forked its KV on the same decode worker.
    assert choices[0]["baton"]["prefill_worker"] != ""
    for j in range(1, n):
        assert choices[j]["baton"]["prefill_worker"] == "", choices[j]["baton"]
        assert choices[j]["baton"]["decode_worker"] == choices[0]["baton"]["decode_worker"]


def test_n_choices_hold_the_prompts_full_blocks_once(test_model, server_factory, rng):
    # --max-batch 1: the first choice decodes alone while the forks wait for a slot with their
    # blocks reserved, so every choice's blocks are held at once for a while.
    srv = server_factory(test_model, *HTTP, "--dtype", "f32", "--max-batch", "1")
    block, n, n_prompt, max_tokens = 16, 4, 300, 600
    prompt = random_ids(rng, n_prompt)

    def blocks(k):
        return -(-k // block)

    def one(role, name):
        return next(v for labels, v in metric_values(srv.metrics(), name).items() if f'role="{role}"' in labels)

    capacity = one("decode", "baton_kv_blocks_capacity")
    lookups0 = sum(metric_values(srv.metrics(), "baton_prefix_cache_lookup_tokens_total").values())
    low = [capacity]
    done = threading.Event()

    def poll():
        while not done.is_set():
            low[0] = min(low[0], one("decode", "baton_kv_blocks_free"))
            time.sleep(0.01)

    t = threading.Thread(target=poll)
    t.start()
    try:
        r = client(srv).completions.create(model=TEST_MODEL, prompt=prompt, n=n, max_tokens=max_tokens,
                                           temperature=1.0, seed=rng.randrange(1 << 31),
                                           extra_body={"ignore_eos": True})
    finally:
        done.set()
        t.join()
    assert [len(ch.text) > 0 for ch in r.choices] == [True] * n
    # The first choice: prompt + max_tokens; each fork: its own blocks from the prompt's last
    # partial block on (positions [0, n_prompt - 1) shared: their full blocks once).
    own = blocks(n_prompt + max_tokens) - (n_prompt - 1) // block
    want = blocks(n_prompt + max_tokens) + (n - 1) * own
    held = capacity - low[0]
    print(f"n={n}, {n_prompt}-token prompt: decode KV blocks held at most {held:.0f} "
          f"(shared: {want}; one copy each: {n * blocks(n_prompt + max_tokens)})")
    assert held == want
    # The prefill worker looked the prompt up (and computed it) once, not n times.
    lookups = sum(metric_values(srv.metrics(), "baton_prefix_cache_lookup_tokens_total").values()) - lookups0
    assert lookups == n_prompt
    assert wait_blocks_free(srv, timeout=10), "KV blocks not freed after the request"
