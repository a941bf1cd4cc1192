"""The prefill workers' prefix cache over real processes (`baton local` on the random test model,
f32): outputs equal those of a server without the cache and of single-process `baton generate`
whatever two prompts share, also after evictions; a chat's turns report growing cached prompt
tokens in Timing and the hit counters agree; cancelled requests hold no block once idle; with two
prefill workers a repeated prefix stays on the worker that has it."""

import random
import time

import grpc
import pytest

from serving_harness import Stream, make_test_model, metric_values, wait_blocks_free
from test_serving import generate, reference_ids

BLOCK = 16  # baton's default --block-size


@pytest.fixture(scope="module")
def rng():
    seed = random.randrange(1 << 30)
    print(f"random seed {seed}")
    return random.Random(seed)


def tokens(rng, n):
    return [rng.randrange(3, 275) for _ in range(n)]


def lcp(a, b):
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def expected_cached(cached_prompts, q):
    """What a prefill worker holding every full block of `cached_prompts` reuses for `q`: the
    whole blocks shared with one of them, never the block holding q's last token."""
    best = max((min(lcp(p, q), len(p)) // BLOCK for p in cached_prompts), default=0)
    return min(best, (len(q) - 1) // BLOCK) * BLOCK


def diverge(rng, base, keep, n):
    """`base` cut at `keep`, then fresh tokens up to `n` (the first differing from base's)."""
    q = base[:keep]
    while len(q) < n:
        q.append(rng.randrange(3, 275))
    if keep < len(base) and keep < len(q) and q[keep] == base[keep]:
        q[keep] = 3 + (q[keep] - 2) % 272
    return q


def prefill_counter(srv, name):
    return sum(v for k, v in metric_values(srv.metrics(), name).items() if 'role="prefill"' in k)


def test_outputs_equal_without_the_cache_whatever_the_prompts_share(pb, baton_bin, test_model, server_factory, rng):
    common = ("--dtype", "f32", "--prefill-token-budget", "48", "--kv-blocks", "1024")
    on = server_factory(test_model, *common)
    off = server_factory(test_model, *common, "--prefix-cache-blocks", "0")
    p = tokens(rng, BLOCK * rng.randrange(4, 8) + rng.randrange(1, BLOCK))
    n_blocks = len(p) // BLOCK
    cases = {
        "nothing": diverge(rng, p, 0, rng.randrange(20, 120)),
        "part of one block": diverge(rng, p, rng.randrange(1, BLOCK), len(p) + rng.randrange(0, 30)),
        "whole blocks": diverge(rng, p, BLOCK * rng.randrange(1, n_blocks + 1), len(p) + rng.randrange(1, 30)),
        "all but the last token": diverge(rng, p, len(p) - 1, len(p)),
        "everything": list(p),
    }
    cached_prompts = []
    for name, q in [("first", p)] + list(cases.items()):
        for sampling in (None, dict(temperature=0.9, seed=rng.randrange(1 << 30), top_k=40)):
            want = reference_ids(baton_bin, test_model, q, 10, **(sampling or {}))
            kw = dict(prompt_token_ids=q, max_tokens=10, ignore_eos=True)
            if sampling:
                kw["sampling"] = sampling
            got_on, final_on, _ = generate(pb, on.address, **kw)
            got_off, final_off, _ = generate(pb, off.address, **kw)
            label = f"{name} ({lcp(p, q)} of {len(q)} shared, {'sampled' if sampling else 'greedy'})"
            assert got_on == want, label
            assert got_off == want, label
            assert final_on.timing.cached_prompt_tokens == expected_cached(cached_prompts, q), label
            assert final_off.timing.cached_prompt_tokens == 0, label
            cached_prompts.append(q)
    assert prefill_counter(on, "baton_prefix_cache_hit_tokens_total") > 0
    assert prefill_counter(off, "baton_prefix_cache_lookup_tokens_total") == 0
    assert wait_blocks_free(on, role="prefill") and wait_blocks_free(on)


def test_after_evictions_under_pressure_outputs_are_unchanged(pb, baton_bin, test_model, server_factory, rng):
    srv = server_factory(test_model, "--dtype", "f32", "--prefill-token-budget", "32", "--prefix-cache-blocks", "10")
    roots = [tokens(rng, 6 * BLOCK) for _ in range(3)]
    sent, hits = [], 0
    for i in range(14):
        if i % 4 == 3:
            q = rng.choice(sent)  # an earlier prompt again, its blocks perhaps evicted
        else:
            root = rng.choice(roots)
            q = diverge(rng, root, rng.randrange(0, len(root) + 1), rng.randrange(2 * BLOCK, 9 * BLOCK))
        sent.append(q)
        want = reference_ids(baton_bin, test_model, q, 8)
        got, final, _ = generate(pb, srv.address, prompt_token_ids=q, max_tokens=8, ignore_eos=True)
        assert got == want, f"prompt {i} of {len(q)} tokens, {final.timing.cached_prompt_tokens} cached"
        assert final.timing.cached_prompt_tokens % BLOCK == 0
        assert final.timing.cached_prompt_tokens <= (len(q) - 1) // BLOCK * BLOCK
        hits += final.timing.cached_prompt_tokens
    assert hits > 0
    assert prefill_counter(srv, "baton_prefix_cache_evicted_blocks_total") > 0
    assert prefill_counter(srv, "baton_prefix_cache_hit_tokens_total") == hits
    cached = sum(v for k, v in metric_values(srv.metrics(), "baton_prefix_cache_blocks").items())
    assert 0 < cached <= 10
    assert wait_blocks_free(srv, role="prefill")


def test_a_chat_reports_growing_cached_tokens_and_the_counters_agree(pb, test_model, server_factory, rng):
    srv = server_factory(test_model, "--dtype", "f32")
    history = tokens(rng, 70 + rng.randrange(0, 20))  # a system prompt
    previous, n_prompt, n_cached = None, 0, []
    for turn in range(5):
        history = history + tokens(rng, rng.randrange(5, 30))  # the user's message
        got, final, _ = generate(pb, srv.address, prompt_token_ids=history, max_tokens=12, ignore_eos=True)
        assert len(got) == 12
        want = expected_cached([previous] if previous else [], history)
        assert final.timing.cached_prompt_tokens == want, f"turn {turn + 1}"
        assert final.usage.prompt_tokens == len(history)
        n_cached.append(final.timing.cached_prompt_tokens)
        n_prompt += len(history)
        previous = history
        history = history + got  # the next turn resends the answer
    assert n_cached[0] == 0 and all(b > a for a, b in zip(n_cached, n_cached[1:])), n_cached
    assert prefill_counter(srv, "baton_prefix_cache_lookup_tokens_total") == n_prompt
    assert prefill_counter(srv, "baton_prefix_cache_hit_tokens_total") == sum(n_cached)
    assert prefill_counter(srv, "baton_prefix_cache_inserted_blocks_total") > 0
    assert wait_blocks_free(srv, role="prefill") and wait_blocks_free(srv)


@pytest.fixture(scope="module")
def slower_model(baton_bin, tmp_path_factory):
    """A deeper random model with a longer context: one-token prefill steps of a long prompt take
    long enough to cancel mid-prompt."""
    return make_test_model(baton_bin, tmp_path_factory.mktemp("slower") / "slower.gguf", seed=11, layers=6, dim=128,
                           heads=4, kv_heads=2, ffn=256, ctx=2048)


def test_cancelled_requests_hold_no_block_once_idle(pb, baton_bin, slower_model, server_factory, rng):
    srv = server_factory(slower_model, "--dtype", "f32", "--prefill-token-budget", "1")
    shared = tokens(rng, 3 * BLOCK)
    generate(pb, srv.address, prompt_token_ids=shared + tokens(rng, 5), max_tokens=2, ignore_eos=True)
    for _ in range(2):  # each holds the cached blocks of `shared` and computes a long part of its own
        long_prompt = shared + tokens(rng, 1500)
        steps = prefill_counter(srv, "baton_prefill_step_tokens_count")
        with grpc.insecure_channel(srv.address) as ch:
            call = pb.gen_grpc.GenerationStub(ch).Generate(
                pb.gen.GenerateRequest(prompt_token_ids=long_prompt, max_tokens=5, ignore_eos=True), timeout=0.1)
            with pytest.raises(grpc.RpcError) as e:
                list(call)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_blocks_free(srv, role="prefill"), "a cancelled prefill left blocks held"
        assert prefill_counter(srv, "baton_prefill_step_tokens_count") - steps < 1500  # cancelled mid-prompt
    assert wait_blocks_free(srv)
    # What a cancelled prefill cached is that prompt's own KV: the last one again, run to the end,
    # reuses it and equals the single-process output.
    got, final, _ = generate(pb, srv.address, prompt_token_ids=long_prompt, max_tokens=6, ignore_eos=True)
    assert got == reference_ids(baton_bin, slower_model, long_prompt, 6)
    assert final.timing.cached_prompt_tokens >= len(shared)
    assert wait_blocks_free(srv, role="prefill")


def test_two_prefill_workers_keep_a_repeated_prefix_on_the_worker_that_has_it(pb, baton_bin, slower_model,
                                                                            server_factory, rng):
    srv = server_factory(slower_model, "--dtype", "f32", "--prefill-workers", "2", "--prefill-token-budget", "1")
    # A long prompt occupies the first worker (both idle: the tie goes to the first address) ...
    long_one = Stream(pb, srv.address, tokens(rng, 1800), 2)
    time.sleep(0.05)
    # ... so the prefix's first prompt goes to the other, and every later one follows it there
    # (by queue alone, with both idle again, they would go back to the first).
    system = tokens(rng, 5 * BLOCK + rng.randrange(0, BLOCK))
    home = None
    for i in range(5):
        q = system + tokens(rng, rng.randrange(3, 40))
        got, final, _ = generate(pb, srv.address, prompt_token_ids=q, max_tokens=6, ignore_eos=True)
        if i == 0:  # checked before the reference runs: the long prompt takes about a second
            home = final.prefill_worker
            assert long_one.final is None, "the long prompt was done before the prefix arrived: nothing was tested"
            long_one.join()
            assert long_one.error is None and long_one.final.prefill_worker != home
        assert got == reference_ids(baton_bin, slower_model, q, 6)
        assert final.prefill_worker == home, f"request {i} left the worker holding its prefix"
        assert final.timing.cached_prompt_tokens == (0 if i == 0 else len(system) // BLOCK * BLOCK)
        time.sleep(0.3 * rng.random())  # load reports may come in between, or not
    hits = metric_values(srv.metrics(), "baton_prefix_cache_hit_tokens_total")
    by_worker = sorted(v for k, v in hits.items() if 'role="prefill"' in k)
    assert len(by_worker) == 2 and by_worker[0] == 0 and by_worker[1] == 4 * (len(system) // BLOCK * BLOCK)
    assert wait_blocks_free(srv, role="prefill")


def test_openai_usage_reports_cached_tokens(baton_bin, test_model, server_factory):
    """The HTTP API's usage carries the cached prompt tokens as OpenAI does
    (usage.prompt_tokens_details.cached_tokens)."""
    import json
    import urllib.request

    srv = server_factory(test_model, "--dtype", "f32", "--http-listen", "127.0.0.1:0")
    prompt = list(range(3, 3 + 70))  # four whole blocks of 16, then 6 tokens

    def usage():
        body = json.dumps({"model": "test", "prompt": prompt, "max_tokens": 3}).encode()
        req = urllib.request.Request(srv.http_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.load(r)["usage"]

    assert usage()["prompt_tokens_details"]["cached_tokens"] == 0
    again = usage()
    assert again["prompt_tokens"] == 70
    assert again["prompt_tokens_details"]["cached_tokens"] == 64
