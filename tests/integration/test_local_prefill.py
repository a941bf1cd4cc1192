"""Local prefill over real processes: a decode worker prefills short prompts itself
(--local-prefill-max-tokens), beside a prefill worker that takes the longer ones, and with no
prefill worker at all (colocated). Either way the output equals single-process `baton generate`,
the first token comes from the decode worker's stream, and blocks are freed."""

import random
import threading
import time

import grpc
import pytest

from serving_harness import kv_blocks_of, metric_values, wait_blocks_free
from test_serving import generate, reference_ids


@pytest.fixture(scope="module")
def rng():
    seed = random.randrange(1 << 30)
    print(f"random seed {seed}")
    return random.Random(seed)


def prefill_steps(srv):
    return sum(metric_values(srv.metrics(), "baton_prefill_step_tokens_count").values())


def test_short_prompts_are_prefilled_by_the_decode_worker_long_ones_by_the_prefill_worker(
        pb, baton_bin, test_model, server_factory, rng):
    srv = server_factory(test_model, "--dtype", "f32", "--local-prefill-max-tokens", "64",
                         "--local-prefill-token-budget", "16")
    for n, local in ((5, True), (64, True), (65, False), (200, False)):
        prompt = [rng.randrange(3, 275) for _ in range(n)]
        want = reference_ids(baton_bin, test_model, prompt, 10)
        steps = prefill_steps(srv)
        got, final, msgs = generate(pb, srv.address, prompt_token_ids=prompt, max_tokens=10, ignore_eos=True)
        assert got == want, f"prompt of {n} tokens"
        # Local: no prefill worker step, no prefill worker named; otherwise the prefill worker ran it.
        assert (final.prefill_worker == "") == local, final
        assert (prefill_steps(srv) == steps) == local
        assert final.timing.prefill_seconds > 0
        assert final.timing.ttft_seconds >= final.timing.queue_seconds + final.timing.prefill_seconds - 1e-6
    # Seeded sampling draws the first token where a prefill worker would.
    prompt = [rng.randrange(3, 275) for _ in range(30)]
    want = reference_ids(baton_bin, test_model, prompt, 16, temperature=0.9, seed=7, top_k=40, top_p=0.9)
    got, final, _ = generate(pb, srv.address, prompt_token_ids=prompt, max_tokens=16, ignore_eos=True,
                             sampling=dict(temperature=0.9, seed=7, top_k=40, top_p=0.9))
    assert got == want
    assert final.prefill_worker == ""
    assert wait_blocks_free(srv)


def test_colocated_without_prefill_workers(pb, baton_bin, test_model, server_factory, rng):
    srv = server_factory(test_model, "--dtype", "f32", "--prefill-workers", "0",
                         "--local-prefill-max-tokens", "100000", "--local-prefill-token-budget", "32")
    prompts = [[rng.randrange(3, 275) for _ in range(n)] for n in (3, 50, 300)]
    wants = [reference_ids(baton_bin, test_model, p, 12) for p in prompts]
    results = [None] * len(prompts)

    def run(i):
        results[i] = generate(pb, srv.address, prompt_token_ids=prompts[i], max_tokens=12, ignore_eos=True)

    # Concurrently: the long prompt's chunks share decode steps with the others' tokens.
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (got, final, _), want, p in zip(results, wants, prompts):
        assert got == want, f"prompt of {len(p)} tokens"
        assert final.prefill_worker == ""
    assert wait_blocks_free(srv)


def test_a_request_cancelled_mid_prefill_frees_its_blocks(pb, test_model, server_factory, rng):
    # One prompt token per decode step: a 1,000-token prompt takes a thousand steps, and its first
    # token comes only after the last. The client cancels once the decode worker holds the
    # request's blocks (admitted, prefilling) — not after a fixed time, which a faster step outruns.
    srv = server_factory(test_model, "--prefill-workers", "0", "--local-prefill-max-tokens", "100000",
                         "--local-prefill-token-budget", "1")
    total = kv_blocks_of(metric_values(srv.metrics(), "baton_kv_blocks_capacity"), "decode")
    with grpc.insecure_channel(srv.address) as ch:
        stub = pb.gen_grpc.GenerationStub(ch)
        call = stub.Generate(pb.gen.GenerateRequest(prompt_token_ids=[rng.randrange(3, 275) for _ in range(1000)],
                                                    max_tokens=20, ignore_eos=True), timeout=60)
        received = []
        reader = threading.Thread(target=lambda: received.extend(ev for ev in _events(call)))
        reader.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            free = kv_blocks_of(metric_values(srv.metrics(), "baton_kv_blocks_free"), "decode")
            if free and free != total:
                break
            time.sleep(0.005)
        call.cancel()
        reader.join(timeout=30)
        assert not reader.is_alive()
        assert call.code() == grpc.StatusCode.CANCELLED
        assert not any(ev.token_ids for ev in received), "the prompt was prefilled before the cancel: nothing was tested"
    assert wait_blocks_free(srv)
    # The worker goes on serving.
    got, final, _ = generate(pb, srv.address, prompt_token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
    assert len(got) == 4


def _events(call):
    """The events of a streaming call until it ends, however it ends."""
    try:
        yield from call
    except grpc.RpcError:
        return


def test_prefill_workers_zero_needs_local_prefill(baton_bin, test_model):
    import subprocess
    r = subprocess.run([str(baton_bin), "local", "--model", str(test_model), "--listen", "127.0.0.1:0",
                        "--prefill-workers", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--local-prefill-max-tokens" in r.stderr
