"""Bounded input on the public API: a request message over --max-message-bytes (default 4 MiB) is
refused by gRPC before it is parsed (RESOURCE_EXHAUSTED); prompt text longer than the context
could hold is refused before it is tokenised (INVALID_ARGUMENT naming its size), at once; the
server keeps serving."""

import time

import grpc
import pytest

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
