"""Hostile peers: what a broken or hostile prefill worker or frontend could send a worker, straight
to its RPCs over loopback (the clients' side is test_hostile_clients.py, whose deployment, checks
and bounds this file shares: a refusal within the time bound, every process alive with bounded
RSS, a normal request served after).
  i. a forged KV hand-off straight to a decode worker's TransferKv (the tcp transport): headers
     announcing 2**31 layers, negative or huge token counts, overflowing shapes, chunks that do not
     match the header, huge strings, for a probe (no Admit) and for a request admitted from here;
     Admits with counts out of range and megabyte names (a worker's refusal here may be any
     input-error status, and must stay small enough to travel as one).
"""

import random
import struct
import time

import grpc
import pytest

import test_hostile_clients as hc
from test_hostile_clients import HEAD_DIM, N_KV_HEADS, N_LAYERS, MB, Reply, _identity, decode_load, hostile, protos, split, worker_call  # noqa: F401
from test_request_fuzz import varint

# ---- i. a forged KV hand-off ---------------------------------------------------------------------------------

def kv_header(extra_raw=b"", **fields):
    """A KvMessage{header} as bytes; `extra_raw` is appended to the header's own bytes (a later
    value of a scalar field wins, so a field can be given a value its Python type refuses)."""
    h = hc.PB.worker.KvHeader(**fields).SerializeToString() + extra_raw
    return b"\x0a" + varint(len(h)) + h


def kv_chunk(layer, token_start, token_count, k, v, checksum=None):
    c = hc.PB.worker.KvLayerChunk(layer=layer, token_start=token_start, token_count=token_count, k=k, v=v,
                               checksum=kv_checksum(k, v) if checksum is None else checksum)
    return hc.PB.worker.KvMessage(chunk=c).SerializeToString()


def kv_end(first_token=0):
    return hc.PB.worker.KvMessage(end=hc.PB.worker.KvEnd(first_token=first_token)).SerializeToString()


def kv_checksum(k, v):
    """kv/kv_transfer.cpp: FNV-1a 64 over the 8-byte little-endian words of k then v, tail bytes singly."""
    h = 1469598103934665603
    mask = (1 << 64) - 1
    for s in (k, v):
        n = len(s) // 8
        for (w,) in struct.iter_unpack("<Q", s[:8 * n]):
            h = ((h ^ w) * 1099511628211) & mask
        for b in s[8 * n:]:
            h = ((h ^ b) * 1099511628211) & mask
    return h


def transfer_kv(address, messages, timeout=10):
    t0 = time.monotonic()
    try:
        with grpc.insecure_channel(address) as ch:
            call = ch.stream_unary("/baton.v1.DecodeWorker/TransferKv", request_serializer=_identity,
                                   response_deserializer=hc.PB.worker.KvAck.FromString)
            ack = call(iter(messages), timeout=timeout)
        return Reply("KV", grpc.StatusCode.OK, f"ack {ack.bytes} bytes", time.monotonic() - t0)
    except grpc.RpcError as e:
        return Reply("KV", e.code(), e.details() or "", time.monotonic() - t0)


KV_REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
               grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.PERMISSION_DENIED,
               grpc.StatusCode.OUT_OF_RANGE)


def test_i_a_valid_probe_transfer_is_accepted(protos, split):
    """The control: a well-formed probe (KvHeader.probe, no Admit) of the model's shape is taken,
    so the refusals below are the receiver's checks and not a malformed harness."""
    split.ensure_up()
    load = decode_load(split)
    row = N_KV_HEADS * HEAD_DIM * (4 if load.kv_dtype == "f32" else 2)
    n = 3
    msgs = [kv_header(request_id="probe-control", model_fingerprint=load.model_fingerprint, dtype=load.kv_dtype,
                      n_layers=N_LAYERS, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM, n_tokens=n, token_ids=[0] * n,
                      probe=True)]
    for layer in range(N_LAYERS):
        k, v = bytes(range(256)) * (n * row // 256 + 1), bytes(reversed(range(256))) * (n * row // 256 + 1)
        msgs.append(kv_chunk(layer, 0, n, k[:n * row], v[:n * row]))
    msgs.append(kv_end(0))
    r = transfer_kv(split.servers["decode-0"].address, msgs)
    assert r.status == grpc.StatusCode.OK, f"a valid probe is refused: {r!r}"


class KvForge:
    """Builds the messages of a forged transfer: the header's fields default to the model's (a
    probe of one token, which needs no Admit), `row` is one token's K (or V) bytes."""

    def __init__(self, load, request_id="hostile-kv", n_tokens=1, token_ids=(0,), probe=True):
        self.fields = dict(request_id=request_id, model_fingerprint=load.model_fingerprint, dtype=load.kv_dtype,
                           n_layers=N_LAYERS, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM, n_tokens=n_tokens,
                           token_ids=list(token_ids), probe=probe)
        self.row = N_KV_HEADS * HEAD_DIM * (4 if load.kv_dtype == "f32" else 2)
        self.k, self.v = b"\x01" * self.row, b"\x02" * self.row

    def header(self, extra_raw=b"", **over):
        return kv_header(extra_raw, **{**self.fields, **over})

    def chunk(self, layer=0, start=0, count=1, k=None, v=None, **kw):
        return kv_chunk(layer, start, count, self.k * count if k is None else k, self.v * count if v is None else v,
                        **kw)

    def all_layers(self, count=1):
        return [self.chunk(layer, 0, count) for layer in range(N_LAYERS)]


# Forged transfers to a decode worker, no Admit (KvHeader.probe, or a request nobody admitted).
KV_CASES = {
    "header: n_layers = 2**31 - 1": lambda f: [f.header(n_layers=2 ** 31 - 1), kv_end()],
    "header: n_layers = 2**31 - 1, not a probe": lambda f: [f.header(n_layers=2 ** 31 - 1, probe=False), kv_end()],
    "header: n_layers = 2**31 on the wire": lambda f: [f.header(b"\x20" + varint(2 ** 31)), kv_end()],
    "header: n_layers = 2**32 - 1 on the wire": lambda f: [f.header(b"\x20" + varint(2 ** 32 - 1)), kv_end()],
    "header: n_layers = -1": lambda f: [f.header(n_layers=-1), kv_end()],
    "header: n_tokens = -5": lambda f: [f.header(n_tokens=-5), kv_end()],
    "header: n_tokens = 2**31 - 1, one token id": lambda f: [f.header(n_tokens=2 ** 31 - 1), kv_end()],
    "header: n_tokens = 2**31 on the wire": lambda f: [f.header(b"\x38" + varint(2 ** 31)), kv_end()],
    "header: n_tokens = 300,000 with as many ids": lambda f: [f.header(n_tokens=300_000, token_ids=[0] * 300_000),
                                                              kv_end()],
    "header: n_kv_heads = head_dim = 2**31 - 1": lambda f: [f.header(n_kv_heads=2 ** 31 - 1, head_dim=2 ** 31 - 1),
                                                           kv_end()],
    "header: every count 2**31 - 1": lambda f: [f.header(n_layers=2 ** 31 - 1, n_kv_heads=2 ** 31 - 1,
                                                         head_dim=2 ** 31 - 1, n_tokens=2 ** 31 - 1), kv_end()],
    "header: dtype 1 MB long": lambda f: [f.header(dtype="x" * MB), kv_end()],
    "header: request_id 1 MB long, not a probe": lambda f: [f.header(request_id="r" * MB, probe=False), kv_end()],
    "header: model_fingerprint 1 MB long": lambda f: [f.header(model_fingerprint="m" * MB), kv_end()],
    "header: token id 2**31 - 1": lambda f: [f.header(token_ids=[2 ** 31 - 1], probe=False), kv_end()],
    "two headers": lambda f: [f.header(), f.header(n_layers=2 ** 31 - 1), kv_end()],
    "a chunk before the header": lambda f: [f.chunk(), kv_end()],
    "an end alone": lambda f: [kv_end()],
    "chunk: layer 2**31 - 1": lambda f: [f.header(), f.chunk(layer=2 ** 31 - 1), kv_end()],
    "chunk: layer -1": lambda f: [f.header(), f.chunk(layer=-1), kv_end()],
    "chunk: token_count -1": lambda f: [f.header(), f.chunk(count=-1, k=f.k, v=f.v), kv_end()],
    "chunk: token_start 2**31 - 1": lambda f: [f.header(), f.chunk(start=2 ** 31 - 1), kv_end()],
    "chunk: token_count 2**31 - 1": lambda f: [f.header(), f.chunk(count=2 ** 31 - 1, k=f.k, v=f.v), kv_end()],
    "chunk: K 3 MB for one token": lambda f: [f.header(), f.chunk(k=b"\0" * (3 * MB)), kv_end()],
    "chunk: no bytes": lambda f: [f.header(), f.chunk(k=b"", v=b""), kv_end()],
    "chunk: checksum wrong": lambda f: [f.header(), f.chunk(checksum=12345), kv_end()],
    "chunk: the same layer twice": lambda f: [f.header(), f.chunk(), f.chunk(), kv_end()],
    "layers missing at the end": lambda f: [f.header(), f.chunk(), kv_end()],
    "a message after the end": lambda f: [f.header(), *f.all_layers(), kv_end(), f.chunk()],
    "an empty KvMessage": lambda f: [b""],
    "garbage bytes": lambda f: [b"\xff" * 64],
}


@pytest.mark.parametrize("name", list(KV_CASES))
def test_i_a_forged_kv_stream_is_refused(protos, split, name):
    split.ensure_up()
    msgs = KV_CASES[name](KvForge(decode_load(split)))
    addr = split.servers["decode-0"].address
    hostile(split, f"KV {name}", lambda: transfer_kv(addr, msgs), refusal=KV_REFUSALS)


ADMITS = {
    "n_prompt_tokens = max_tokens = 2**31 - 1": dict(n_prompt_tokens=2 ** 31 - 1, max_tokens=2 ** 31 - 1),
    "n_prompt_tokens = -5": dict(n_prompt_tokens=-5, max_tokens=4),
    "max_tokens = -2**31": dict(n_prompt_tokens=4, max_tokens=-2 ** 31),
    "n_forks = 2**31 - 1": dict(n_prompt_tokens=4, max_tokens=4, n_forks=2 ** 31 - 1),
    "n_output_tokens = 2**31 - 1": dict(n_prompt_tokens=4, max_tokens=4, n_output_tokens=2 ** 31 - 1),
    "prefill_token_ids 300,000 long": dict(n_prompt_tokens=300_000, max_tokens=4, prefill_token_ids=[1] * 300_000),
    "fork_of 1 MB long": dict(n_prompt_tokens=4, max_tokens=4, fork_of="f" * MB),
    "kv_sender 1 MB long": dict(n_prompt_tokens=4, max_tokens=4, kv_sender="s" * MB),
}


@pytest.mark.parametrize("name", list(ADMITS))
def test_i_hostile_admits_are_refused(protos, split, name):
    """What a frontend sends before the KV, forged: counts out of range, huge strings. (An
    unresolvable kv_sender is UNAVAILABLE by design.)"""
    split.ensure_up()
    W = hc.PB.worker
    addr = split.servers["decode-1"].address
    rid = f"hostile-admit-{random.randrange(1 << 30)}"
    req = W.AdmitRequest(request_id=rid, model_fingerprint=decode_load(split).model_fingerprint, **ADMITS[name])
    refusal = KV_REFUSALS + ((grpc.StatusCode.UNAVAILABLE,) if "kv_sender" in name else ())
    r = hostile(split, f"Admit {name}", lambda: worker_call(addr, "Admit", req, W.AdmitResponse), refusal=refusal)
    if r.served:
        worker_call(addr, "Release", W.ReleaseRequest(request_id=rid), W.ReleaseResponse)


# Forged KV for a request admitted from here (4 prompt tokens): header fields to change, and the
# chunks to send before the end.
ADMITTED_KV = {
    "n_tokens differs from the admission": (dict(n_tokens=1, token_ids=[5]), lambda f: []),
    "n_layers = 2**31 - 1": (dict(n_layers=2 ** 31 - 1), lambda f: []),
    "chunk: 2 tokens of bytes for 1": ({}, lambda f: [f.chunk(count=1, k=f.k * 2, v=f.v * 2)]),
    "chunk: past n_tokens": ({}, lambda f: [f.chunk(start=3, count=2)]),
    "chunk: layer 2": ({}, lambda f: [f.chunk(layer=N_LAYERS, count=4)]),
    "end: first token 2**31 - 1": ({}, lambda f: f.all_layers(4)),
    "end: first token -1": ({}, lambda f: f.all_layers(4)),
}


@pytest.mark.parametrize("name", list(ADMITTED_KV))
def test_i_a_forged_kv_stream_for_an_admitted_request_is_refused(protos, split, name):
    """Admitted from here (as a frontend would), then the KV forged: the reservation's checks
    (token counts, shapes, chunks, the first token) refuse it."""
    split.ensure_up()
    load = decode_load(split)
    W = hc.PB.worker
    addr = split.servers["decode-1"].address
    rid = f"hostile-kv-{random.randrange(1 << 30)}"
    admit = worker_call(addr, "Admit", W.AdmitRequest(request_id=rid, n_prompt_tokens=4, max_tokens=4,
                                                      model_fingerprint=load.model_fingerprint), W.AdmitResponse,
                        timeout=20)
    assert admit.status == grpc.StatusCode.OK, f"Admit of a well-formed request: {admit!r}"
    over, chunks = ADMITTED_KV[name]
    f = KvForge(load, request_id=rid, n_tokens=4, token_ids=[5, 6, 7, 8], probe=False)
    first = {"end: first token 2**31 - 1": 2 ** 31 - 1, "end: first token -1": -1}.get(name, 0)
    msgs = [f.header(**over), *chunks(f), kv_end(first)]
    try:
        hostile(split, f"admitted KV {name}", lambda: transfer_kv(addr, msgs), refusal=KV_REFUSALS)
    finally:
        worker_call(addr, "Release", W.ReleaseRequest(request_id=rid), W.ReleaseResponse)
