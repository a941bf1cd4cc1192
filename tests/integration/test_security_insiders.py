"""Deployment members against each other (issue: security), between real `baton serve` processes
(conftest's pki fixture makes their certificates with `openssl`):
- Stream and Release of a decode reservation are honoured only from the peer that admitted it,
  and its KV only from the prefill worker the Admit named (by address, and under mutual TLS by
  certificate); a member of another identity that learned a streaming victim's worker-facing id
  and calls Release and Stream for it disturbs nothing;
- a failed request's status names it by the client's id and the workers by role: the
  worker-facing id and the workers' addresses stay in the frontend's log.
Transport security, API keys and secure defaults are in test_security.py."""

import os
import re
import threading
import time

import grpc
import pytest

from serving_harness import (PROMPT, Stream, creds, internal_flags, make_test_model, start_secure, tls_generate,
                             wait_blocks_free)
from test_serving import reference_ids

ATTEMPT_ID = re.compile(r"\b[0-9a-f]{32}\b")  # a worker-facing request id (random_request_id)


@pytest.fixture(scope="module")
def slow_model(baton_bin, tmp_path_factory):
    """A random model large enough that a stream lasts a while on one thread (4 layers, width 512)."""
    return make_test_model(baton_bin, tmp_path_factory.mktemp("slow") / "model.gguf", seed=13, layers=4, dim=512,
                           heads=8, kv_heads=4, ffn=1536, ctx=1024)


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
