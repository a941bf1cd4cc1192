"""The OpenAI-compatible HTTP API's security, over real `baton` processes with the official `openai`
Python client: HTTPS with an API key (none or a wrong one is 401, checked before any byte of the
body is read) and mutual TLS; a rotated certificate applies to new connections without a restart;
a non-loopback --http-listen without TLS refuses to start (unless --insecure). Certificates are made
with `openssl` (serving_harness.Pki). The rest of the API is in test_openai_api.py."""

import socket
import ssl
import time

import httpx2
import openai
import pytest

from serving_harness import HTTP, KEY, TEST_MODEL, Pki, reference_text, retry_until, start, streamed_text


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
    new_ca = pki.rotate(crt, key, "baton-new", "new-ca")
    status = retry_until(lambda: httpx2.get(url, verify=trust(new_ca), timeout=10).status_code, httpx2.HTTPError,
                         "the rotated certificate was served")
    assert status == 200
    with pytest.raises(httpx2.HTTPError):  # the old CA no longer verifies the server
        httpx2.get(url, verify=trust(old_ca), timeout=10)


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
