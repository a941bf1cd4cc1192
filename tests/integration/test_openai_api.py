"""The OpenAI-compatible HTTP API (--http-listen) over real `baton` processes, with the official
`openai` Python client (PyPI) as the client:
- completions and chat completions, streamed (SSE) and whole, give the same greedy text as
  single-process `baton generate` (the random test model; SmolLM2 for chat), seeded sampling the
  same seeded text; stop strings cut the text where `baton generate`'s output first holds them;
- stream_options.include_usage adds a usage chunk; the timing breakdown rides on the last chunk
  and, for whole responses, in the body and X-Baton-* headers;
- errors come in OpenAI's shape with their HTTP code: bad JSON, wrong types (the field named),
  n > 1, an unknown model (404), no workers (503), the drain (503 with the reason; open streams
  finish);
- the HTTP API counts in the same metrics as gRPC.
HTTPS, API keys and the secure default are in test_openai_security.py; connection and request
limits, clients that leave and 200 concurrent streams in test_openai_limits.py. The JSON
conversions themselves are unit-tested in tests/unit/server/openai_json_test.cpp."""

import re
import signal
import threading
import time

import grpc
import httpx2
import openai
import pytest

from serving_harness import (HTTP, TEST_MODEL, Server, client, free_port, metric_values, random_ids, real_model_path,
                             reference_text, streamed_text)


@pytest.fixture(scope="module")
def api(baton_bin, test_model):
    """One `baton local` with the HTTP API on the test model, in the exact mode (f32)."""
    s = Server(baton_bin, test_model, "--dtype", "f32", *HTTP)
    yield s
    s.stop_clean()


def check_timing(baton):
    """The "baton" extension: a consistent timing breakdown and the workers that served."""
    t = baton["timing"]
    for name in ("queue_seconds", "prefill_seconds", "kv_transfer_seconds", "ttft_seconds", "e2e_seconds"):
        assert t[name] >= 0, (name, t)
    assert t["prefill_seconds"] > 0 and t["ttft_seconds"] > 0
    assert t["ttft_seconds"] >= t["queue_seconds"] + t["prefill_seconds"] - 1e-6, t
    assert t["e2e_seconds"] >= t["ttft_seconds"], t
    # Labels, not addresses (no host, no port reaches a public client).
    assert re.fullmatch(r"prefill-[0-9a-f]{8}", baton["prefill_worker"]), baton
    assert re.fullmatch(r"decode-[0-9a-f]{8}", baton["decode_worker"]), baton


# ---- the same text as `baton generate` ----------------------------------------------------------

def test_completions_whole_and_streamed_equal_baton_generate(baton_bin, test_model, api, rng):
    c = client(api)
    for n in (3, 40, 200):
        prompt = random_ids(rng, n)
        want = reference_text(baton_bin, test_model, 24, prompt_ids=prompt)
        raw = c.completions.with_raw_response.create(model=TEST_MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                     extra_body={"ignore_eos": True})
        r = raw.parse()
        assert r.object == "text_completion" and r.model == TEST_MODEL
        assert r.choices[0].text == want, f"prompt of {n} tokens"
        assert r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n, 24, n + 24)
        baton = r.model_extra["baton"]
        check_timing(baton)
        # The same breakdown in the headers, to the microsecond they carry.
        for header, key in (("x-baton-queue-seconds", "queue_seconds"), ("x-baton-prefill-seconds", "prefill_seconds"),
                            ("x-baton-kv-transfer-seconds", "kv_transfer_seconds"),
                            ("x-baton-ttft-seconds", "ttft_seconds"), ("x-baton-e2e-seconds", "e2e_seconds")):
            assert abs(float(raw.headers[header]) - baton["timing"][key]) < 2e-6, header
        assert r.id == "cmpl-" + raw.headers["x-request-id"]

        chunks = list(c.completions.create(model=TEST_MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}))
        assert streamed_text(chunks, chat=False) == want
        assert len(chunks) >= 3, "tokens must stream as separate chunks"
        assert [ch.choices[0].finish_reason for ch in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert chunks[-1].choices[0].finish_reason == "length"
        check_timing(chunks[-1].model_extra["baton"])
        assert all("baton" not in (ch.model_extra or {}) for ch in chunks[:-1])
        assert len({ch.id for ch in chunks}) == 1


def test_chat_whole_and_streamed_equal_baton_generate_chat(baton_bin, test_model, api, rng):
    c = client(api)
    words = "the of a sky blue why is light sun red water".split()
    for _ in range(3):
        question = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 12)))
        want = reference_text(baton_bin, test_model, 20, chat=question)
        messages = [{"role": "user", "content": question}]
        r = c.chat.completions.create(model=TEST_MODEL, messages=messages, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.object == "chat.completion"
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == want, question
        chunks = list(c.chat.completions.create(model=TEST_MODEL, messages=messages, max_tokens=20, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        assert chunks[0].object == "chat.completion.chunk"
        assert chunks[0].choices[0].delta.role == "assistant"
        assert streamed_text(chunks, chat=True) == want
        # Text parts are the same text.
        parts = [{"role": "user", "content": [{"type": "text", "text": question}]}]
        r = c.chat.completions.create(model=TEST_MODEL, messages=parts, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == want


@pytest.fixture(scope="module")
def real_api(baton_bin):
    model = real_model_path()
    s = Server(baton_bin, model, "--dtype", "f32", *HTTP)
    s.model = model
    yield s
    s.stop_clean()


@pytest.mark.parametrize("question", ["What is the capital of France?", "Name three colours."])
def test_real_model_chat_and_completions_equal_baton_generate(baton_bin, real_api, question):
    """SmolLM2-135M-Instruct, greedy, until its end of turn (or 48 tokens): chat through the API
    equals `baton generate --chat`, and a completion of a plain prompt `baton generate --prompt`."""
    c = client(real_api)
    name = real_api.model.stem
    want = reference_text(baton_bin, real_api.model, 48, chat=question, ignore_eos=False)
    print(repr(want))
    messages = [{"role": "user", "content": question}]
    r = c.chat.completions.create(model=name, messages=messages, max_tokens=48, temperature=0)
    assert r.choices[0].message.content == want
    chunks = list(c.chat.completions.create(model=name, messages=messages, max_tokens=48, temperature=0, stream=True))
    assert streamed_text(chunks, chat=True) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason

    prompt = "The three primary colours are"
    want = reference_text(baton_bin, real_api.model, 16, prompt=prompt, ignore_eos=False)
    r = c.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == want
    chunks = list(c.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0, stream=True))
    assert streamed_text(chunks, chat=False) == want


def test_real_model_stop_string(real_api):
    c = client(real_api)
    messages = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    for stream in (False, True):
        r = c.chat.completions.create(model=real_api.model.stem, messages=messages, max_tokens=96, temperature=0,
                                      stop=["7"], stream=stream)
        if stream:
            chunks = list(r)
            text, finish = streamed_text(chunks, chat=True), chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        print(repr(text))
        assert "7" not in text and "6" in text
        assert finish == "stop"


# ---- sampling, stop strings, usage ------------------------------------------------------------

def test_stop_strings_cut_the_text_where_it_first_holds_them(baton_bin, test_model, api, rng):
    c = client(api)
    prompt = random_ids(rng, 12)
    full = reference_text(baton_bin, test_model, 60, prompt_ids=prompt)
    # A stop string from the middle of the text (printable, so it survives any terminal), and one
    # that never occurs.
    starts = [i for i in range(10, len(full) - 3) if full[i:i + 3].isprintable() and "\ufffd" not in full[i:i + 3]]
    assert starts, repr(full)
    at = rng.choice(starts)
    stop = full[at:at + rng.randrange(1, 4)]
    want = full[:full.index(stop)]
    for stream in (False, True):
        r = c.completions.create(model=TEST_MODEL, prompt=prompt, max_tokens=60, temperature=0, stream=stream,
                                 stop=[stop, "\u2603never\u2603"], extra_body={"ignore_eos": True})
        chunks = list(r) if stream else None
        text = streamed_text(chunks, chat=False) if stream else r.choices[0].text
        finish = chunks[-1].choices[0].finish_reason if stream else r.choices[0].finish_reason
        assert text == want, (stop, full)
        assert finish == "stop"


def test_seeded_sampling_is_baton_generates_and_repeats(baton_bin, test_model, api, rng):
    c = client(api)
    prompt = random_ids(rng, 10)
    seed = rng.randrange(1 << 62)
    want = reference_text(baton_bin, test_model, 24, prompt_ids=prompt, temperature=0.9, seed=seed)
    args = dict(model=TEST_MODEL, prompt=prompt, max_tokens=24, temperature=0.9, extra_body={"ignore_eos": True})
    assert c.completions.create(seed=seed, **args).choices[0].text == want
    assert streamed_text(list(c.completions.create(seed=seed, stream=True, **args)), chat=False) == want
    others = {c.completions.create(seed=seed + k, **args).choices[0].text for k in range(1, 4)}
    assert others != {want}, "another seed must draw other text"
    # Without a seed, each request draws its own (OpenAI's behaviour).
    unseeded = {c.completions.create(**args).choices[0].text for _ in range(3)}
    assert len(unseeded) > 1, unseeded


def test_include_usage_adds_a_usage_chunk(api, rng):
    c = client(api)
    messages = [{"role": "user", "content": "hello"}]
    chunks = list(c.chat.completions.create(model=TEST_MODEL, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 10
    assert usage.usage.prompt_tokens > 1 and usage.usage.total_tokens == usage.usage.prompt_tokens + 10
    assert all(ch.usage is None for ch in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    check_timing(usage.model_extra["baton"])
    assert "baton" not in chunks[-2].model_extra
    plain = list(c.chat.completions.create(model=TEST_MODEL, messages=messages, max_tokens=10, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}))
    assert all(ch.usage is None and ch.choices for ch in plain)
    check_timing(plain[-1].model_extra["baton"])


# ---- errors -----------------------------------------------------------------------------------

def test_bad_json_is_a_400_in_openais_shape(api):
    for body, says in ((b'{"model": "test", "prompt": ', "not valid JSON"), (b"[1, 2, 3]", "must be a JSON object"),
                       (b"", "empty"), (b'{"prompt": "\xff\xfe"}', "not valid JSON"),
                       (b'{"prompt": "x", "user": ' + b"[" * 300 + b"]" * 300 + b"}", "deeper")):
        r = httpx2.post(api.http_url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (body[:40], r.text)
        assert r.headers["content-type"].startswith("application/json")
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert says in err["message"] and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("field,value", [
    ("temperature", "hot"), ("max_tokens", "5"), ("top_p", True), ("stop", 5), ("seed", 1.5),
    ("stream", "yes"), ("messages", "hi"),
])
def test_wrong_types_are_400_naming_the_field(api, field, value):
    args = dict(model=TEST_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    args[field] = value
    with pytest.raises(openai.BadRequestError) as e:
        client(api).chat.completions.create(**args)
    assert e.value.status_code == 400
    assert e.value.param == field and field in e.value.message, e.value.body
    assert e.value.type == "invalid_request_error"


@pytest.mark.parametrize("args,param", [
    (dict(n=0), "n"), (dict(temperature=-1), "temperature"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=5000), "max_tokens"), (dict(top_logprobs=3), "top_logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(logit_bias={"5": 1}), "logit_bias"),
])
def test_values_baton_cannot_serve_are_400_naming_the_field(api, args, param):
    with pytest.raises(openai.BadRequestError) as e:
        client(api).chat.completions.create(model=TEST_MODEL, messages=[{"role": "user", "content": "hi"}], **args)
    assert e.value.param == param and param in e.value.message, e.value.body


def test_unknown_model_is_404_and_models_lists_the_served_one(api):
    c = client(api)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert e.value.code == "model_not_found" and "'test'" in e.value.message
    models = c.models.list().data
    assert [m.id for m in models] == [TEST_MODEL]
    assert models[0].model_extra["baton"]["context_length"] == 1024
    assert c.models.retrieve(TEST_MODEL).id == TEST_MODEL
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")
    r = httpx2.get(api.http_url + "/v1/nothing-here")
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]


def test_health(api, test_model, server_factory):
    r = httpx2.get(api.http_url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    # A frontend whose workers are not there: 503 saying why, and requests wait, then get 503.
    lonely = server_factory(test_model, "--prefill-addresses", f"127.0.0.1:{free_port()}", "--decode-addresses",
                            f"127.0.0.1:{free_port()}", "--no-worker-timeout", "1", *HTTP,
                            subcommand=("serve", "--role", "frontend"))
    r = httpx2.get(lonely.http_url + "/health")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert "no healthy prefill worker" in r.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError) as e:
        client(lonely).completions.create(model=TEST_MODEL, prompt="hi", max_tokens=2)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"


# ---- operations -------------------------------------------------------------------------------

def test_http_counts_in_the_same_metrics_as_grpc(pb, test_model, server_factory):
    srv = server_factory(test_model, *HTTP)
    c = client(srv)
    for i in range(3):
        c.completions.create(model=TEST_MODEL, prompt=[7 + i, 8, 9], max_tokens=4, extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=TEST_MODEL, prompt="hi", max_tokens=0)
    with grpc.insecure_channel(srv.address) as ch:
        list(pb.gen_grpc.GenerationStub(ch).Generate(
            pb.gen.GenerateRequest(prompt_token_ids=[7, 8, 9], max_tokens=4, ignore_eos=True), timeout=60))
    text = srv.metrics()
    codes = metric_values(text, "baton_requests_total")
    assert codes.get('{code="OK"}') == 4 and codes.get('{code="INVALID_ARGUMENT"}') == 1, codes
    assert sum(metric_values(text, "baton_time_to_first_token_seconds_count").values()) == 4
    assert sum(metric_values(text, "baton_request_e2e_seconds_count").values()) == 4
    assert sum(metric_values(text, "baton_prompt_tokens_total").values()) == 12
    assert sum(metric_values(text, "baton_generation_tokens_total").values()) == 16


def test_the_drain_refuses_new_requests_with_503_and_finishes_streams(baton_bin, test_model):
    srv = Server(baton_bin, test_model, "--drain-timeout", "60", *HTTP)
    n, max_tokens = 8, 900
    try:
        started = threading.Barrier(n + 1)
        results = [None] * n

        def stream(i):
            got, first = 0, True
            for ch in client(srv).completions.create(model=TEST_MODEL, prompt=[5 + i, 6, 7], max_tokens=max_tokens,
                                                     stream=True, stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True}):
                if first:
                    first = False
                    started.wait(timeout=60)
                if ch.usage:
                    got = ch.usage.completion_tokens
            results[i] = got

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        started.wait(timeout=60)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(openai.InternalServerError) as e:
            client(srv).completions.create(model=TEST_MODEL, prompt=[9, 9], max_tokens=4)
        assert e.value.status_code == 503 and "shutting down" in e.value.message
        assert e.value.response.headers["retry-after"] == "1"
        health = httpx2.get(srv.http_url + "/health")
        assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]
        for t in threads:
            t.join(timeout=120)
        assert results == [max_tokens] * n, results
        assert srv.proc.wait(timeout=60) == 0
    finally:
        srv.stop()
