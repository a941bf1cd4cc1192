"""The OpenAI-compatible HTTP API (--http-listen) over real `baton` processes, with the official
`openai` Python client (PyPI) as the client:
- completions and chat completions, streamed (SSE) and whole, give the same greedy text as
  single-process `baton generate` (the random test model; SmolLM2 for chat), seeded sampling the
  same seeded text; stop strings cut the text where `baton generate`'s output first holds them;
- stream_options.include_usage adds a usage chunk; the timing breakdown rides on the last chunk
  and, for whole responses, in the body and X-Baton-* headers;
- errors come in OpenAI's shape with their HTTP code: bad JSON, wrong types (the field named),
  n > 1, an unknown model (404), a missing or wrong API key (401), an oversized body (413),
  overload (429 with Retry-After), no workers (503), the drain (503 with the reason);
- a client that disconnects mid-stream, or while its request waits in the queue, ends the request
  at once and the KV blocks of both workers are free again;
- 200 concurrent SSE streams all complete with the right text;
- HTTPS with an API key (and mutual TLS), and the secure default for a non-loopback --http-listen;
- the HTTP API counts in the same metrics as gRPC.
The JSON conversions themselves are unit-tested in tests/unit/server/openai_json_test.cpp."""

import asyncio
import concurrent.futures
import json
import os
import random
import re
import signal
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import grpc
import httpx2
import openai
import pytest

from serving_harness import REPO, Server, free_port, metric_values, wait_blocks_free
from test_security import KEY, Pki, start

HTTP = ("--http-listen", "127.0.0.1:0")
TEST_MODEL = "test"  # the served name: the file's stem (conftest: test.gguf)


@pytest.fixture(scope="module")
def rng():
    seed = random.randrange(1 << 30)
    print(f"random seed {seed}")
    return random.Random(seed)


@pytest.fixture(scope="module")
def api(baton_bin, test_model):
    """One `baton local` with the HTTP API on the test model, in the exact mode (f32)."""
    s = Server(baton_bin, test_model, "--dtype", "f32", *HTTP)
    yield s
    s.stop_clean()


def client(srv, **kw):
    """The openai client on `srv`'s HTTP API, without retries (a refusal must reach the test)."""
    kw.setdefault("api_key", "none")
    kw.setdefault("timeout", 120)
    return openai.OpenAI(base_url=srv.http_url + "/v1", max_retries=0, **kw)


def reference_text(baton_bin, model, max_tokens, prompt_ids=None, chat=None, prompt=None, temperature=0.0, seed=0,
                   ignore_eos=True):
    """What single-process `baton generate` (f32) prints for the request, without its last newline."""
    args = [str(baton_bin), "generate", "--model", str(model), "--max-tokens", str(max_tokens), "--dtype", "f32",
            "--temperature", str(temperature), "--seed", str(seed)]
    if prompt_ids is not None:
        args += ["--prompt-ids", ",".join(map(str, prompt_ids))]
    elif chat is not None:
        args += ["--chat", chat]
    else:
        args += ["--prompt", prompt]
    if ignore_eos:
        args.append("--ignore-eos")
    out = subprocess.run(args, check=True, capture_output=True, timeout=300).stdout
    assert out.endswith(b"\n")
    return out[:-1].decode("utf-8")


def streamed_text(chunks, chat):
    if chat:
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return "".join(c.choices[0].text for c in chunks if c.choices)


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


def random_ids(rng, n):
    return [rng.randrange(3, 275) for _ in range(n)]


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
    model = os.environ.get("BATON_MODEL")
    if not model:
        model = subprocess.run([str(REPO / "scripts" / "fetch-model.sh")], check=True, capture_output=True,
                               text=True).stdout.strip().splitlines()[-1]
    s = Server(baton_bin, Path(model), "--dtype", "f32", *HTTP)
    s.model = Path(model)
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
                       (b'{"prompt": "x", "user": ' + b"[" * 100 + b"]" * 100 + b"}", "deeper")):
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
    (dict(n=2), "n"), (dict(temperature=-1), "temperature"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=5000), "max_tokens"), (dict(logprobs=True), "logprobs"), (dict(presence_penalty=1.0), "presence_penalty"),
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


def test_api_keys_over_https_and_mutual_tls(baton_bin, test_model, server_factory, tmp_path):
    pki = Pki(tmp_path)
    ca = pki.ca("baton-public-ca")
    server_crt, server_key = pki.leaf("baton-public", ca)
    keys = tmp_path / "api-keys"
    keys.write_text(KEY + "\n")
    srv = server_factory(test_model, "--dtype", "f32", "--tls-cert", server_crt, "--tls-key", server_key,
                         "--api-key-file", keys, *HTTP)
    base = f"https://localhost:{srv.http_port}/v1"
    tls = ssl.create_default_context(cafile=str(ca[0]))

    def https_client(key, context=tls):
        return openai.OpenAI(base_url=base, api_key=key, max_retries=0,
                             http_client=httpx2.Client(verify=context, timeout=60))

    prompt = [5, 17, 99, 3, 250]
    want = reference_text(baton_bin, test_model, 8, prompt_ids=prompt)
    r = https_client(KEY).completions.create(model=TEST_MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == want
    chunks = list(https_client(KEY).completions.create(model=TEST_MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                       stream=True, extra_body={"ignore_eos": True}))
    assert streamed_text(chunks, chat=False) == want
    with pytest.raises(openai.AuthenticationError) as e:
        https_client("wrong-key-0123456789abcdef").completions.create(model=TEST_MODEL, prompt=prompt, max_tokens=2)
    assert e.value.status_code == 401 and "authorization: Bearer <key>" in e.value.message
    assert e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        https_client("wrong-key-0123456789abcdef").models.list()
    # No key at all (the openai client always sends one).
    for path, body in (("/completions", {"prompt": "hi", "max_tokens": 2}), ("/models", None)):
        r = httpx2.request("POST" if body else "GET", base + path, json=body, verify=tls, timeout=30)
        assert r.status_code == 401 and "no API key" in r.json()["error"]["message"], r.text
    assert httpx2.get(base.replace("/v1", "/health"), verify=tls).status_code == 200  # probes have no key
    assert 'code="UNAUTHENTICATED"' in srv.metrics()
    with pytest.raises(httpx2.HTTPError):  # plaintext to the TLS port
        httpx2.get(f"http://127.0.0.1:{srv.http_port}/health", timeout=10)

    client_ca = pki.ca("baton-client-ca")
    alice = pki.leaf("client-alice", client_ca)
    mtls = server_factory(test_model, "--tls-cert", server_crt, "--tls-key", server_key, "--tls-client-ca",
                          client_ca[0], *HTTP)
    with pytest.raises(httpx2.HTTPError):  # no client certificate
        httpx2.get(f"https://localhost:{mtls.http_port}/health", verify=tls, timeout=10)
    with_cert = ssl.create_default_context(cafile=str(ca[0]))
    with_cert.load_cert_chain(str(alice[0]), str(alice[1]))
    c = openai.OpenAI(base_url=f"https://localhost:{mtls.http_port}/v1", api_key="none", max_retries=0,
                      http_client=httpx2.Client(verify=with_cert, timeout=60))
    assert c.completions.create(model=TEST_MODEL, prompt=prompt, max_tokens=3).usage.completion_tokens >= 1


def test_a_rotated_certificate_applies_to_new_https_connections(test_model, server_factory, tmp_path):
    pki = Pki(tmp_path)
    old_ca = pki.ca("old-ca")
    old_crt, old_key = pki.leaf("baton-old", old_ca)
    crt, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    crt.write_bytes(old_crt.read_bytes())
    key.write_bytes(old_key.read_bytes())
    srv = server_factory(test_model, "--tls-cert", crt, "--tls-key", key, "--tls-refresh-seconds", "1", *HTTP)
    url = f"https://localhost:{srv.http_port}/health"
    trust = lambda ca: ssl.create_default_context(cafile=str(ca[0]))  # noqa: E731
    assert httpx2.get(url, verify=trust(old_ca), timeout=10).status_code == 200
    new_ca = pki.ca("new-ca")
    new_crt, new_key = pki.leaf("baton-new", new_ca)
    for src, dst in ((new_key, key), (new_crt, crt)):  # cert-manager's way: swapped in by rename
        tmp = dst.with_suffix(".new")
        tmp.write_bytes(src.read_bytes())
        os.replace(tmp, dst)
    deadline = time.time() + 15
    while True:
        try:
            assert httpx2.get(url, verify=trust(new_ca), timeout=10).status_code == 200
            break
        except httpx2.HTTPError:
            assert time.time() < deadline, "the rotated certificate was not served within 15 s"
            time.sleep(0.5)
    with pytest.raises(httpx2.HTTPError):  # the old CA no longer verifies the server
        httpx2.get(url, verify=trust(old_ca), timeout=10)


def test_idle_and_slow_header_connections_starve_nothing(test_model, server_factory):
    """2,000 connections, 250 times the 8 request threads: half send nothing, half half a request
    line. A completion request and a scrape are still answered at once (before, a thread served a
    connection for its life: the completion waited out the 30 s read timeout of hundreds of them).
    The time figures are bench/slow_clients.py's; here the limit is the client's 5 s."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2600:
        pytest.skip(f"2,200 connections need more descriptors than the hard limit {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2600), hard))
    srv = server_factory(test_model, "--http-threads", "8", *HTTP)
    slow = []
    try:
        for i in range(2000):
            s = socket.create_connection(("127.0.0.1", srv.http_port), timeout=5)
            if i % 2:
                s.sendall(b"POST /v1/compl")
            slow.append(s)
        for i in range(200):
            s = socket.create_connection(("127.0.0.1", srv.metrics_port), timeout=5)
            if i % 2:
                s.sendall(b"GET /metr")
            slow.append(s)
        r = httpx2.post(f"{srv.http_url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 4}, timeout=5)
        assert r.status_code == 200, r.text
        assert "baton_" in srv.metrics()
    finally:
        for s in slow:
            s.close()


def test_a_request_head_must_arrive_in_time_and_fit(test_model, server_factory):
    """A client that trickles its request head (a byte a second: every read makes progress, so no
    read timeout ends it) is cut off 10 s after it connected; a head over 64 KiB gets 431."""
    srv = server_factory(test_model, *HTTP)
    s = socket.create_connection(("127.0.0.1", srv.http_port), timeout=30)
    t0 = time.monotonic()
    closed_after = None
    try:
        for b in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 40:
            s.sendall(bytes([b]))
            time.sleep(0.5)
            if time.monotonic() - t0 > 25:
                break
    except OSError:
        closed_after = time.monotonic() - t0
    if closed_after is None:
        s.settimeout(5)
        try:
            closed_after = time.monotonic() - t0 if s.recv(1) == b"" else None
        except OSError:
            closed_after = time.monotonic() - t0
    assert closed_after is not None and closed_after < 15, closed_after
    s.close()
    with socket.create_connection(("127.0.0.1", srv.http_port), timeout=10) as big:
        big.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"z" * (70 << 10) + b"\r\n\r\n")
        assert big.recv(64).startswith(b"HTTP/1.1 431"), "no 431"


def test_the_api_key_is_checked_before_the_body_is_read(test_model, server_factory, tmp_path):
    """A caller without a valid key gets its 401 once its headers are in: no byte of the body is
    waited for or held. 40 such callers announce 4 MiB bodies each and send none: each is answered
    at once (before, each held a handler thread until the read timeout, buffering what came)."""
    keys = tmp_path / "api-keys"
    keys.write_text(KEY + "\n")
    srv = server_factory(test_model, "--api-key-file", keys, *HTTP)
    head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Authorization: Bearer wrong-key-0123456789abcdef\r\nContent-Length: 4194000\r\n\r\n")
    socks = []
    t0 = time.monotonic()
    for _ in range(40):
        s = socket.create_connection(("127.0.0.1", srv.http_port), timeout=5)
        s.sendall(head.encode())
        socks.append(s)
    for s in socks:
        reply = s.recv(4096).decode(errors="replace")
        assert reply.startswith("HTTP/1.1 401"), reply[:200]
        s.close()
    assert time.monotonic() - t0 < 5
    # A caller with the key is served as before.
    r = httpx2.post(f"{srv.http_url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2},
                    headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text


def test_an_http_request_ends_at_max_request_seconds(test_model, server_factory):
    """--max-request-seconds caps HTTP requests as it caps gRPC ones: a client that sets no
    deadline still gets its answer when the cap passes. Here the request waits for workers that
    never come (--no-worker-timeout is longer): 504 after 2 s, where it waited the full 60 s."""
    nowhere = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    srv = server_factory(test_model, "--prefill-addresses", nowhere[0], "--decode-addresses", nowhere[1],
                         "--no-worker-timeout", "60", "--max-request-seconds", "2", *HTTP,
                         subcommand=("serve", "--role", "frontend"))
    t0 = time.monotonic()
    r = httpx2.post(f"{srv.http_url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 8}, timeout=90)
    took = time.monotonic() - t0
    assert r.status_code == 504, r.text
    assert "deadline" in r.json()["error"]["message"], r.text
    assert 1.5 < took < 10, took


def test_oversized_body_is_413_naming_the_limit(test_model, server_factory):
    srv = server_factory(test_model, "--max-message-bytes", "65536", *HTTP)
    with pytest.raises(openai.APIStatusError) as e:
        client(srv).completions.create(model=TEST_MODEL, prompt="x" * 70000, max_tokens=2)
    assert e.value.status_code == 413 and "65536" in e.value.message and e.value.code == "request_too_large"
    # A chunked body is counted too; the connection stays usable after either.
    body = json.dumps({"model": TEST_MODEL, "prompt": "y" * 200000}).encode()
    with httpx2.Client(base_url=srv.http_url, timeout=30) as h:
        r = h.post("/v1/completions", content=(body[i:i + 8192] for i in range(0, len(body), 8192)))
        assert r.status_code == 413 and "65536" in r.json()["error"]["message"]
        assert h.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}).status_code == 200
    # Just under the limit is served.
    assert client(srv).completions.create(model=TEST_MODEL, prompt="z" * 1000, max_tokens=2).usage.prompt_tokens > 0


def test_overload_is_429_with_retry_after(test_model, server_factory):
    srv = server_factory(test_model, "--max-requests", "3", *HTTP)

    def one(i):
        t0 = time.monotonic()
        try:
            chunks = list(client(srv).completions.create(model=TEST_MODEL, prompt=[9, 10, 11 + i], max_tokens=800,
                                                         stream=True, extra_body={"ignore_eos": True}))
            return "ok", time.monotonic() - t0, chunks[-1].choices[0].finish_reason
        except openai.RateLimitError as e:
            return e.response.headers.get("retry-after"), time.monotonic() - t0, e.message

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    refused = [r for r in results if r[0] != "ok"]
    done = [r for r in results if r[0] == "ok"]
    assert refused and done, results
    assert all(r[0] == "1" for r in refused), refused
    assert all(r[2] == "length" for r in done), done
    assert max(t for _, t, _ in refused) < 2.0, "refusals must come at once"
    assert 'code="RESOURCE_EXHAUSTED"' in srv.metrics()


# ---- disconnects free the KV ------------------------------------------------------------------

def test_client_disconnect_mid_stream_frees_kv_on_both_workers(test_model, server_factory):
    srv = server_factory(test_model, *HTTP)
    c = client(srv)
    for chat in (False, True):
        create = c.chat.completions.create if chat else c.completions.create
        body = dict(messages=[{"role": "user", "content": "hi"}]) if chat else dict(prompt=[5, 6, 7])
        stream = create(model=TEST_MODEL, max_tokens=1000, stream=True, extra_body={"ignore_eos": True}, **body)
        got = 0
        for _ in stream:
            got += 1
            if got == 5:
                break
        stream.close()
        closed_at = time.monotonic()
        assert wait_blocks_free(srv, timeout=10, roles=("decode", "prefill")), "KV blocks not freed after a disconnect"
        print(f"KV free {time.monotonic() - closed_at:.3f} s after the disconnect")
    codes = metric_values(srv.metrics(), "baton_requests_total")
    assert codes.get('{code="CANCELLED"}') == 2, codes
    assert codes.get('{code="OK"}', 0) == 0, codes


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_while_queued_ends_its_request_at_once(test_model, server_factory, stream):
    """No token is written while a request waits for a worker, so only the poll of the connection
    can tell the client has gone: the request must end CANCELLED within a second, not wait out the
    30 s the frontend would give the missing workers."""
    srv = server_factory(test_model, "--prefill-addresses", f"127.0.0.1:{free_port()}", "--decode-addresses",
                         f"127.0.0.1:{free_port()}", "--no-worker-timeout", "30", *HTTP,
                         subcommand=("serve", "--role", "frontend"))
    with pytest.raises(openai.APITimeoutError):
        r = client(srv, timeout=0.5).completions.create(model=TEST_MODEL, prompt="hi", max_tokens=4, stream=stream)
        list(r)
    left_at = time.monotonic()
    while metric_values(srv.metrics(), "baton_requests_total").get('{code="CANCELLED"}') != 1:
        assert time.monotonic() - left_at < 2.0, "the request did not end after its client left"
        time.sleep(0.05)
    print(f"ended {time.monotonic() - left_at:.3f} s after the client left")


# ---- concurrency ------------------------------------------------------------------------------

def test_200_concurrent_streams_all_complete(baton_bin, test_model, server_factory, rng):
    srv = server_factory(test_model, "--dtype", "f32", "--kv-blocks", "2048", *HTTP)
    prompts = [random_ids(rng, rng.randrange(3, 20)) for _ in range(8)]
    wants = [reference_text(baton_bin, test_model, 16, prompt_ids=p) for p in prompts]
    n = 200

    async def run():
        c = openai.AsyncOpenAI(base_url=srv.http_url + "/v1", api_key="none", max_retries=0, timeout=300)

        async def one(i):
            stream = await c.completions.create(model=TEST_MODEL, prompt=prompts[i % 8], max_tokens=16, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
            text, usage = "", None
            async for ch in stream:
                if ch.choices:
                    text += ch.choices[0].text
                usage = ch.usage or usage
            return text, usage.completion_tokens

        t0 = time.monotonic()
        results = await asyncio.gather(*(one(i) for i in range(n)))
        elapsed = time.monotonic() - t0
        await c.close()
        return results, elapsed

    results, elapsed = asyncio.run(run())
    print(f"{n} concurrent SSE streams of 16 tokens: {elapsed:.2f} s")
    assert [r[1] for r in results] == [16] * n
    wrong = [i for i, (text, _) in enumerate(results) if text != wants[i % 8]]
    assert not wrong, f"{len(wrong)} streams with other text, e.g. {results[wrong[0]][0]!r} != {wants[wrong[0] % 8]!r}"
    codes = metric_values(srv.metrics(), "baton_requests_total")
    assert codes.get('{code="OK"}') == n, codes


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


def test_secure_default_refuses_a_plaintext_http_api_beyond_loopback(baton_bin, test_model, tmp_path):
    workers = ["--prefill-addresses", "127.0.0.1:1", "--decode-addresses", "127.0.0.1:2"]
    rc, out = start(baton_bin, test_model, "--role", "frontend", "--listen", "127.0.0.1:0", "--http-listen",
                    "0.0.0.0:0", *workers)
    assert rc == 1 and "refusing to start insecurely" in out and "--http-listen" in out, out
    rc, out = start(baton_bin, test_model, "--role", "frontend", "--listen", "127.0.0.1:0", "--http-listen",
                    "0.0.0.0:0", "--insecure", *workers)
    assert rc is None and "http listening on port" in out, out
    pki = Pki(tmp_path)
    crt, key = pki.leaf("baton-public", pki.ca("ca"))
    rc, out = start(baton_bin, test_model, "--role", "frontend", "--listen", "127.0.0.1:0", "--http-listen",
                    "0.0.0.0:0", "--tls-cert", crt, "--tls-key", key, *workers)
    assert rc is None, out
    rc, out = start(baton_bin, test_model, "--role", "decode", "--listen", "127.0.0.1:0", "--http-listen",
                    "127.0.0.1:0")
    assert rc in (1, 2) and "--http-listen" in out, out
