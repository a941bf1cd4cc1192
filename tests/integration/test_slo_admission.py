"""Admission to a TTFT target through a real `baton local`: a request predicted to miss it is refused
at once, RESOURCE_EXHAUSTED with a retry-after trailer over gRPC and 429 with Retry-After over HTTP,
naming the side that would make it late; the refusals are counted by reason, the predictions are
measured against the TTFTs seen, and a request's own target applies without the server's."""

import grpc
import httpx2
import pytest

from serving_harness import HTTP, TEST_MODEL, metric_values
from test_serving import generate


def _prompt(rng, n):
    return [rng.randrange(3, 250) for _ in range(n)]


def _refused_over_grpc(pb, srv, rng, **fields):
    with pytest.raises(grpc.RpcError) as err:
        generate(pb, srv.address, prompt_token_ids=_prompt(rng, 400), max_tokens=4, **fields)
    e = err.value
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
    trailers = dict(e.trailing_metadata() or ())
    assert int(trailers["retry-after"]) >= 1
    return e.details()


def test_a_request_predicted_late_is_refused_with_the_side_and_a_retry_after(pb, test_model, server_factory, rng):
    srv = server_factory(test_model, *HTTP, "--ttft-slo", "0.000001")
    # Nothing measured yet: nothing to predict by, so the first is served (and measures the rate).
    ids, _, _ = generate(pb, srv.address, prompt_token_ids=_prompt(rng, 400), max_tokens=4, ignore_eos=True)
    assert len(ids) == 4
    details = _refused_over_grpc(pb, srv, rng)
    assert "misses the TTFT target of 1e-06 s on every placement; prefill queue:" in details
    assert "tokens/s" in details and "retry after" in details

    r = httpx2.post(f"{srv.http_url}/v1/completions",
                    json={"model": TEST_MODEL, "prompt": _prompt(rng, 400), "max_tokens": 4}, timeout=60)
    assert r.status_code == 429, r.text
    assert int(r.headers["Retry-After"]) >= 1
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error"
    assert "prefill queue" in err["message"]

    rejected = metric_values(srv.metrics(), "baton_slo_rejections_total")
    assert rejected == {'{reason="prefill_queue"}': 2.0, '{reason="decode_kv"}': 0.0}  # both from the start


def test_the_requests_own_target_applies_and_is_validated(pb, test_model, server_factory, rng):
    srv = server_factory(test_model, *HTTP)  # no --ttft-slo: only a request's own target refuses
    for _ in range(3):
        ids, _, _ = generate(pb, srv.address, prompt_token_ids=_prompt(rng, 400), max_tokens=2, ignore_eos=True)
        assert len(ids) == 2
    details = _refused_over_grpc(pb, srv, rng, ttft_slo_seconds=1e-6)
    assert "prefill queue" in details
    # A loose target is met: served, and its prediction is measured against what it saw.
    ids, _, _ = generate(pb, srv.address, prompt_token_ids=_prompt(rng, 400), max_tokens=2, ignore_eos=True,
                         ttft_slo_seconds=3600)
    assert len(ids) == 2
    text = srv.metrics()
    predicted = metric_values(text, "baton_ttft_predicted_seconds_count")
    errors = metric_values(text, "baton_ttft_prediction_error_ratio_count")
    assert sum(predicted.values()) >= 3 and sum(errors.values()) >= 3

    for bad in (-1, 3601, float("nan")):
        with pytest.raises(grpc.RpcError) as e:
            generate(pb, srv.address, prompt_token_ids=[5, 6], max_tokens=2, ttft_slo_seconds=bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ttft_slo_seconds must be a number of seconds in [0, 3600]" in e.value.details()
    r = httpx2.post(f"{srv.http_url}/v1/completions",
                    json={"model": TEST_MODEL, "prompt": [5, 6], "max_tokens": 2, "ttft_slo_seconds": "soon"},
                    timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ttft_slo_seconds"
    r = httpx2.post(f"{srv.http_url}/v1/completions",
                    json={"model": TEST_MODEL, "prompt": _prompt(rng, 400), "max_tokens": 2,
                          "ttft_slo_seconds": 1e-6}, timeout=30)
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
