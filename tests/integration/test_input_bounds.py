"""Bounded input on the public API: a request message over --max-message-bytes (default 4 MiB) is
refused by gRPC before it is parsed (RESOURCE_EXHAUSTED); prompt text longer than the context
could hold is refused before it is tokenised (INVALID_ARGUMENT naming its size), at once; a
client string the refusal quotes (model, a message's role) is cut short in the status and in the
log, whatever its size under the message limit; the server keeps serving."""

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
