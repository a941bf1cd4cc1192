"""Bounded input on the public API: a request message over --max-message-bytes (default 4 MiB) is
refused by gRPC before it is parsed (RESOURCE_EXHAUSTED); prompt text longer than the context
could hold is refused before it is tokenised (INVALID_ARGUMENT naming its size), at once; a
client string the refusal quotes (model, a message's role) is cut short in the status and in the
log, whatever its size under the message limit; four big prompts at once do not disturb another
request; the server keeps serving."""

import threading
import time

import grpc
import pytest

from serving_harness import Server
from test_serving import generate


def call(pb, address, **fields):
    try:
        generate(pb, address, timeout=60, **fields)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()


def test_a_message_over_the_limit_is_refused_before_parsing(pb, shared_server):
    code, details = call(pb, shared_server.address, prompt="a" * (5 << 20), max_tokens=1)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert call(pb, shared_server.address, prompt_token_ids=[5, 6, 7], max_tokens=2, ignore_eos=True)[0] == \
        grpc.StatusCode.OK


def test_prompt_text_longer_than_the_context_can_hold_is_refused_before_tokenising(pb, shared_server):
    # Under the message limit, far over what 1024 tokens of the test model's vocabulary can spell.
    for fields in (dict(prompt="x" * (3 << 20)),
                   dict(messages=[pb.gen.ChatMessage(role="user", content="y" * (3 << 20))])):
        t0 = time.monotonic()
        code, details = call(pb, shared_server.address, max_tokens=1, **fields)
        took = time.monotonic() - t0
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert "bytes" in details and "context" in details, details
        assert len(details) < 300, "the refusal must not echo the prompt"
        # Tokenising 3 MB of text takes about a second on this machine; the refusal does not.
        assert took < 0.5, f"refused after {took:.2f} s"


def test_max_message_bytes_flag(pb, test_model, server_factory):
    srv = server_factory(test_model, "--max-message-bytes", "65536")
    code, details = call(pb, srv.address, prompt="z" * 100_000, max_tokens=1)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert call(pb, srv.address, prompt="z" * 1000, max_tokens=1)[0] == grpc.StatusCode.OK


MIB = 1 << 20


@pytest.fixture(scope="module")
def logging_server(baton_bin, test_model):
    """`baton local` logging everything (debug), so that what it writes about a request is seen."""
    s = Server(baton_bin, test_model, "--log-level", "debug")
    yield s
    s.stop_clean()


@pytest.mark.parametrize("case", ["model 15000 ASCII", "model 8000 two-byte", "role 15000", "model 4 MiB - 4 KiB"])
def test_an_echoed_field_is_cut_short_in_the_status_and_the_log(pb, logging_server, case):
    """The refusal quotes the field (quote_input): at most 64 characters of it, escapes included,
    and its length. Whole, a 15 KB name made a status over the 16 KiB metadata limit once
    percent-encoded, which the client sees as RESOURCE_EXHAUSTED instead of the refusal."""
    fields = {
        "model 15000 ASCII": dict(model="m" * 15000, prompt="hi"),
        "model 8000 two-byte": dict(model="\u00e9" * 8000, prompt="hi"),
        "role 15000": dict(messages=[pb.gen.ChatMessage(role="r" * 15000, content="hi")]),
        "model 4 MiB - 4 KiB": dict(model="m" * (4 * MIB - 4096), prompt="hi"),
    }[case]
    n_bytes = len((fields.get("model") or fields["messages"][0].role).encode())
    mark = logging_server.log_mark()
    code, details = call(pb, logging_server.address, max_tokens=1, **fields)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details[:300])
    assert len(details.encode()) < 300, details
    assert f"(cut, {n_bytes} bytes)" in details, details
    # The refusal is logged (at info), as short as the status; nothing else logged is long.
    logging_server.wait_for_log("refused", mark)
    logged = logging_server.log_since(mark)
    assert max(len(line) for line in logged) < 2048, max(logged, key=len)[:300]
    assert call(pb, logging_server.address, prompt_token_ids=[5, 6, 7], max_tokens=2, ignore_eos=True)[0] == \
        grpc.StatusCode.OK


def test_four_big_prompts_do_not_disturb_another_request(pb, shared_server):
    """Four clients send prompts just under the 4 MiB message limit (text, chat, two-byte text, token
    ids), again and again, while a victim request streams. Each is refused before it is tokenised
    (longer than the context can hold); the victim's tokens are those of an unloaded run and it
    takes less than 3x its unloaded time + 1 s. A robustness bound, not a speed target: the big
    prompts may cost the victim some CPU, not its output or an unbounded delay."""
    victim = dict(prompt_token_ids=[5, 17, 99, 3, 250, 41, 7, 12], max_tokens=200, ignore_eos=True)
    unloaded = []
    for _ in range(3):
        t0 = time.monotonic()
        ids, final, _ = generate(pb, shared_server.address, **victim)
        unloaded.append(time.monotonic() - t0)
        assert final is not None and len(ids) == 200
    want = ids
    unloaded_s = sorted(unloaded)[1]

    size = 4 * MIB - 4096
    G = pb.gen
    big = [G.GenerateRequest(prompt="x" * size, max_tokens=1),
           G.GenerateRequest(messages=[G.ChatMessage(role="user", content="y" * size)], max_tokens=1),
           G.GenerateRequest(prompt="\u00e9" * (size // 2), max_tokens=1),
           G.GenerateRequest(prompt_token_ids=[7] * size, max_tokens=1)]
    # Serialised once: the clients' Python costs next to nothing while they send.
    raw = [r.SerializeToString() for r in big]
    assert all(len(r) < 4 * MIB for r in raw)
    done = threading.Event()
    started = [threading.Event() for _ in raw]
    results = [[] for _ in raw]

    def flood(i):
        with grpc.insecure_channel(shared_server.address) as ch:
            send = ch.unary_stream("/baton.v1.Generation/Generate", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
            while True:
                started[i].set()
                t0 = time.monotonic()
                try:
                    list(send(raw[i], timeout=60))
                    code, details = grpc.StatusCode.OK, ""
                except grpc.RpcError as e:
                    code, details = e.code(), e.details()
                results[i].append((code, details[:200], time.monotonic() - t0))
                if done.is_set():
                    return

    threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(len(raw))]
    for t in threads:
        t.start()
    for e in started:  # every flood is sending when the victim starts; they go on until it ends
        assert e.wait(timeout=30)
    t0 = time.monotonic()
    ids, final, _ = generate(pb, shared_server.address, **victim)
    loaded_s = time.monotonic() - t0
    done.set()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive()
    assert final is not None and ids == want
    for i, r in enumerate(results):
        assert r, f"big prompt {i} was never sent"
        for code, details, took in r:
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (i, code, details)
            assert "context" in details, details
    print(f"victim: {unloaded_s:.3f} s unloaded, {loaded_s:.3f} s next to {sum(map(len, results))} big prompts")
    assert loaded_s < 3 * unloaded_s + 1.0, (loaded_s, unloaded_s)
