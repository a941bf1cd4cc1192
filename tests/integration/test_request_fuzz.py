"""A bounded request fuzzer against a live `baton local` frontend on the random test model.

Requests go through a generic unary-stream call on /baton.v1.Generation/Generate with identity
serializers, so the fuzzer writes the protobuf wire format itself (WireMessage below) and can send
what no well-behaved client would: out-of-range int32 varints, NaN / infinite / denormal floats,
random Unicode, invalid UTF-8 in string fields, packed and unpacked repeated fields, duplicated
fields, known fields with the wrong wire type, unknown fields of every wire type, deeply nested
groups, truncated or overlong encodings, and plain garbage. Most requests parse and about a fifth
are valid, so the pipeline past validation (prefill, KV hand-off, decode, stop strings, sampling)
is reached too; a few are cancelled by the client mid-stream.

Asserted for every request:
  * the call ends OK or with a status in ALLOWED (the client's fault, named as such), never
    UNKNOWN, INTERNAL, UNIMPLEMENTED, UNAVAILABLE, ... (CANCELLED only where the fuzzer cancelled);
  * a non-OK status has a message, and a short one (< 1 KB): it must not echo unbounded input
    (past 16 KiB encoded, the client cannot even receive it and reports a RESOURCE_EXHAUSTED of its
    own, which is caught as such);
  * an OK stream parses as GenerateResponse messages and ends with `final`, whose
    usage.completion_tokens equals the tokens streamed;
  * the server process is still alive.
After the random requests: every decode KV block is free again and a plain request still works.

The seed corpus (fuzz_corpus/*.bin, raw serialized requests; fuzz_corpus/README.md says what each
is) is replayed first, one test case per file. Then random requests for BATON_FUZZ_SECONDS
(default 20) seconds from a random seed, printed; BATON_FUZZ_SEED=<seed> replays the same sequence
(the time bound may end it at another point). One input of each kind of finding is written to the
test's tmp dir and printed (hex when short): copy it into fuzz_corpus/ to keep it.
`python test_request_fuzz.py --write-corpus` rewrites the hand-picked part of the corpus.
"""

from __future__ import annotations

import collections
import math
import os
import random
import re
import struct
import sys
import time
from pathlib import Path

import grpc
import pytest

from serving_harness import Server, wait_blocks_free

CORPUS = Path(__file__).resolve().parent / "fuzz_corpus"
METHOD = "/baton.v1.Generation/Generate"
# The client's fault, each named: PERMISSION_DENIED is a priority above --max-priority.
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.PERMISSION_DENIED}
MAX_MESSAGE_BYTES = 1024
# Seed-corpus entries with one right answer: a client string the refusal quotes (the model name,
# a chat role) is refused as such, whatever its size, never with a status too long for the client
# to receive (which it reports as RESOURCE_EXHAUSTED).
ECHOED = ("model_name_5000_bytes", "model_name_3000_two_byte_chars", "chat_role_5000_bytes", "model_name_15000_bytes",
          "model_name_8000_two_byte_chars", "chat_role_15000_bytes")
EXPECTED = {name: {grpc.StatusCode.INVALID_ARGUMENT} for name in ECHOED}
CALL_TIMEOUT = 60  # s; the longest valid request (1024 tokens on the test model) takes ~1 s
VOCAB = 275  # the test model's (conftest.test_model)
CTX = 1024

# ---- the protobuf wire format ------------------------------------------------------------------

VARINT, I64, LEN, SGROUP, EGROUP, I32 = 0, 1, 2, 3, 4, 5


def varint(n: int) -> bytes:
    """Base-128 varint of n as protobuf writes int32/int64/uint64 (negatives: 64-bit two's
    complement, 10 bytes)."""
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def key(field: int, wire_type: int) -> bytes:
    return varint((field << 3) | wire_type)


class WireMessage:
    """A message as a list of encoded fields, in order, so fields can be duplicated, reordered,
    mistyped or unknown."""

    def __init__(self):
        self.fields: list[bytes] = []

    def varint(self, field, n):
        self.fields.append(key(field, VARINT) + varint(n))
        return self

    def f32(self, field, x=None, raw=None):
        self.fields.append(key(field, I32) + (raw if raw is not None else struct.pack("<f", x)))
        return self

    def bytes(self, field, b):
        self.fields.append(key(field, LEN) + varint(len(b)) + b)
        return self

    def string(self, field, s):
        return self.bytes(field, s if isinstance(s, bytes) else s.encode("utf-8", "surrogatepass"))

    def message(self, field, m):
        return self.bytes(field, m.serialize())

    def packed_varints(self, field, values):
        return self.bytes(field, b"".join(varint(v) for v in values))

    def serialize(self) -> bytes:
        return b"".join(self.fields)


# GenerateRequest (proto/baton/v1/generate.proto): 1 request_id, 2 model, 3 prompt,
# 4 prompt_token_ids (repeated int32), 5 messages (ChatMessage: 1 role, 2 content), 6 sampling
# (SamplingParams: 1 temperature float, 2 top_k int32, 3 top_p optional float, 4 seed uint64),
# 7 max_tokens int32, 8 stop (repeated string), 9 ignore_eos bool, 10 priority int32.
REQUEST_ID, MODEL, PROMPT, PROMPT_IDS, MESSAGES, SAMPLING, MAX_TOKENS, STOP, IGNORE_EOS, PRIORITY = range(1, 11)


def request(prompt_ids=None, prompt=None, max_tokens=None, **sampling):
    m = WireMessage()
    if prompt_ids is not None:
        m.packed_varints(PROMPT_IDS, prompt_ids)
    if prompt is not None:
        m.string(PROMPT, prompt)
    if max_tokens is not None:
        m.varint(MAX_TOKENS, max_tokens)
    if sampling:
        s = WireMessage()
        for name, (field, kind) in {"temperature": (1, "f"), "top_k": (2, "v"), "top_p": (3, "f"),
                                    "seed": (4, "v")}.items():
            if name in sampling and kind == "f":
                s.f32(field, sampling[name])
            elif name in sampling:
                s.varint(field, sampling[name])
        m.message(SAMPLING, s)
    return m


# ---- random values -----------------------------------------------------------------------------

INTS = [0, 1, -1, 2, 3, 7, 16, 100, 255, 256, VOCAB - 1, VOCAB, VOCAB + 1, CTX - 1, CTX, CTX + 1, 4096,
        2**31 - 1, -2**31, 2**31, 2**32 - 1, 2**32, 2**32 + 5, 2**63 - 1, -2**63, 2**64 - 1]
FLOATS = [0.0, -0.0, 1.0, 0.5, 0.7, 1.5, 2.0, -1.0, 1e-45, 1e-38, 1e-7, 1e38, 3.4028234e38, math.inf, -math.inf,
          math.nan, 0.9999999, 1.0000001]
BAD_UTF8 = [b"\xff", b"\xfe\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xe2\x82", b"\xf4\x90\x80\x80", b"\x80",
            b"abc\xffdef", b"\xf0\x9f\x98"]
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>\n", "\x00", "\r\n",
           " the", "\u202e", "e\u0301", "🍕", "中文", "\ufeff", "\U0010ffff"]


class Fuzzer:
    """Random requests from one seed: the same seed gives the same sequence."""

    def __init__(self, seed: int):
        self.r = random.Random(seed)
        self.bad_utf8 = False

    def int_(self, lo=-5, hi=2000):
        r = self.r
        return r.choice(INTS) if r.random() < 0.5 else r.randint(lo, hi)

    def float_(self):
        r = self.r
        x = r.random()
        if x < 0.5:
            return r.choice(FLOATS), None
        if x < 0.6:  # a NaN with random payload bits
            return None, struct.pack("<I", 0x7F800001 | r.getrandbits(22) | (r.getrandbits(1) << 31))
        return r.uniform(-3, 3), None

    def text(self, max_len=40) -> bytes:
        """A string field's bytes; invalid UTF-8 only in requests picked for it (self.bad_utf8):
        the parser refuses the whole request for one bad string, so it would hide the rest."""
        r = self.r
        x = r.random()
        if self.bad_utf8 and x < 0.3:
            if x < 0.1:  # lone surrogates
                return "".join(chr(r.randint(0xD800, 0xDFFF)) for _ in range(r.randint(1, 3))).encode(
                    "utf-8", "surrogatepass")
            if x < 0.2:
                return r.choice(BAD_UTF8) + b"x" * r.randint(0, 5) + r.choice(BAD_UTF8)
            return bytes(r.getrandbits(8) for _ in range(r.randint(1, max_len)))
        if x < 0.4:
            return b"" if x < 0.05 else "".join(r.choice("abcdefghij klmnop.,!?\n")
                                                 for _ in range(r.randint(1, max_len))).encode()
        if x < 0.6:
            return "".join(r.choice(SPECIAL) for _ in range(r.randint(1, 4))).encode()
        if x < 0.9:  # any code point but the surrogates
            cps = [r.choice([r.randint(0, 0x7F), r.randint(0x80, 0x7FF), r.randint(0x800, 0xD7FF),
                             r.randint(0xE000, 0xFFFF), r.randint(0x10000, 0x10FFFF)])
                   for _ in range(r.randint(1, max_len))]
            return "".join(map(chr, cps)).encode()
        return r.choice([b"a", "é".encode(), "🍕".encode()]) * r.choice([129, 300, 1500, 5000, 70000])

    def token_ids(self):
        r = self.r
        n = r.choice([0, 1, 2, r.randint(3, 40), r.randint(3, 40), r.randint(40, 300), CTX - 1, CTX, CTX + 5,
                      r.choice([5000, 100000, 300000])] if r.random() < 0.3 else [r.randint(1, 40)])
        if r.random() < 0.8:
            return [r.randrange(VOCAB) for _ in range(n)]
        return [r.choice([r.randrange(VOCAB), self.int_()]) for _ in range(n)]

    def chat_message(self):
        r = self.r
        m = WireMessage()
        if r.random() < 0.9:
            m.string(1, r.choice(["user", "system", "assistant"]).encode() if r.random() < 0.7 else self.text())
        if r.random() < 0.9:
            m.string(2, self.text())
        if r.random() < 0.1:
            self.unknown_field(m)
        return m

    def sampling(self):
        r = self.r
        s = WireMessage()
        if r.random() < 0.6:
            x, raw = self.float_() if r.random() < 0.5 else (r.choice([0.0, 0.7, 1.0]), None)
            s.f32(1, x, raw)
        if r.random() < 0.4:
            s.varint(2, self.int_(-2, 300) if r.random() < 0.5 else r.randint(0, 50))
        if r.random() < 0.4:
            x, raw = self.float_() if r.random() < 0.5 else (r.choice([0.5, 0.9, 1.0]), None)
            s.f32(3, x, raw)
        if r.random() < 0.4:
            s.varint(4, r.getrandbits(64))
        if r.random() < 0.1:
            self.unknown_field(s)
        return s

    def unknown_field(self, m: WireMessage, depth=0):
        r = self.r
        field = r.choice([11, 12, 15, 16, 100, 2047, 19000, 2**29 - 1, r.randint(11, 2**29 - 1)])
        wt = r.choice([VARINT, I64, LEN, I32, SGROUP])
        if wt == VARINT:
            m.fields.append(key(field, VARINT) + varint(r.getrandbits(64)))
        elif wt == I64:
            m.fields.append(key(field, I64) + r.randbytes(8))
        elif wt == I32:
            m.fields.append(key(field, I32) + r.randbytes(4))
        elif wt == LEN:
            m.bytes(field, self.text(20))
        else:
            inner = WireMessage()
            if depth < 3:
                self.unknown_field(inner, depth + 1)
            m.fields.append(key(field, SGROUP) + inner.serialize() + key(field, EGROUP))

    def structured(self) -> WireMessage:
        """A GenerateRequest field by field: mostly plausible, every field sometimes extreme."""
        r = self.r
        self.bad_utf8 = r.random() < 0.1
        m = WireMessage()
        if r.random() < 0.2:
            m.string(REQUEST_ID, self.text() if r.random() < 0.7 else b"fuzz-" + str(r.randrange(100)).encode())
        if r.random() < 0.1:
            m.string(MODEL, self.text())
        forms = r.choices([["ids"], ["prompt"], ["messages"], [], ["ids", "prompt"], ["prompt", "messages"]],
                          weights=[40, 20, 15, 10, 8, 7])[0]
        if "ids" in forms:
            ids = self.token_ids()
            if r.random() < 0.7:
                m.packed_varints(PROMPT_IDS, ids)
            else:  # unpacked, as a proto2 writer would
                for i in ids:
                    m.varint(PROMPT_IDS, i)
        if "prompt" in forms:
            m.string(PROMPT, self.text())
        if "messages" in forms:
            for _ in range(r.choice([1, 1, 2, 3, 20])):
                m.message(MESSAGES, self.chat_message())
        if r.random() < 0.5:
            m.message(SAMPLING, self.sampling())
        if r.random() < 0.95:
            m.varint(MAX_TOKENS, r.randint(1, 12) if r.random() < 0.7 else self.int_(-3, CTX + 3))
        if r.random() < 0.2:
            for _ in range(r.choice([1, 2, 5, 17])):
                m.string(STOP, self.text(8) if r.random() < 0.9 else self.text(400))
        if r.random() < 0.5:
            m.varint(IGNORE_EOS, r.choice([0, 1, 1, 2, 2**64 - 1]))
        if r.random() < 0.2:
            m.varint(PRIORITY, self.int_())
        if r.random() < 0.2:  # fields in any order
            r.shuffle(m.fields)
        return m

    def mutate(self, data: bytes, m: WireMessage) -> bytes:
        """One damage at the wire level."""
        r = self.r
        kind = r.randrange(9)
        if kind == 0:  # unknown fields
            for _ in range(r.randint(1, 4)):
                self.unknown_field(m)
            return m.serialize()
        if kind == 1 and m.fields:  # a field repeated (scalars: last wins; messages merge)
            m.fields.append(r.choice(m.fields))
            return m.serialize()
        if kind == 2:  # a known field with another wire type
            field = r.randint(1, 10)
            m.fields.append(r.choice([key(field, VARINT) + varint(r.getrandbits(64)),
                                      key(field, I32) + r.randbytes(4), key(field, I64) + r.randbytes(8),
                                      key(field, LEN) + varint(3) + b"abc"]))
            return m.serialize()
        if kind == 3 and data:  # truncated
            return data[: r.randrange(len(data))]
        if kind == 4 and data:  # bytes flipped
            b = bytearray(data)
            for _ in range(r.randint(1, 4)):
                b[r.randrange(len(b))] = r.getrandbits(8)
            return bytes(b)
        if kind == 5:  # nested groups past the parser's recursion limit
            depth = r.choice([50, 101, 1000])
            return data + key(11, SGROUP) * depth + key(11, EGROUP) * depth
        if kind == 6:  # an overlong varint, a length past the end, field number 0
            return data + r.choice([key(MAX_TOKENS, VARINT) + b"\xff" * 11, key(PROMPT, LEN) + varint(1000) + b"ab",
                                    key(0, VARINT) + b"\x01", key(MAX_TOKENS, VARINT) + b"\x80" * 9 + b"\x02"])
        if kind == 7:  # garbage
            return r.randbytes(r.randint(0, 200))
        # a string field of invalid UTF-8
        return data + key(r.choice([REQUEST_ID, MODEL, PROMPT, STOP]), LEN) + varint(2) + b"\xc3\x28"

    def next_request(self):
        """(serialized bytes, cancel after the first message?)."""
        m = self.structured()
        data = m.serialize()
        if self.r.random() < 0.35:
            data = self.mutate(data, m)
        return data, self.r.random() < 0.05


# ---- the seed corpus ---------------------------------------------------------------------------


def seed_corpus() -> dict[str, bytes]:
    """name -> serialized request: cases picked by hand (fuzz_corpus/README.md says why)."""
    valid = request(prompt_ids=[5, 6, 7], max_tokens=4)
    corpus = {
        "valid_ids": valid.serialize(),
        "empty": b"",
        "valid_with_unknown_fields": valid.serialize() + key(11, VARINT) + varint(2**64 - 1) + key(12, I64) + bytes(8)
        + key(13, LEN) + varint(3) + b"\xff\xfe\xfd" + key(14, SGROUP) + key(1, VARINT) + b"\x01" + key(14, EGROUP)
        + key(15, I32) + bytes(4),
        "unpacked_ids": WireMessage().varint(PROMPT_IDS, 5).varint(PROMPT_IDS, 6).varint(MAX_TOKENS, 3).serialize(),
        "negative_id_10_byte_varint": request(prompt_ids=[5, -1], max_tokens=4).serialize(),
        "int32_overflow_id": request(prompt_ids=[5, 2**32 + 6], max_tokens=4).serialize(),
        "max_tokens_int_max": request(prompt_ids=[5], max_tokens=2**31 - 1).serialize(),
        "max_tokens_int_min": request(prompt_ids=[5], max_tokens=-2**31).serialize(),
        "temperature_nan": request(prompt="hi", max_tokens=4, temperature=math.nan).serialize(),
        "temperature_inf": request(prompt="hi", max_tokens=4, temperature=math.inf).serialize(),
        "temperature_denormal": request(prompt_ids=[5, 6], max_tokens=8, temperature=1e-45).serialize(),
        "temperature_huge": request(prompt_ids=[5, 6], max_tokens=8, temperature=3.4e38, top_k=0).serialize(),
        "top_p_denormal": request(prompt_ids=[5, 6], max_tokens=8, temperature=0.7, top_p=1e-45).serialize(),
        "top_p_nan": request(prompt="hi", max_tokens=4, temperature=0.7, top_p=math.nan).serialize(),
        "top_k_negative": request(prompt="hi", max_tokens=4, temperature=0.7, top_k=-1).serialize(),
        "prompt_invalid_utf8": request(prompt=b"hi \xff\xfe there", max_tokens=4).serialize(),
        "prompt_lone_surrogate": request(prompt="\ud800x", max_tokens=4).serialize(),
        "stop_invalid_utf8": request(prompt_ids=[5, 6], max_tokens=4).string(STOP, b"\xe2\x82").serialize(),
        "request_id_unicode": request(prompt_ids=[5], max_tokens=2).string(REQUEST_ID, "réq 🍕").serialize(),
        "model_name_5000_bytes": request(prompt="hi", max_tokens=4).string(MODEL, "m" * 5000).serialize(),
        "model_name_3000_two_byte_chars": request(prompt="hi", max_tokens=4).string(MODEL, "é" * 3000).serialize(),
        "chat_role_5000_bytes": WireMessage().message(MESSAGES, WireMessage().string(1, "r" * 5000).string(2, "hi"))
        .varint(MAX_TOKENS, 4).serialize(),
        "model_name_15000_bytes": request(prompt="hi", max_tokens=4).string(MODEL, "m" * 15000).serialize(),
        "model_name_8000_two_byte_chars": request(prompt="hi", max_tokens=4).string(MODEL, "é" * 8000).serialize(),
        "chat_role_15000_bytes": WireMessage().message(MESSAGES, WireMessage().string(1, "r" * 15000).string(2, "hi"))
        .varint(MAX_TOKENS, 4).serialize(),
        "prompt_ids_over_context": request(prompt_ids=[5] * (CTX + 1), max_tokens=1).serialize(),
        "max_tokens_as_string": request(prompt_ids=[5]).bytes(MAX_TOKENS, b"abc").serialize(),
        "truncated_length": key(PROMPT, LEN) + varint(100) + b"hi",
        "overlong_varint": key(MAX_TOKENS, VARINT) + b"\xff" * 11,
        "field_number_zero": key(0, VARINT) + b"\x01",
        "groups_1000_deep": valid.serialize() + key(11, SGROUP) * 1000 + key(11, EGROUP) * 1000,
        "garbage": bytes(range(256)),
    }
    return corpus


def write_corpus() -> None:
    CORPUS.mkdir(exist_ok=True)
    for name, data in seed_corpus().items():
        (CORPUS / f"{name}.bin").write_bytes(data)


# ---- the test ----------------------------------------------------------------------------------


def _identity(b):
    return b


def check_one(generate, data: bytes, cancel: bool, pb, allowed=ALLOWED):
    """Sends one request. Returns (the status code's name, None if the call behaved, else (kind,
    description)): `kind` groups findings that are the same bug (status and what was wrong).
    `allowed`: the statuses other than OK that are a right answer."""
    t0 = time.monotonic()
    call = generate(data, timeout=CALL_TIMEOUT)
    msgs = []
    try:
        for raw in call:
            msgs.append(raw)
            if cancel:
                call.cancel()
                break
        code, details = call.code(), call.details()
    except grpc.RpcError as e:
        code, details = e.code(), e.details()
    elapsed = time.monotonic() - t0
    details = details or ""
    return code.name, _finding(code, details, elapsed, msgs, cancel, pb, allowed)


def _finding(code, details, elapsed, msgs, cancel, pb, allowed):
    if cancel and msgs:
        return None if code == grpc.StatusCode.CANCELLED else (f"cancel {code.name}", f"cancelled call ended {code}")
    if code == grpc.StatusCode.OK:
        try:
            resps = [pb.gen.GenerateResponse.FromString(raw) for raw in msgs]
        except Exception as e:  # noqa: BLE001 - any parse failure is the finding
            return "OK unparsable", f"OK stream does not parse as GenerateResponse: {e}"
        if not resps or not resps[-1].HasField("final"):
            return "OK no final", f"OK stream of {len(resps)} messages without a final message"
        n = sum(len(m.token_ids) for m in resps)
        if n != resps[-1].final.usage.completion_tokens:
            return "OK usage", f"OK stream: {n} tokens streamed, usage says {resps[-1].final.usage.completion_tokens}"
        return None
    if code not in allowed:
        return f"status {code.name}", f"status {code.name} after {elapsed:.1f} s, message {details[:300]!r}"
    if details.startswith("Stream removed") or "exceeds hard limit" in details:
        # Not the server's status: the client's gRPC refused the trailers (a status message over
        # its 16 KiB metadata limit, once percent-encoded) and made up RESOURCE_EXHAUSTED.
        return "trailers refused", f"the client could not receive the status: {code.name} {details!r}"
    if not details:
        return f"{code.name} empty", f"status {code.name} with an empty message"
    if len(details.encode()) >= MAX_MESSAGE_BYTES:
        return (f"{code.name} long " + re.sub(r"\d+", "N", details.split("'")[0][:40]),
                f"status {code.name} with a {len(details.encode())}-byte message: {details[:120]!r}...")
    return None


@pytest.fixture(scope="module")
def fuzz_server(baton_bin, test_model):
    s = Server(baton_bin, test_model)
    yield s
    s.stop_clean()


@pytest.fixture(scope="module")
def generate(fuzz_server):
    """The Generate method of `fuzz_server`, bytes in, bytes out."""
    with grpc.insecure_channel(fuzz_server.address) as ch:
        yield ch.unary_stream(METHOD, request_serializer=_identity, response_deserializer=_identity)


@pytest.mark.parametrize("path", sorted(CORPUS.glob("*.bin")), ids=lambda p: p.stem)
def test_corpus_request_gets_a_clean_status(pb, fuzz_server, generate, path):
    """Each seed-corpus input, alone: the same assertions as for the random requests below (and
    only its status where EXPECTED names one)."""
    _, finding = check_one(generate, path.read_bytes(), False, pb, EXPECTED.get(path.stem, ALLOWED))
    assert fuzz_server.proc.poll() is None, f"the server died on {path.name}: {list(fuzz_server.stderr_tail)[-20:]}"
    assert finding is None, f"{path.name}: {finding[1]}"


def test_random_requests_get_a_clean_status(pb, fuzz_server, generate, tmp_path):
    """Random requests for BATON_FUZZ_SECONDS; one example of each kind of finding is reported."""
    seconds = float(os.environ.get("BATON_FUZZ_SECONDS", "20"))
    seed = int(os.environ.get("BATON_FUZZ_SEED", random.randrange(1 << 31)))
    print(f"fuzz seed {seed} (BATON_FUZZ_SEED={seed} replays it), {seconds:g} s")
    srv = fuzz_server
    findings = {}  # kind -> the first input that showed it, described
    outcomes = collections.Counter()
    fuzzer = Fuzzer(seed)
    n, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        data, cancel = fuzzer.next_request()
        code, finding = check_one(generate, data, cancel, pb)
        outcomes[code] += 1
        if finding and finding[0] not in findings:
            path = tmp_path / f"seed{seed}-request{n}.bin"
            path.write_bytes(data)
            hexed = f", {data.hex()}" if len(data) <= 200 else ""
            findings[finding[0]] = f"request {n} ({path}, {len(data)} bytes{hexed}): {finding[1]}"
        assert srv.proc.poll() is None, (
            f"the server died on request {n} of seed {seed} ({data[:200].hex()}): {list(srv.stderr_tail)[-20:]}")
        n += 1
    print(f"{n} random requests ({dict(outcomes.most_common())}), {len(findings)} kinds of finding")

    problems = list(findings.values())
    if not wait_blocks_free(srv, timeout=30):
        problems.append("decode KV blocks did not return to the total after the fuzzing")
    with grpc.insecure_channel(srv.address) as ch:
        msgs = list(pb.gen_grpc.GenerationStub(ch).Generate(
            pb.gen.GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=8, ignore_eos=True), timeout=60))
    if sum(len(m.token_ids) for m in msgs) != 8 or msgs[-1].final.usage.completion_tokens != 8:
        problems.append(f"a plain request after the fuzzing did not get its 8 tokens: {msgs}")
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-corpus"]:
        write_corpus()
        print(f"wrote {len(seed_corpus())} files to {CORPUS}")
    else:
        sys.exit("usage: test_request_fuzz.py --write-corpus")
