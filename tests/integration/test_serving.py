"""Disaggregated serving over real processes on loopback (frontend → prefill → tcp KV → decode),
on the random test model: outputs equal single-process `baton generate`, cancellation and
deadlines free the KV blocks, overload is refused quickly, bad fields are named, /metrics is
valid Prometheus text whose counts match the requests sent."""

import concurrent.futures
import os
import random
import re
import subprocess
import threading
import time

import grpc
import pytest

from serving_harness import metric_values, wait_blocks_free


def reference_ids(baton_bin, model, prompt_ids, max_tokens, temperature=0.0, seed=0, top_k=0, top_p=1.0):
    out = subprocess.run(
        [str(baton_bin), "generate", "--model", str(model), "--prompt-ids", ",".join(map(str, prompt_ids)),
         "--max-tokens", str(max_tokens), "--print-ids", "--ignore-eos", "--dtype", "f32",
         "--temperature", str(temperature), "--seed", str(seed), "--top-k", str(top_k), "--top-p", str(top_p)],
        check=True, capture_output=True, text=True, timeout=120)
    return [int(x) for x in out.stdout.strip().split(",") if x]


def generate(pb, address, timeout=120, metadata=None, **fields):
    sampling = fields.pop("sampling", None)
    req = pb.gen.GenerateRequest(**fields)
    if sampling:
        req.sampling.CopyFrom(pb.gen.SamplingParams(**sampling))
    with grpc.insecure_channel(address) as ch:
        stub = pb.gen_grpc.GenerationStub(ch)
        msgs = list(stub.Generate(req, timeout=timeout, metadata=metadata))
    ids = [t for m in msgs for t in m.token_ids]
    final = msgs[-1].final if msgs and msgs[-1].HasField("final") else None
    return ids, final, msgs


@pytest.fixture(scope="module")
def rng():
    seed = random.randrange(1 << 30)
    print(f"random seed {seed}")
    return random.Random(seed)


def test_disaggregated_equals_single_process(pb, baton_bin, test_model, server_factory, rng):
    # A small prefill budget makes the longer prompts chunk across steps.
    srv = server_factory(test_model, "--dtype", "f32", "--prefill-token-budget", "48")
    cases = [[rng.randrange(3, 275) for _ in range(n)] for n in (5, 40, 130, 300)]
    for prompt in cases:
        want = reference_ids(baton_bin, test_model, prompt, 12)
        got, final, _ = generate(pb, srv.address, prompt_token_ids=prompt, max_tokens=12, ignore_eos=True)
        assert got == want, f"prompt of {len(prompt)} tokens"
        assert final.usage.prompt_tokens == len(prompt)
        assert final.usage.completion_tokens == 12
        assert final.finish_reason == pb.gen.FINISH_REASON_LENGTH
    # Seeded sampling continues the same random stream across the prefill → decode hand-off.
    prompt = cases[1]
    want = reference_ids(baton_bin, test_model, prompt, 16, temperature=0.9, seed=42, top_k=50, top_p=0.95)
    got, _, _ = generate(pb, srv.address, prompt_token_ids=prompt, max_tokens=16, ignore_eos=True,
                         sampling=dict(temperature=0.9, seed=42, top_k=50, top_p=0.95))
    assert got == want


def prefill_step_histogram(srv):
    """(steps, tokens, {le: cumulative steps}) of baton_prefill_step_tokens, summed over workers."""
    text = srv.metrics()
    steps = sum(metric_values(text, "baton_prefill_step_tokens_count").values())
    tokens = sum(metric_values(text, "baton_prefill_step_tokens_sum").values())
    buckets = {}
    for labels, v in metric_values(text, "baton_prefill_step_tokens_bucket").items():
        le = labels.rsplit('le="', 1)[1].split('"', 1)[0]
        buckets[float(le)] = buckets.get(float(le), 0) + v
    return steps, tokens, buckets


def test_sixteen_concurrent_requests_batch_together(pb, baton_bin, test_model, server_factory, rng):
    """16 requests released together (every channel connected first, then a barrier) share
    prefill steps, and each one's output equals single-process `baton generate`.

    The proof of sharing is baton_prefill_step_tokens: its sum grows by exactly the prompts' tokens
    (nothing else runs on this server), and its count grows by fewer than 16. Each prompt lands in
    at least one step and a step holds at most one slice of a given prompt, so fewer steps than
    prompts means some step carried tokens of two or more prompts (pigeonhole; chunking cannot fake
    it). Its buckets also show a step longer than the longest prompt, which no prompt fills alone.
    Were each request prefilled alone, the count would grow by 16 and no step would pass the
    longest prompt. Arrivals are never exactly simultaneous, so the number of steps varies (2-3
    seen on 2 cores); the margin to 16 is wide."""
    srv = server_factory(test_model, "--dtype", "f32")
    prompts = [[rng.randrange(3, 275) for _ in range(rng.randrange(3, 60))] for _ in range(16)]
    wants = [reference_ids(baton_bin, test_model, p, 10) for p in prompts]
    steps0, tokens0, buckets0 = prefill_step_histogram(srv)  # all zero unless a start-up step ran
    released = threading.Barrier(len(prompts))

    def one(prompt):
        with grpc.insecure_channel(srv.address) as ch:
            grpc.channel_ready_future(ch).result(timeout=60)
            released.wait(timeout=60)
            msgs = pb.gen_grpc.GenerationStub(ch).Generate(
                pb.gen.GenerateRequest(prompt_token_ids=prompt, max_tokens=10, ignore_eos=True), timeout=120)
            return [t for m in msgs for t in m.token_ids]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        gots = list(pool.map(one, prompts))
    assert gots == wants

    steps1, tokens1, buckets1 = prefill_step_histogram(srv)
    steps, tokens = steps1 - steps0, tokens1 - tokens0
    buckets = {le: n - buckets0.get(le, 0) for le, n in buckets1.items()}
    longest = max(len(p) for p in prompts)
    print(f"16 prompts of {sorted(len(p) for p in prompts)} tokens: {steps:.0f} prefill steps, buckets {buckets}")
    assert tokens == sum(len(p) for p in prompts), "every prompt token is prefilled exactly once"
    assert steps < len(prompts), f"{steps:.0f} prefill steps for {len(prompts)} prompts: no step was shared"
    # The smallest bucket bound >= the longest prompt: steps above it held more than any one prompt.
    bound = min(le for le in buckets if le >= longest)
    assert buckets[bound] < steps, f"no prefill step had more than {bound:.0f} >= {longest} (longest prompt) tokens"


def test_cancel_mid_stream_frees_blocks(pb, test_model, server_factory):
    srv = server_factory(test_model)
    with grpc.insecure_channel(srv.address) as ch:
        stub = pb.gen_grpc.GenerationStub(ch)
        call = stub.Generate(pb.gen.GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=900, ignore_eos=True))
        got = 0
        for msg in call:
            got += len(msg.token_ids)
            if got >= 5:
                call.cancel()
                break
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
        assert err.value.code() == grpc.StatusCode.CANCELLED
    assert wait_blocks_free(srv), "decode KV blocks did not return to the total after a cancel"


def test_deadline_exceeded_frees_blocks(pb, test_model, server_factory):
    srv = server_factory(test_model)
    # A deadline a third of what 1000 tokens take on this machine (0.5 s on a slow core, 0.1 s on a
    # fast one) passes mid-stream.
    t0 = time.monotonic()
    ids, _, _ = generate(pb, srv.address, prompt_token_ids=[5, 6, 7], max_tokens=1000, ignore_eos=True)
    assert len(ids) == 1000
    deadline = (time.monotonic() - t0) / 3
    with pytest.raises(grpc.RpcError) as err:
        generate(pb, srv.address, timeout=deadline, prompt_token_ids=[5, 6, 7], max_tokens=1000, ignore_eos=True)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_blocks_free(srv), "decode KV blocks did not return to the total after a deadline"


def test_overload_is_refused_quickly(pb, test_model, server_factory):
    srv = server_factory(test_model, "--max-requests", "3")

    def one():
        t0 = time.time()
        try:
            ids, _, _ = generate(pb, srv.address, prompt_token_ids=[9, 10, 11], max_tokens=800, ignore_eos=True)
            return "ok", time.time() - t0, len(ids)
        except grpc.RpcError as e:
            return e.code(), time.time() - t0, 0

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda _: one(), range(12)))
    refused = [r for r in results if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    done = [r for r in results if r[0] == "ok"]
    assert refused, f"no request was refused: {results}"
    assert done, f"no request completed: {results}"
    assert len(refused) + len(done) == len(results), results
    assert all(n == 800 for _, _, n in done)
    assert max(t for _, t, _ in refused) < 2.0, "refusals must come at once"


@pytest.mark.parametrize("fields,name", [
    (dict(max_tokens=5), "prompt"),
    (dict(prompt="hi", prompt_token_ids=[1, 2], max_tokens=5), "only one"),
    (dict(prompt_token_ids=[1, 100000], max_tokens=5), "prompt_token_ids[1]"),
    (dict(prompt="hello", max_tokens=0), "max_tokens"),
    (dict(prompt="hello", max_tokens=5000), "max_tokens"),
    (dict(prompt="hello", max_tokens=5, sampling=dict(temperature=-1)), "temperature"),
    (dict(prompt="hello", max_tokens=5, sampling=dict(top_p=0.0)), "top_p"),
    (dict(prompt="hello", max_tokens=5, sampling=dict(top_p=1.5)), "top_p"),
    (dict(prompt="hello", max_tokens=5, messages=[dict(role="user", content="x")]), "only one"),
])
def test_bad_fields_are_named(pb, shared_server, fields, name):
    srv = shared_server
    msgs = fields.pop("messages", None)
    if msgs:
        fields["messages"] = [pb.gen.ChatMessage(**m) for m in msgs]
    with pytest.raises(grpc.RpcError) as err:
        generate(pb, srv.address, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert name in err.value.details()


def test_unknown_model_is_refused(pb, shared_server):
    srv = shared_server
    with pytest.raises(grpc.RpcError) as err:
        generate(pb, srv.address, model="no-such-model", prompt="hi", max_tokens=3)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model" in err.value.details()
    with grpc.insecure_channel(srv.address) as ch:
        models = pb.gen_grpc.GenerationStub(ch).ListModels(pb.gen.ListModelsRequest()).models
    assert len(models) == 1 and models[0].vocab_size == 275 and models[0].context_length == 1024


def test_metrics_are_valid_and_count_requests(pb, test_model, server_factory, tmp_path):
    srv = server_factory(test_model, "--kv-dtype", "f32")  # the byte count below is of f32 KV
    n = 5
    for i in range(n):
        generate(pb, srv.address, prompt_token_ids=[7 + i, 8, 9], max_tokens=4, ignore_eos=True)
    with pytest.raises(grpc.RpcError):
        generate(pb, srv.address, prompt="", max_tokens=4)
    text = srv.metrics()
    path = tmp_path / "metrics.txt"
    path.write_text(text)
    check = subprocess.run(["promtool", "check", "metrics"], stdin=open(path), capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    ttft = metric_values(text, "baton_time_to_first_token_seconds_count")
    e2e = metric_values(text, "baton_request_e2e_seconds_count")
    prefill = metric_values(text, "baton_request_prefill_seconds_count")
    transfer = metric_values(text, "baton_kv_transfer_seconds_count")
    assert sum(ttft.values()) == n
    assert sum(e2e.values()) == n
    assert sum(prefill.values()) == n
    assert sum(transfer.values()) == n
    assert all('src="' in k and 'dst="' in k and 'transport="tcp"' in k for k in transfer), transfer
    # Bytes per link: K and V (f32) of the test model's 2 layers × 2 kv heads × 16 dims for the 3
    # prompt tokens of each request.
    sent = metric_values(text, "baton_kv_transfer_bytes_total")
    assert set(sent) == set(transfer), (sent, transfer)
    assert sum(sent.values()) == n * 3 * 2 * 2 * 16 * 4 * 2
    codes = metric_values(text, "baton_requests_total")
    assert codes.get('{code="OK"}') == n
    assert codes.get('{code="INVALID_ARGUMENT"}') == 1
    assert sum(metric_values(text, "baton_generation_tokens_total").values()) == 4 * n


def test_timing_breakdown_is_consistent(pb, shared_server):
    srv = shared_server
    _, final, msgs = generate(pb, srv.address, prompt_token_ids=list(range(3, 100)), max_tokens=8, ignore_eos=True)
    t = final.timing
    assert t.ttft_seconds >= t.queue_seconds + t.prefill_seconds - 1e-6
    assert t.e2e_seconds >= t.ttft_seconds
    assert t.prefill_seconds > 0 and t.kv_transfer_seconds > 0
    # Workers are named by label, never by address: the topology is not for public clients.
    assert re.fullmatch(r"prefill-[0-9a-f]{8}", final.prefill_worker), final.prefill_worker
    assert re.fullmatch(r"decode-[0-9a-f]{8}", final.decode_worker), final.decode_worker
    assert len(msgs[0].token_ids) == 1  # the first token comes alone, straight from the prefill worker


def test_worker_with_another_model_is_refused_at_kv_handoff(pb, baton_bin, test_model, tmp_path, server_factory):
    other = tmp_path / "other.gguf"  # same shapes, other weights: another fingerprint
    subprocess.run([str(baton_bin), "tools", "make-test-model", "--out", str(other), "--seed", "99", "--layers", "2",
                    "--dim", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--ctx", "1024"], check=True)
    decode = server_factory(other, subcommand=("serve", "--role", "decode"))
    prefill = server_factory(test_model, subcommand=("serve", "--role", "prefill"))
    # Admit on the decode worker as a frontend serving `other` would...
    with grpc.insecure_channel(decode.address) as ch:
        d = pb.worker_grpc.DecodeWorkerStub(ch)
        fingerprint = d.GetLoad(pb.worker.LoadRequest()).model_fingerprint
        d.Admit(pb.worker.AdmitRequest(request_id="mismatch", n_prompt_tokens=5, max_tokens=4,
                                       model_fingerprint=fingerprint))
    # ...then a prefill worker serving the test model hands it its KV: refused by fingerprint.
    with grpc.insecure_channel(prefill.address) as ch:
        events = pb.worker_grpc.PrefillWorkerStub(ch).Prefill(
            pb.worker.PrefillRequest(request_id="mismatch", prompt_token_ids=[5, 6, 7, 8, 9],
                                     decode_address=decode.address), timeout=60)
        got_first = False
        with pytest.raises(grpc.RpcError) as err:
            for ev in events:
                got_first = got_first or ev.HasField("first_token")
    assert got_first, "the first token comes before the hand-off"
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    assert "fingerprint" in err.value.details()


def test_clients_may_reuse_request_ids(pb, shared_server):
    # Workers key requests by an id the frontend makes unique; the client's id is only echoed.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(generate, pb, shared_server.address, request_id="same-id", prompt_token_ids=[5 + i, 6],
                            max_tokens=20, ignore_eos=True) for i in range(4)]
        results = [f.result() for f in futs]
    for ids, final, msgs in results:
        assert len(ids) == 20
        assert all(m.request_id == "same-id" for m in msgs)


def _thread_nice(pid):
    """{thread id: niceness} of every thread of process `pid` (/proc/PID/task/TID/stat field 19)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended
            continue
        out[int(tid)] = int(fields[16])  # field 19 overall; fields[0] is field 3 (state)
    return out


def test_prefill_engine_runs_at_its_niceness_and_nothing_else_does(pb, test_model, server_factory, rng):
    """`baton local` lowers only the prefill engine's step threads (--prefill-nice), so that the gRPC,
    KV sender and frontend threads on its cores preempt it; the decode engine and the rest stay at 0."""
    nice = rng.randrange(1, 20)
    srv = server_factory(test_model, "--prefill-nice", nice)
    ids, final, _ = generate(pb, srv.address, prompt_token_ids=[1, 2, 3, 4, 5], max_tokens=4, ignore_eos=True)
    assert len(ids) == 4 and final is not None
    seen = _thread_nice(srv.proc.pid)
    assert sorted(set(seen.values())) == [0, nice], seen
    # One prefill engine on one core of two (or sharing one): its step thread is its whole team.
    assert 1 <= sum(v == nice for v in seen.values()) <= os.cpu_count(), seen

    plain = server_factory(test_model, "--prefill-nice", 0)
    ids, _, _ = generate(pb, plain.address, prompt_token_ids=[1, 2, 3, 4, 5], max_tokens=4, ignore_eos=True)
    assert len(ids) == 4
    assert set(_thread_nice(plain.proc.pid).values()) == {0}
