"""Transport security, API keys and secure defaults (issue: security), between real `baton serve`
processes with real certificates made by `openssl` (conftest's pki fixture):
- with mutual TLS on the internal plane and TLS + a client CA + API keys on the public one, a
  client streams the same greedy tokens as over plain loopback (Python gRPC and batonctl);
- every internal RPC is refused to a client without a certificate, with one from another CA, or
  in plaintext; the frontend sends no work to a worker whose certificate another CA signed;
- API keys: none or a wrong one is UNAUTHENTICATED; a rewritten key file applies without a restart;
  only a key with a max-priority may ask for more than the frontend's --max-priority;
- a rotated public certificate applies to new connections without a restart;
- a role that would listen beyond loopback unauthenticated refuses to start (unless --insecure),
  and bad certificate files stop it with the flag named;
- kubelet's probes get a plaintext port that serves grpc.health.v1 and nothing else;
- an internal message over 64 MiB is refused (RESOURCE_EXHAUSTED) and the worker goes on;
- a rotated internal certificate or CA bundle applies to new connections without a restart;
- a string field that is not UTF-8 is named in the INVALID_ARGUMENT.
What a deployment member may do to a request that is not its own, and what a client learns of
the workers when a request fails, is in test_security_insiders.py."""

import os
import subprocess
import time

import grpc
import pytest

from serving_harness import (KEY, PRIVILEGED_KEY, PROMPT, SERVING, creds, free_port, health_check, internal_flags,
                             replace_file, retry_until, start, start_secure, tls_generate, wait_blocks_free)
from test_serving import reference_ids


@pytest.fixture
def secure_deployment(pki, test_model, server_factory):
    return start_secure(pki, test_model, server_factory)


def test_tls_on_both_planes_streams_the_same_greedy_text(pb, pki, baton_bin, test_model, secure_deployment):
    front, _, _ = secure_deployment
    want = reference_ids(baton_bin, test_model, PROMPT, 16)
    got = tls_generate(pb, front.address, creds(pki.public_ca, pki.client), prompt_token_ids=PROMPT, max_tokens=16,
                       ignore_eos=True)
    assert got == want
    batonctl = baton_bin.parent / "batonctl"
    out = subprocess.run([batonctl, "generate", "--address", front.address, "--tls-ca", pki.public_ca[0], "--tls-cert",
                          pki.client[0], "--tls-key", pki.client[1], "--prompt-ids", ",".join(map(str, PROMPT)),
                          "--max-tokens", "16", "--ignore-eos", "--print-ids"],
                         env={**os.environ, "BATONCTL_API_KEY": KEY}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [int(x) for x in out.stdout.strip().split(",")] == want
    # Without a client certificate the public listener refuses the handshake (--tls-client-ca).
    with pytest.raises(grpc.RpcError) as e:
        tls_generate(pb, front.address, creds(pki.public_ca), prompt_token_ids=PROMPT, max_tokens=2)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # batonctl names a bad file and exits 2 before connecting.
    bad = subprocess.run([batonctl, "generate", "--address", front.address, "--tls-ca", pki.public_ca[0], "--tls-cert",
                          pki.client[0], "--tls-key", pki.public[1], "--prompt", "hi"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--tls-key" in bad.stderr, bad.stderr


def internal_calls(pb, channel, fingerprint="x"):
    """Every internal RPC, each called once on `channel`: {name: grpc.StatusCode}."""
    w, wg = pb.worker, pb.worker_grpc
    prefill, decode = wg.PrefillWorkerStub(channel), wg.DecodeWorkerStub(channel)
    device = wg.DecodeKvDeviceStub(channel)  # the cuda_ipc / nccl hand-off (builds with CUDA)

    def code(fn):
        try:
            r = fn()
            if hasattr(r, "__iter__") and not hasattr(r, "ListFields"):
                list(r)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()

    return {
        "Prefill": code(lambda: prefill.Prefill(w.PrefillRequest(request_id="x"), timeout=5)),
        "PrefillWorker.GetLoad": code(lambda: prefill.GetLoad(w.LoadRequest(), timeout=5)),
        # A KV probe (batonctl doctor) makes the prefill worker send KV: members only, like the rest.
        "ProbeKv": code(lambda: prefill.ProbeKv(w.KvProbeRequest(decode_address="127.0.0.1:1", bytes=1, rounds=1),
                                                timeout=5)),
        "Admit": code(lambda: decode.Admit(w.AdmitRequest(request_id="x", n_prompt_tokens=8, max_tokens=8,
                                                          model_fingerprint=fingerprint), timeout=5)),
        "Stream": code(lambda: decode.Stream(w.StreamRequest(request_id="x"), timeout=5)),
        "Release": code(lambda: decode.Release(w.ReleaseRequest(request_id="x"), timeout=5)),
        "TransferKv": code(lambda: decode.TransferKv(iter([w.KvMessage()]), timeout=5)),
        "DecodeWorker.GetLoad": code(lambda: decode.GetLoad(w.LoadRequest(), timeout=5)),
        "TransferKvDevice": code(lambda: device.TransferKvDevice(iter([w.KvDeviceMessage()]), timeout=5)),
        "BootstrapNccl": code(lambda: device.BootstrapNccl(w.NcclBootstrapRequest(), timeout=5)),
    }


def test_internal_rpcs_only_from_the_deployment(pb, pki, secure_deployment):
    front, prefill, decode = secure_deployment
    for worker in (prefill, decode):
        strangers = {
            "plaintext": grpc.insecure_channel(worker.address),
            "no client certificate": grpc.secure_channel(worker.address, creds(pki.internal_ca)),
            "another CA's certificate": grpc.secure_channel(worker.address, creds(pki.internal_ca, pki.rogue)),
            # A public client's certificate is a credential of the public plane only.
            "a public client certificate": grpc.secure_channel(worker.address, creds(pki.internal_ca, pki.client)),
        }
        for who, ch in strangers.items():
            codes = internal_calls(pb, ch)
            assert set(codes.values()) == {grpc.StatusCode.UNAVAILABLE}, (worker.address, who, codes)
            ch.close()
        # A worker that presents another CA's certificate is refused by the frontend's side too:
        # a client trusting only the rogue CA cannot even finish the handshake with the worker.
        with grpc.secure_channel(worker.address, creds(pki.rogue_ca, pki.roles["frontend"])) as ch:
            assert set(internal_calls(pb, ch).values()) == {grpc.StatusCode.UNAVAILABLE}
    # The deployment's own certificate works (GetLoad answers, the wrong-model Admit is refused
    # by the engine, not the transport).
    with grpc.secure_channel(decode.address, creds(pki.internal_ca, pki.roles["frontend"])) as ch:
        codes = internal_calls(pb, ch)
    assert codes["DecodeWorker.GetLoad"] == grpc.StatusCode.OK
    assert codes["Admit"] == grpc.StatusCode.FAILED_PRECONDITION


def test_the_frontend_refuses_an_impostor_worker(pb, pki, test_model, server_factory):
    """A worker whose certificate another CA signed gets no work: the frontend's channels verify
    the server's chain too (it trusts the frontend's CA, so only that direction is tested)."""
    crt, key = pki.rogue
    impostor = server_factory(test_model, "--internal-tls-cert", crt, "--internal-tls-key", key, "--internal-tls-ca",
                              pki.internal_ca[0], subcommand=("serve", "--role", "decode"))
    prefill = server_factory(test_model, *internal_flags(pki, "prefill"), subcommand=("serve", "--role", "prefill"))
    front = server_factory(test_model, *internal_flags(pki, "frontend"), "--prefill-addresses", prefill.address,
                           "--decode-addresses", impostor.address, "--no-worker-timeout", "1",
                           subcommand=("serve", "--role", "frontend"))
    with grpc.insecure_channel(front.address) as ch, pytest.raises(grpc.RpcError) as e:
        list(pb.gen_grpc.GenerationStub(ch).Generate(pb.gen.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=2),
                                                     timeout=30))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "decode" in e.value.details(), e.value.details()


def test_probes_get_a_plaintext_health_port_that_serves_nothing_else(pb, pki, test_model, server_factory):
    health = f"127.0.0.1:{free_port()}"
    decode = server_factory(test_model, *internal_flags(pki, "decode"), "--health-listen", health,
                            subcommand=("serve", "--role", "decode"))
    assert health_check(health) == SERVING
    with grpc.insecure_channel(health) as ch:
        codes = internal_calls(pb, ch)
    assert set(codes.values()) == {grpc.StatusCode.UNIMPLEMENTED}, codes
    decode.stop()  # drained and gone: the probe port closed with it
    with pytest.raises(grpc.RpcError):
        health_check(health)


def test_api_keys(pb, pki, secure_deployment):
    front, _, _ = secure_deployment
    c = creds(pki.public_ca, pki.client)
    for metadata in ((), (("authorization", "Bearer wrong-key-0123456789abcdef"),), (("authorization", KEY),)):
        with pytest.raises(grpc.RpcError) as e:
            tls_generate(pb, front.address, c, metadata=metadata, prompt_token_ids=PROMPT, max_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer <key>" in e.value.details()
        with grpc.secure_channel(front.address, c) as ch, pytest.raises(grpc.RpcError) as e:
            pb.gen_grpc.GenerationStub(ch).ListModels(pb.gen.ListModelsRequest(), timeout=10, metadata=metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(tls_generate(pb, front.address, c, prompt_token_ids=PROMPT, max_tokens=2, ignore_eos=True)) == 2
    assert 'code="UNAUTHENTICATED"' in front.metrics()

    new_key = "key-" + os.urandom(16).hex()
    original = pki.keys.read_text()
    try:
        pki.keys.write_text(new_key + "\n")
        time.sleep(1.2)  # the frontend looks at the file at most once a second
        new = (("authorization", f"Bearer {new_key}"),)
        assert len(tls_generate(pb, front.address, c, metadata=new, prompt_token_ids=PROMPT, max_tokens=2,
                                ignore_eos=True)) == 2
        with pytest.raises(grpc.RpcError) as e:
            tls_generate(pb, front.address, c, prompt_token_ids=PROMPT, max_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        pki.keys.write_text(original)


def test_only_privileged_keys_raise_priority(pb, pki, secure_deployment):
    """Any client can starve others by asking for a high priority, unless raising it takes a key
    that may: the plain key gets the frontend's --max-priority (0), the privileged one its own 5."""
    front, _, _ = secure_deployment
    c = creds(pki.public_ca, pki.client)

    def code(key, priority):
        try:
            tls_generate(pb, front.address, c, metadata=(("authorization", f"Bearer {key}"),),
                         prompt_token_ids=PROMPT, max_tokens=2, ignore_eos=True, priority=priority)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            return e.code(), e.details()

    assert code(KEY, 0)[0] == grpc.StatusCode.OK
    assert code(KEY, -3)[0] == grpc.StatusCode.OK  # lower is always allowed
    got, details = code(KEY, 1)
    assert got == grpc.StatusCode.PERMISSION_DENIED and "--max-priority" in details, details
    assert code(PRIVILEGED_KEY, 5)[0] == grpc.StatusCode.OK
    got, details = code(PRIVILEGED_KEY, 6)
    assert got == grpc.StatusCode.PERMISSION_DENIED and "this API key" in details, details


def test_a_rotated_certificate_applies_without_a_restart(pb, pki, baton_bin, test_model, server_factory, tmp_path):
    crt, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    crt.write_bytes(pki.public[0].read_bytes())
    key.write_bytes(pki.public[1].read_bytes())
    srv = server_factory(test_model, "--tls-cert", crt, "--tls-key", key, "--tls-refresh-seconds", "1")
    want = reference_ids(baton_bin, test_model, PROMPT, 4)
    assert tls_generate(pb, srv.address, creds(pki.public_ca), prompt_token_ids=PROMPT, max_tokens=4,
                        ignore_eos=True) == want
    # cert-manager's way: a new key pair from another CA, swapped in by rename.
    new_ca = pki.rotate(crt, key, "baton-public-2", "baton-public-ca-2")
    got = retry_until(lambda: tls_generate(pb, srv.address, creds(new_ca), prompt_token_ids=PROMPT, max_tokens=4,
                                           ignore_eos=True), grpc.RpcError, "the rotated certificate was served")
    assert got == want
    with pytest.raises(grpc.RpcError) as e:  # the old CA no longer verifies the server
        tls_generate(pb, srv.address, creds(pki.public_ca), prompt_token_ids=PROMPT, max_tokens=4)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_secure_defaults_refuse_an_open_port(baton_bin, test_model, pki):
    for role in ("decode", "prefill"):
        rc, err = start(baton_bin, test_model, "--role", role, "--listen", "0.0.0.0:0")
        assert rc == 1, err
        assert "refusing to start insecurely" in err and "--internal-tls-cert" in err and "--insecure" in err, err
        rc, err = start(baton_bin, test_model, "--role", role, "--listen", "0.0.0.0:0", "--insecure")
        assert rc is None, err
        assert "--insecure" in err  # said in the log
        rc, err = start(baton_bin, test_model, "--role", role, "--listen", "0.0.0.0:0", *internal_flags(pki, role))
        assert rc is None, err
    rc, err = start(baton_bin, test_model, "--role", "frontend", "--listen", "0.0.0.0:0",
                    "--prefill-addresses", "127.0.0.1:1", "--decode-addresses", "127.0.0.1:2")
    assert rc == 1 and "--tls-cert" in err, err
    # No --listen at all: the default, 0.0.0.0:50051, is every interface.
    rc, err = start(baton_bin, test_model, "--role", "frontend", "--prefill-addresses", "127.0.0.1:1",
                    "--decode-addresses", "127.0.0.1:2")
    assert rc == 1 and "0.0.0.0:50051" in err and "--tls-cert" in err and "--insecure" in err, err
    # `baton local` listens where it is told: beyond loopback it needs public TLS too.
    rc, err = start(baton_bin, test_model, "--listen", "0.0.0.0:0", command="local")
    assert rc == 1 and "refusing to start insecurely" in err and "--tls-cert" in err, err
    rc, err = start(baton_bin, test_model, "--role", "frontend", "--listen", "127.0.0.1:0",
                    "--prefill-addresses", "10.1.2.3:50051", "--decode-addresses", "127.0.0.1:2")
    assert rc == 1 and "10.1.2.3:50051" in err and "--internal-tls-ca" in err, err
    # Bad files stop the role with the flag named, before it listens.
    crt, key = pki.roles["decode"]
    for args, flag in ((["--internal-tls-cert", crt, "--internal-tls-key", key], "--internal-tls-ca"),
                       (["--internal-tls-cert", crt, "--internal-tls-key", pki.client[1], "--internal-tls-ca",
                         pki.internal_ca[0]], "--internal-tls-key"),
                       (["--internal-tls-cert", pki.path / "missing.crt", "--internal-tls-key", key,
                         "--internal-tls-ca", pki.internal_ca[0]], "--internal-tls-cert"),
                       (["--tls-client-ca", pki.public_ca[0]], "--tls-client-ca"),
                       (["--api-key-file", pki.path / "missing-keys"], "--api-key-file")):
        rc, err = start(baton_bin, test_model, "--role", "decode", "--listen", "127.0.0.1:0", *args)
        assert rc in (1, 2) and flag in err, (args, err)


def test_invalid_utf8_names_the_field(pb, shared_server):
    def call(request, mark):
        raw = request.SerializeToString()
        assert raw.count(mark) == 1
        raw = raw.replace(mark, b"\xff" + mark[1:])
        with grpc.insecure_channel(shared_server.address) as ch:
            gen = ch.unary_stream("/baton.v1.Generation/Generate", request_serializer=lambda b: b,
                                  response_deserializer=pb.gen.GenerateResponse.FromString)
            with pytest.raises(grpc.RpcError) as e:
                list(gen(raw, timeout=30))
        return e.value

    e = call(pb.gen.GenerateRequest(prompt="@@PROMPT@@", max_tokens=2), b"@@PROMPT@@")
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "field 'prompt' is not valid UTF-8" in e.details()
    req = pb.gen.GenerateRequest(max_tokens=2)
    req.messages.add(role="system", content="be brief")
    req.messages.add(role="user", content="@@CONTENT@@")
    e = call(req, b"@@CONTENT@@")
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "field 'messages[1].content' is not valid UTF-8" in e.details()


def test_an_internal_message_over_64_mib_is_refused_and_the_worker_goes_on(pb, pki, baton_bin, test_model,
                                                                           secure_deployment):
    front, _, decode = secure_deployment
    w = pb.worker
    with grpc.secure_channel(decode.address, creds(pki.internal_ca, pki.roles["prefill"])) as ch:
        stub = pb.worker_grpc.DecodeWorkerStub(ch)
        load = stub.GetLoad(w.LoadRequest(), timeout=5)
        fingerprint = load.model_fingerprint
        rid = os.urandom(16).hex()
        stub.Admit(w.AdmitRequest(request_id=rid, n_prompt_tokens=8, max_tokens=4, kv_sender="127.0.0.1:1",
                                  model_fingerprint=fingerprint), timeout=10)
        header = w.KvHeader(request_id=rid, model_fingerprint=fingerprint, dtype=load.kv_dtype, n_layers=2, n_kv_heads=2,
                            head_dim=16, n_tokens=8, token_ids=PROMPT)
        chunk = w.KvLayerChunk(layer=0, token_start=0, token_count=8, k=bytes(65 << 20), v=b"")
        with pytest.raises(grpc.RpcError) as e:
            stub.TransferKv(iter([w.KvMessage(header=header), w.KvMessage(chunk=chunk)]), timeout=60)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        stub.Release(w.ReleaseRequest(request_id=rid), timeout=5)
    assert decode.proc.poll() is None
    want = reference_ids(baton_bin, test_model, PROMPT, 8)
    assert tls_generate(pb, front.address, creds(pki.public_ca, pki.client), prompt_token_ids=PROMPT, max_tokens=8,
                        ignore_eos=True) == want
    assert wait_blocks_free(decode)


def test_rotated_internal_certificates_apply_without_a_restart(pb, pki, test_model, server_factory, tmp_path):
    """The decode worker reads its internal certificate and CA bundle again (--tls-refresh-seconds 1):
    - its certificate rotated to one a new CA signed: a client trusting only the new CA gets in, one
      trusting only the old CA no longer does;
    - then its CA bundle rotated to the new CA (which now signs the other roles too): a client with
      a certificate of the new CA gets in, one with the old CA's certificate no longer does."""
    crt, key, ca = tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt"
    for src, dst in ((pki.roles["decode"][0], crt), (pki.roles["decode"][1], key), (pki.internal_ca[0], ca)):
        dst.write_bytes(src.read_bytes())
    decode = server_factory(test_model, "--internal-tls-cert", crt, "--internal-tls-key", key, "--internal-tls-ca", ca,
                            "--tls-refresh-seconds", "1", subcommand=("serve", "--role", "decode"))
    new_ca = pki.ca("baton-internal-ca-2")
    new_decode = pki.leaf("baton-decode-2", new_ca)
    new_frontend = pki.leaf("baton-frontend-2", new_ca)

    def get_load(trust, leaf):
        # A connection of its own (no subchannel shared with an earlier channel).
        with grpc.secure_channel(decode.address, creds(trust, leaf), options=[("grpc.use_local_subchannel_pool", 1)]) \
                as ch:
            try:
                pb.worker_grpc.DecodeWorkerStub(ch).GetLoad(pb.worker.LoadRequest(), timeout=5)
                return grpc.StatusCode.OK
            except grpc.RpcError as e:
                return e.code()

    def eventually(trust, leaf, want, what):
        deadline = time.time() + 15
        while (got := get_load(trust, leaf)) != want:
            assert time.time() < deadline, f"{what}: still {got} after 15 s"
            time.sleep(0.2)

    old = pki.roles["frontend"]
    assert get_load(pki.internal_ca, old) == grpc.StatusCode.OK
    assert get_load(new_ca, old) == grpc.StatusCode.UNAVAILABLE
    replace_file(new_decode[1], key)
    replace_file(new_decode[0], crt)
    eventually(new_ca, old, grpc.StatusCode.OK, "the rotated certificate")
    assert get_load(pki.internal_ca, old) == grpc.StatusCode.UNAVAILABLE  # the old CA no longer verifies it

    assert get_load(new_ca, new_frontend) == grpc.StatusCode.UNAVAILABLE  # not yet a member
    replace_file(new_ca[0], ca)
    eventually(new_ca, new_frontend, grpc.StatusCode.OK, "the rotated CA bundle")
    assert get_load(new_ca, old) == grpc.StatusCode.UNAVAILABLE  # the old CA's certificates are out
