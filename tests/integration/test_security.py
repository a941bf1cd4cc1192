"""Transport security, API keys and secure defaults (issue: security), between real `baton serve`
processes with real certificates made here by `openssl`:
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
- Stream and Release of a decode reservation are honoured only from the peer that admitted it,
  and its KV only from the prefill worker the Admit named; a member of another identity that
  learned a streaming victim's worker-facing id and calls Release and Stream for it disturbs
  nothing;
- a failed request's status names it by the client's id and the workers by role: the
  worker-facing id and the workers' addresses stay in the frontend's log;
- an internal message over 64 MiB is refused (RESOURCE_EXHAUSTED) and the worker goes on;
- a rotated internal certificate or CA bundle applies to new connections without a restart;
- a string field that is not UTF-8 is named in the INVALID_ARGUMENT."""

import os
import re
import subprocess
import threading
import time

import grpc
import pytest

from serving_harness import SERVING, Stream, free_port, health_check, make_test_model, wait_blocks_free
from test_serving import reference_ids

ATTEMPT_ID = re.compile(r"\b[0-9a-f]{32}\b")  # a worker-facing request id (random_request_id)

PROMPT = [5, 17, 99, 3, 250, 41, 7, 12]
KEY = "key-" + os.urandom(16).hex()
PRIVILEGED_KEY = "key-" + os.urandom(16).hex()  # may ask for priority up to 5


def openssl(*args):
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


class Pki:
    """Certificate authorities and leaf certificates in a directory (EC P-256, made with openssl)."""

    def __init__(self, path):
        self.path = path

    def ca(self, name):
        crt, key = self.path / f"{name}.crt", self.path / f"{name}.key"
        openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", key,
                "-out", crt, "-subj", f"/CN={name}", "-days", "2", "-addext", "basicConstraints=critical,CA:TRUE",
                "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        return crt, key

    def leaf(self, name, ca, sans="IP:127.0.0.1,DNS:localhost"):
        crt, key, csr = (self.path / f"{name}.{x}" for x in ("crt", "key", "csr"))
        ext = self.path / f"{name}.ext"
        ext.write_text(f"subjectAltName={sans}\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n")
        openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", key, "-out", csr,
                "-subj", f"/CN={name}")
        openssl("x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial", "-out", crt, "-days", "1",
                "-extfile", ext)
        return crt, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    p = Pki(tmp_path_factory.mktemp("pki"))
    p.internal_ca = p.ca("baton-internal-ca")
    p.public_ca = p.ca("baton-public-ca")
    p.rogue_ca = p.ca("rogue-ca")
    p.roles = {r: p.leaf(f"baton-{r}", p.internal_ca) for r in ("frontend", "prefill", "decode")}
    p.insider_b = p.leaf("baton-other", p.internal_ca)  # a deployment member that did not admit
    p.rogue = p.leaf("rogue", p.rogue_ca)
    p.public = p.leaf("baton-public", p.public_ca)
    p.client = p.leaf("client-alice", p.public_ca)
    p.keys = p.path / "api-keys"
    p.keys.write_text(f"# the test's client\n{KEY}\n# a privileged caller\n{PRIVILEGED_KEY} max-priority=5\n")
    return p


def internal_flags(pki, role):
    crt, key = pki.roles[role]
    return ["--internal-tls-cert", crt, "--internal-tls-key", key, "--internal-tls-ca", pki.internal_ca[0]]


def creds(ca, leaf=None):
    read = lambda p: p.read_bytes()  # noqa: E731
    if leaf is None:
        return grpc.ssl_channel_credentials(root_certificates=read(ca[0]))
    return grpc.ssl_channel_credentials(root_certificates=read(ca[0]), private_key=read(leaf[1]),
                                        certificate_chain=read(leaf[0]))


def tls_generate(pb, address, channel_creds, metadata=(("authorization", f"Bearer {KEY}"),), **fields):
    with grpc.secure_channel(address, channel_creds) as ch:
        msgs = list(pb.gen_grpc.GenerationStub(ch).Generate(pb.gen.GenerateRequest(**fields), timeout=60,
                                                            metadata=metadata))
    return [t for m in msgs for t in m.token_ids]


def start_secure(pki, model, server_factory, worker_flags=(), decode_flags=()):
    """A frontend, a prefill and a decode worker: mutual TLS inside, TLS + client CA + API keys outside."""
    decode = server_factory(model, *internal_flags(pki, "decode"), "--dtype", "f32", *worker_flags, *decode_flags,
                            subcommand=("serve", "--role", "decode"))
    prefill = server_factory(model, *internal_flags(pki, "prefill"), "--dtype", "f32", *worker_flags,
                             subcommand=("serve", "--role", "prefill"))
    front = server_factory(model, *internal_flags(pki, "frontend"), "--prefill-addresses", prefill.address,
                           "--decode-addresses", decode.address, "--tls-cert", pki.public[0], "--tls-key",
                           pki.public[1], "--tls-client-ca", pki.public_ca[0], "--api-key-file", pki.keys,
                           subcommand=("serve", "--role", "frontend"))
    return front, prefill, decode


@pytest.fixture
def secure_deployment(pki, test_model, server_factory):
    return start_secure(pki, test_model, server_factory)


@pytest.fixture(scope="module")
def slow_model(baton_bin, tmp_path_factory):
    """A random model large enough that a stream lasts a while on one thread (4 layers, width 512)."""
    return make_test_model(baton_bin, tmp_path_factory.mktemp("slow") / "model.gguf", seed=13, layers=4, dim=512,
                           heads=8, kv_heads=4, ffn=1536, ctx=1024)


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
    new_ca = pki.ca("baton-public-ca-2")
    new_crt, new_key = pki.leaf("baton-public-2", new_ca)
    for src, dst in ((new_key, key), (new_crt, crt)):
        tmp = dst.with_suffix(".new")
        tmp.write_bytes(src.read_bytes())
        os.replace(tmp, dst)
    deadline = time.time() + 15
    while True:
        try:
            got = tls_generate(pb, srv.address, creds(new_ca), prompt_token_ids=PROMPT, max_tokens=4, ignore_eos=True)
            break
        except grpc.RpcError:
            assert time.time() < deadline, "the rotated certificate was not served within 15 s"
            time.sleep(0.5)
    assert got == want
    with pytest.raises(grpc.RpcError) as e:  # the old CA no longer verifies the server
        tls_generate(pb, srv.address, creds(pki.public_ca), prompt_token_ids=PROMPT, max_tokens=4)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def start(baton_bin, test_model, *args, command="serve"):
    """Runs `baton serve ...` (or `command`) until it listens or exits; returns (exit code, or None
    when it was listening, and everything it printed). BATON_* variables are not passed on: the
    flags alone say what it does."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    p = subprocess.Popen([str(baton_bin), command, "--model", str(test_model), *map(str, args)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("listening on port"):
            p.terminate()
            lines.append(p.communicate(timeout=60)[0])
            return None, "".join(lines)
    p.wait(timeout=60)
    return p.returncode, "".join(lines)


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


def test_stream_and_release_only_from_the_admitting_peer(pb, pki, test_model, server_factory):
    decode = server_factory(test_model, *internal_flags(pki, "decode"), "--kv-blocks", "64",
                            subcommand=("serve", "--role", "decode"))
    a = grpc.secure_channel(decode.address, creds(pki.internal_ca, pki.roles["frontend"]))
    b = grpc.secure_channel(decode.address, creds(pki.internal_ca, pki.insider_b))
    sa, sb = pb.worker_grpc.DecodeWorkerStub(a), pb.worker_grpc.DecodeWorkerStub(b)
    load = sa.GetLoad(pb.worker.LoadRequest(), timeout=5)
    rid = os.urandom(16).hex()
    sa.Admit(pb.worker.AdmitRequest(request_id=rid, n_prompt_tokens=8, max_tokens=8,
                                    model_fingerprint=load.model_fingerprint), timeout=10)
    for call in (lambda: list(sb.Stream(pb.worker.StreamRequest(request_id=rid), timeout=5)),
                 lambda: sb.Release(pb.worker.ReleaseRequest(request_id=rid), timeout=5)):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "admitted by another peer" in e.value.details()
    assert sa.GetLoad(pb.worker.LoadRequest(), timeout=5).free_blocks < load.free_blocks  # still reserved
    sa.Release(pb.worker.ReleaseRequest(request_id=rid), timeout=5)
    deadline = time.time() + 10
    while sa.GetLoad(pb.worker.LoadRequest(), timeout=5).free_blocks != load.free_blocks:
        assert time.time() < deadline
        time.sleep(0.05)
    a.close()
    b.close()


def test_kv_only_from_the_prefill_worker_the_admit_named(pb, pki, test_model, server_factory):
    """A deployment member that knows a request id still cannot write its KV: the decode worker
    takes it only from the host the Admit named (kv_sender)."""
    decode = server_factory(test_model, *internal_flags(pki, "decode"), subcommand=("serve", "--role", "decode"))
    with grpc.secure_channel(decode.address, creds(pki.internal_ca, pki.roles["frontend"])) as ch:
        stub = pb.worker_grpc.DecodeWorkerStub(ch)
        load = stub.GetLoad(pb.worker.LoadRequest(), timeout=5)
        fingerprint, kv_dtype = load.model_fingerprint, load.kv_dtype

        def transfer(kv_sender):
            rid = os.urandom(16).hex()
            stub.Admit(pb.worker.AdmitRequest(request_id=rid, n_prompt_tokens=8, max_tokens=4, kv_sender=kv_sender,
                                              model_fingerprint=fingerprint), timeout=10)
            header = pb.worker.KvHeader(request_id=rid, model_fingerprint=fingerprint, dtype=kv_dtype, n_layers=2,
                                        n_kv_heads=2, head_dim=16, n_tokens=8, token_ids=PROMPT)
            try:
                stub.TransferKv(iter([pb.worker.KvMessage(header=header)]), timeout=10)
                return grpc.StatusCode.OK, ""
            except grpc.RpcError as e:
                return e.code(), e.details()
            finally:
                stub.Release(pb.worker.ReleaseRequest(request_id=rid), timeout=5)

        code, details = transfer("10.9.9.9:50051")  # another prefill worker's
        assert code == grpc.StatusCode.PERMISSION_DENIED and "not from the prefill worker" in details, details
        # The same bytes from the named host get past that check (and end on the missing chunks).
        code, details = transfer("127.0.0.1:50051")
        assert code != grpc.StatusCode.PERMISSION_DENIED, details



def test_under_mtls_kv_only_from_the_certificate_the_admit_named(pb, pki, test_model, server_factory):
    """Under mTLS the decode worker takes a request's KV from the peer proving the certificate the
    Admit named (kv_sender_certificate: what the prefill worker proved to the frontend), not from
    whoever connects from the prefill worker's host: another deployment member on that host, with
    a certificate of the same CA, is refused."""
    decode = server_factory(test_model, *internal_flags(pki, "decode"), subcommand=("serve", "--role", "decode"))
    prefill = server_factory(test_model, *internal_flags(pki, "prefill"), subcommand=("serve", "--role", "prefill"))
    # What the frontend learns of the prefill worker's certificate, in gRPC's own words: its
    # subject as the decode worker's refusal quotes it for the prefill worker's own connection.
    with grpc.secure_channel(decode.address, creds(pki.internal_ca, pki.roles["frontend"])) as ch:
        stub = pb.worker_grpc.DecodeWorkerStub(ch)
        load = stub.GetLoad(pb.worker.LoadRequest(), timeout=5)
        fingerprint, kv_dtype = load.model_fingerprint, load.kv_dtype

        def transfer(sender_leaf, certificate):
            rid = os.urandom(16).hex()
            stub.Admit(pb.worker.AdmitRequest(request_id=rid, n_prompt_tokens=8, max_tokens=4,
                                              kv_sender=prefill.address, kv_sender_certificate=certificate,
                                              model_fingerprint=fingerprint), timeout=10)
            header = pb.worker.KvHeader(request_id=rid, model_fingerprint=fingerprint, dtype=kv_dtype, n_layers=2,
                                        n_kv_heads=2, head_dim=16, n_tokens=8, token_ids=PROMPT)
            try:
                with grpc.secure_channel(decode.address, creds(pki.internal_ca, sender_leaf)) as sch:
                    pb.worker_grpc.DecodeWorkerStub(sch).TransferKv(iter([pb.worker.KvMessage(header=header)]),
                                                                    timeout=10)
                return grpc.StatusCode.OK, ""
            except grpc.RpcError as e:
                return e.code(), e.details()
            finally:
                stub.Release(pb.worker.ReleaseRequest(request_id=rid), timeout=5)

        # The insider connects from the prefill worker's host (loopback): the address check passed
        # it; the certificate check does not.
        code, details = transfer(pki.insider_b, "no-such-certificate")
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        assert "not the prefill worker's" in details, details
        proved = details.split("certificate '", 1)[1].split("'", 1)[0]  # the insider's subject, as gRPC words it
        assert "baton-other" in proved, details
        prefill_subject = proved.replace("baton-other", "baton-prefill")
        code, details = transfer(pki.insider_b, prefill_subject)
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        # The prefill worker's own certificate passes that check (and ends on the missing chunks).
        code, details = transfer(pki.roles["prefill"], prefill_subject)
        assert code != grpc.StatusCode.PERMISSION_DENIED, details

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


def test_a_release_attack_does_not_disturb_the_victim(pb, pki, baton_bin, slow_model, server_factory):
    """A deployment member of another identity (a valid internal certificate that is not the
    frontend's) that learned a victim's worker-facing id (here from the decode worker's log) calls
    Release and Stream for it again and again while the victim streams: PERMISSION_DENIED every
    time. Random ids get NOT_FOUND from Stream and OK from Release (an unknown id is ignored). The
    victim streams exactly the undisturbed tokens."""
    n = 48
    want = reference_ids(baton_bin, slow_model, PROMPT, n)
    front, _, decode = start_secure(pki, slow_model, server_factory, worker_flags=("--threads", "1"),
                                    decode_flags=("--log-level", "info"))
    mark = decode.log_mark()
    result = {}

    def victim():
        try:
            result["ids"] = tls_generate(pb, front.address, creds(pki.public_ca, pki.client), prompt_token_ids=PROMPT,
                                         max_tokens=n, ignore_eos=True)
        except grpc.RpcError as e:
            result["error"] = e

    thread = threading.Thread(target=victim, daemon=True)
    thread.start()
    rid = re.search(r"decode req=([0-9a-f]{32}) admitted", decode.wait_for_log(r"decode req=\S+ admitted", mark,
                                                                                timeout=60)).group(1)
    w = pb.worker
    denied = 0
    with grpc.secure_channel(decode.address, creds(pki.internal_ca, pki.insider_b)) as ch:
        stub = pb.worker_grpc.DecodeWorkerStub(ch)

        def code(fn):
            try:
                r = fn()
                if not hasattr(r, "ListFields"):
                    list(r)
                return grpc.StatusCode.OK
            except grpc.RpcError as e:
                return e.code()

        while True:
            got = (code(lambda: stub.Release(w.ReleaseRequest(request_id=rid), timeout=5)),
                   code(lambda: stub.Stream(w.StreamRequest(request_id=rid), timeout=5)))
            other = os.urandom(16).hex()
            assert code(lambda: stub.Release(w.ReleaseRequest(request_id=other), timeout=5)) == grpc.StatusCode.OK
            assert code(lambda: stub.Stream(w.StreamRequest(request_id=other), timeout=5)) == \
                grpc.StatusCode.NOT_FOUND
            if got != (grpc.StatusCode.PERMISSION_DENIED,) * 2:
                # Only once the victim's request is over on the decode worker is its id unknown there.
                decode.wait_for_log(rf"decode req={rid} finished", mark, timeout=5)
                assert got[1] == grpc.StatusCode.NOT_FOUND, got
                break
            denied += 1
    thread.join(timeout=120)
    assert "error" not in result, result["error"].details()
    assert result["ids"] == want
    assert denied >= 3, f"only {denied} attacks while the victim streamed: make it longer"
    print(f"{denied} rounds of Release + Stream for the victim's id were refused while it streamed")
    assert wait_blocks_free(decode)


def test_a_failed_request_shows_no_worker_id_or_address(pb, test_model, slow_model, server_factory):
    """What the client reads of a failure names the request by its own id and the workers by role;
    the worker-facing id and the addresses are in the frontend's log. Two failures, each with
    --max-failovers 0:
    - a KV hand-off the decode worker refuses (the prefill worker listens on 127.0.0.2, so its KV
      comes from another host than the Admit named): the workers' messages name the attempt id, the
      decode worker's address and the sender's IP;
    - a decode worker killed mid-stream: gRPC's message names the address it could not reach."""
    decode = server_factory(test_model, subcommand=("serve", "--role", "decode"))
    prefill = server_factory(test_model, subcommand=("serve", "--role", "prefill"), listen="127.0.0.2:0")
    prefill_address = f"127.0.0.2:{prefill.port}"
    front = server_factory(test_model, "--prefill-addresses", prefill_address, "--decode-addresses", decode.address,
                           "--max-failovers", "0", subcommand=("serve", "--role", "frontend"))
    mark = front.log_mark()
    with grpc.insecure_channel(front.address) as ch, pytest.raises(grpc.RpcError) as e:
        list(pb.gen_grpc.GenerationStub(ch).Generate(
            pb.gen.GenerateRequest(request_id="victim-1", prompt_token_ids=PROMPT, max_tokens=8), timeout=60))
    details = e.value.details()
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.PERMISSION_DENIED), details
    assert "victim-1" in details and "decode worker" in details, details
    assert not ATTEMPT_ID.search(details), details
    for address in (decode.address, prefill_address, "127.0.0."):
        assert address not in details, details
    logged = front.wait_for_log(re.escape(decode.address) + ".*not from the prefill worker", mark)
    assert ATTEMPT_ID.search(logged) and prefill_address in logged, logged

    # A decode worker killed while it streams.
    decode = server_factory(slow_model, "--threads", "1", subcommand=("serve", "--role", "decode"))
    prefill = server_factory(slow_model, "--threads", "1", subcommand=("serve", "--role", "prefill"))
    front = server_factory(slow_model, "--prefill-addresses", prefill.address, "--decode-addresses", decode.address,
                           "--max-failovers", "0", subcommand=("serve", "--role", "frontend"))
    mark = front.log_mark()
    stream = Stream(pb, front.address, PROMPT, 900)
    deadline = time.monotonic() + 60
    while len(stream.ids) < 5:
        assert time.monotonic() < deadline and stream.error is None and stream.final is None
        time.sleep(0.005)
    decode.proc.kill()
    stream.join()
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE, stream.error
    details = stream.error.details()
    assert "decode worker" in details, details
    assert not ATTEMPT_ID.search(details), details
    for address in (decode.address, f":{decode.port}", prefill.address, "127.0.0."):
        assert address not in details, details
    print("the client reads:", details)
    logged = front.wait_for_log(r"failed \(decode\)", mark)
    assert ATTEMPT_ID.search(logged) and decode.address in logged, logged


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


def replace_file(src, dst):
    """Swaps `dst` for a copy of `src` by rename, as a Secret volume update does."""
    tmp = dst.with_suffix(dst.suffix + ".new")
    tmp.write_bytes(src.read_bytes())
    os.replace(tmp, dst)


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
