"""Hostile clients: one request must never bring baton down.

Every case sends requests built to hurt (JSON nested hundreds of thousands of levels deep, $ref
chains thousands long, cyclic schemas, huge enums and anyOfs, counted limits past their bounds,
invalid UTF-8, choices and log-probabilities at their maxima, a forged KV stream) to real
processes on loopback, and asserts for each request:
  1. the refusal is an HTTP 4xx (OpenAI API) or a gRPC INVALID_ARGUMENT / RESOURCE_EXHAUSTED whose
     message names the field or the limit (loose keywords, never an exact message), unless the
     case also accepts a served request; the refusal does not echo the payload (a status too large
     to send reaches the client as gRPC's own "Stream removed", not the server's refusal);
  2. the answer comes back in under 2 s (wall time of the request);
  3. every server process is still alive, and its resident memory grew by under 500 MB over the
     request, at the end and at its peak (VmHWM, reset through /proc/PID/clear_refs before each
     request; for `baton serve` every role's process is watched);
  4. a normal small request (HTTP and gRPC) succeeds right after.

The hostile payloads are built iteratively, by string concatenation: Python's json.dumps recurses
and cannot write them. Cases:
  a. a response_format schema that is a $ref chain 4,500 long through $defs (400);
  b. an assistant message whose tool_calls arguments hold JSON nested 250,000 deep (400);
  c. gRPC json_schema nested 200,000 deep, through items and through a const (INVALID_ARGUMENT);
  d. a schema with 20,000 optional properties, HTTP and gRPC: a refusal naming a limit, or served;
  e. cyclic and left-recursive schemas, a $ref to nothing, a $ref chain of 200: refused or served;
  f. n, logprobs and top_logprobs at and over their maxima;
  g. a fresh random set each run (the seed is in every assertion's message): deep nesting in
     random fields, huge enums, wide anyOfs, long $ref chains, counted limits at and past 1024,
     invalid UTF-8;
  h. the schema cases on `baton serve` (frontend + prefill + 2 decode workers): every worker
     survives, and the refusal is an input error, not a failover (no 503 / UNAVAILABLE, no
     baton_request_failovers_total increase); the same schemas sent straight to a decode worker's
     Admit and a prefill worker's Prefill;
  i. (the forged KV stream and hostile Admits, straight to the workers: test_hostile_peers.py);

The processes are shared by the module (one `baton local`, one `baton serve` deployment); a case
that kills one restarts it for the next case, so that each case reports its own outcome.
"""

import http.client
import json
import os
import random
import re
import struct
import time
import urllib.parse

import grpc
import pytest

from serving_harness import HTTP, Server, metric_values

MB = 1 << 20
RSS_BOUND = 500 * MB
# Under ASan (scripts/sanitize.sh) every step is slower: the bound scales as the hang tests' do.
TIME_BOUND = 2.0 * float(os.environ.get("BATON_TEST_TIME_SCALE", "1"))
PROMPT = [5, 17, 99, 3]  # token ids of the test model (275 byte-level tokens)
# The test model's KV shape (conftest.test_model: 2 layers, width 64, 4 heads, 2 KV heads).
N_LAYERS, N_KV_HEADS, HEAD_DIM = 2, 2, 16
WORKER_FLAGS = ("--threads", "1", "--prefill-nice", "0")

GRPC_REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
# Words a refusal names a limit with.
LIMIT = r"deep|depth|nest|level|limit|at most|too |exceed|large|long|many|max|most|bound|size|bytes"
SCHEMA = r"response_format|schema|\$ref|\$defs"


# ---- processes, memory ---------------------------------------------------------------------------

def proc_status(pid):
    """(VmRSS, VmHWM) of the process in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out.get("VmRSS", 0), out.get("VmHWM", 0)


def dying(pid):
    """The process is exiting or dumping core (PF_EXITING, PF_DUMPCORE in /proc/PID/stat's flags):
    a crash that has not ended the process yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[6]) & (0x4 | 0x200) != 0  # flags: the 9th field, the 7th after the name
    except (OSError, IndexError, ValueError):
        return False


def reset_peak(pid):
    """Resets the process's VmHWM to its current RSS (Linux >= 4.0); False where it cannot."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Deployment:
    """`baton local` (split=False) or `baton serve`: frontend + prefill + decode-0 + decode-1."""

    def __init__(self, baton_bin, model, split):
        self.baton_bin, self.model, self.split = baton_bin, model, split
        self.servers = {}
        self.restarts = 0
        self._start()

    def _start(self):
        b, m = self.baton_bin, self.model
        if not self.split:
            self.servers = {"local": Server(b, m, *HTTP)}
        else:
            d0 = Server(b, m, *WORKER_FLAGS, subcommand=("serve", "--role", "decode"))
            d1 = Server(b, m, *WORKER_FLAGS, subcommand=("serve", "--role", "decode"))
            p = Server(b, m, *WORKER_FLAGS, subcommand=("serve", "--role", "prefill"))
            f = Server(b, m, "--prefill-addresses", p.address, "--decode-addresses", f"{d0.address},{d1.address}",
                       *HTTP, subcommand=("serve", "--role", "frontend"))
            self.servers = {"decode-0": d0, "decode-1": d1, "prefill": p, "frontend": f}
        # The frontend connects to its workers in the background: wait until it serves.
        deadline = time.time() + 60
        while True:
            problems = self.health_problems()
            if not problems:
                return
            assert time.time() < deadline, f"the deployment does not serve: {problems}"
            time.sleep(0.2)

    @property
    def front(self):
        return self.servers["frontend" if self.split else "local"]

    def dead(self):
        return {n: s.proc.returncode for n, s in self.servers.items() if s.proc.poll() is not None}

    def ensure_up(self):
        """Restarts every process if one died in an earlier case."""
        if self.dead():
            for s in reversed(list(self.servers.values())):
                s.stop()
            self.restarts += 1
            self._start()

    def stop(self):
        problems = []
        for name, s in reversed(list(self.servers.items())):
            if s.proc.poll() is not None:
                continue  # died in a case, which reported it
            try:
                s.stop_clean()
            except AssertionError as e:
                problems.append(f"{name}: {e}")
        assert not problems, "\n\n".join(problems)

    # -- memory --
    def mark(self):
        marks = {}
        for name, s in self.servers.items():
            assert s.proc.poll() is None, f"{name} is dead before the case (exit {s.proc.returncode})"
            rss, _ = proc_status(s.proc.pid)
            marks[name] = (rss, reset_peak(s.proc.pid))
        return marks

    def observe(self, marks, wait_for_death):
        """{name: (exit status or None, RSS growth, peak growth or None)}. Where the request failed
        at the transport, a dying process gets a second to be reaped."""
        if wait_for_death:
            deadline = time.time() + 1.0
            while time.time() < deadline and not self.dead():
                time.sleep(0.05)
        out = {}
        for name, s in self.servers.items():
            if s.proc.poll() is None and dying(s.proc.pid):
                try:
                    s.proc.wait(timeout=30)  # a core dump may take a while
                except Exception:
                    pass
            rc = s.proc.poll()
            if rc is not None:
                out[name] = (rc, None, None)
                continue
            try:
                rss, hwm = proc_status(s.proc.pid)
            except OSError:
                out[name] = (s.proc.wait(timeout=5), None, None)
                continue
            rss0, peak_ok = marks[name]
            out[name] = (None, rss - rss0, hwm - rss0 if peak_ok else None)
        return out

    # -- a normal request --
    def health_problems(self):
        problems = []
        r = http_post(self.front.http_url, "/v1/completions",
                      json.dumps({"prompt": PROMPT, "max_tokens": 2, "temperature": 0}), timeout=30)
        if r.status != 200:
            problems.append(f"HTTP completion: {r}")
        g = grpc_generate(self.front.address, generate_request(prompt_token_ids=PROMPT, max_tokens=2,
                                                               ignore_eos=True), timeout=30)
        if g.status != grpc.StatusCode.OK:
            problems.append(f"gRPC Generate: {g}")
        return problems

    def failovers(self):
        return sum(metric_values(self.front.metrics(), "baton_request_failovers_total").values())


@pytest.fixture(scope="module")
def local(baton_bin, test_model, protos):
    d = Deployment(baton_bin, test_model, split=False)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def split(baton_bin, test_model, protos):
    d = Deployment(baton_bin, test_model, split=True)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def protos(pb):
    """The generated modules, kept where the helpers below (which take no fixtures) reach them."""
    global PB
    PB = pb
    return pb


PB = None


# ---- requests --------------------------------------------------------------------------------------

class Reply:
    def __init__(self, kind, status, message, took, served_detail=""):
        self.kind, self.status, self.message, self.took, self.served_detail = kind, status, message, took, served_detail

    @property
    def transport_failed(self):
        return self.status is None or self.status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN,
                                                      grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED)

    @property
    def served(self):
        return self.status in (200, grpc.StatusCode.OK)

    def __repr__(self):
        status = self.status.name if isinstance(self.status, grpc.StatusCode) else self.status
        return f"{self.kind} {status} in {self.took:.2f} s: {self.message[:300]!r}"


def http_post(base_url, path, body, timeout=30):
    u = urllib.parse.urlsplit(base_url)
    if isinstance(body, str):
        body = body.encode("utf-8", "surrogatepass")
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.monotonic()
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        took = time.monotonic() - t0
        try:
            message = json.loads(data)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = "" if r.status == 200 else data[:500].decode("utf-8", "replace")
        return Reply("HTTP", r.status, message, took)
    except (OSError, http.client.HTTPException) as e:
        return Reply("HTTP", None, f"{type(e).__name__}: {e}", time.monotonic() - t0)
    finally:
        conn.close()


def _identity(b):
    return b


def grpc_generate(address, request, timeout=30):
    """Generate with `request` (a GenerateRequest or its bytes), every message read."""
    raw = request if isinstance(request, bytes) else request.SerializeToString()
    t0 = time.monotonic()
    n_tokens = 0
    try:
        with grpc.insecure_channel(address) as ch:
            call = ch.unary_stream("/baton.v1.Generation/Generate", request_serializer=_identity,
                                   response_deserializer=PB.gen.GenerateResponse.FromString)
            for m in call(raw, timeout=timeout):
                n_tokens += len(m.token_ids)
        return Reply("gRPC", grpc.StatusCode.OK, "", time.monotonic() - t0, f"{n_tokens} tokens")
    except grpc.RpcError as e:
        return Reply("gRPC", e.code(), e.details() or "", time.monotonic() - t0)


def generate_request(schema=None, **fields):
    req = PB.gen.GenerateRequest(**fields)
    if schema is not None:
        req.sampling.response_format.type = PB.gen.ResponseFormat.JSON_SCHEMA
        req.sampling.response_format.json_schema = schema
    return req


def schema_grpc(schema_text, max_tokens=4):
    return generate_request(schema_text, prompt_token_ids=PROMPT, max_tokens=max_tokens)


def chat_body(schema_text=None, max_tokens=4, **extra):
    """A chat completion body; `schema_text` (JSON text, any depth) goes in as response_format's schema."""
    body = {"model": "test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "temperature": 0, **extra}
    if schema_text is None:
        return json.dumps(body)
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": "@@SCHEMA@@"}}
    return json.dumps(body).replace('"@@SCHEMA@@"', schema_text)


def with_raw(body_obj, **raw):
    """json.dumps(body_obj) with each "@@NAME@@" string replaced by raw[NAME] (JSON text of any depth)."""
    text = json.dumps(body_obj)
    for name, value in raw.items():
        text = text.replace(f'"@@{name}@@"', value)
    return text


def ref_chain(n, tail=None):
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n - 1)}
    defs[f"d{n - 1}"] = tail if tail is not None else {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def deep_objects(n, inner="1"):
    return '{"a":' * n + inner + "}" * n


# ---- the checks -------------------------------------------------------------------------------------

def hostile(dep, what, send, refusal=GRPC_REFUSALS, words=None, may_serve=False, http_ok=range(400, 499),
            input_error=False):
    """Sends one hostile request (send() -> Reply) to `dep` and checks the four properties.
    `words`: a regex the refusal's message must match (case-insensitive). `may_serve`: a served
    request is fine too. `input_error` (the split deployment): the refusal is INVALID_ARGUMENT /
    400 and the frontend failed nothing over."""
    dep.ensure_up()
    marks = dep.mark()
    failovers0 = dep.failovers() if dep.split else None
    reply = send()
    seen = dep.observe(marks, wait_for_death=reply.transport_failed)

    def fmt(v):
        return "-" if v is None else f"{v / MB:+.0f} MB"

    procs = "; ".join(f"{n}: {'alive' if rc is None else f'DIED (exit {rc})'} RSS {fmt(d)} peak {fmt(p)}"
                      for n, (rc, d, p) in seen.items())
    desc = f"{what}: {reply!r}; {procs}"
    print(desc)  # shown with -s, and for a failed test
    dead = {n: rc for n, (rc, _, _) in seen.items() if rc is not None}
    if dead:
        tails = {n: list(dep.servers[n].stderr_tail)[-8:] for n in dead}
        pytest.fail(f"process died: {desc}; last output {tails}")
    for n, (_, grew, peak) in seen.items():
        assert grew < RSS_BOUND, f"{n} RSS grew {grew / MB:.0f} MB: {desc}"
        assert peak is None or peak < RSS_BOUND, f"{n} peak RSS grew {peak / MB:.0f} MB: {desc}"
    if reply.served:
        assert may_serve, f"served, where a refusal was expected: {desc}"
    elif reply.kind == "HTTP":
        assert reply.status is not None and reply.status in http_ok, f"not a 4xx refusal: {desc}"
        if input_error:
            assert reply.status == 400, f"not an input error (400): {desc}"
    else:
        assert reply.status in refusal, f"not a refusal ({'/'.join(c.name for c in refusal)}): {desc}"
        if input_error:
            assert reply.status == grpc.StatusCode.INVALID_ARGUMENT, f"not an input error: {desc}"
    if not reply.served:
        if words:
            assert re.search(words, reply.message, re.I), f"the refusal does not name /{words}/: {desc}"
        assert len(reply.message) < 4096, f"the refusal echoes the payload ({len(reply.message)} chars): {desc}"
        assert not re.search(r"attempts|no worker", reply.message, re.I), f"a failover, not a refusal: {desc}"
        # gRPC's own status when the server's refusal was too large to send (it echoed a payload).
        assert not re.search(r"Stream removed|metadata size", reply.message), f"not the server's refusal: {desc}"
    assert reply.took < TIME_BOUND, f"took {reply.took:.2f} s: {desc}"
    if failovers0 is not None:
        assert dep.failovers() == failovers0, f"the frontend failed the request over: {desc}"
    problems = dep.health_problems()
    assert not problems, f"a normal request fails after {what}: {problems}; {desc}"
    # A worker that crashed after the answer (the frontend had what it needed) dies by now.
    late = {n: rc for n, (rc, _, _) in dep.observe(marks, wait_for_death=False).items() if rc is not None}
    assert not late, f"process died after the answer: {late}; {desc}"
    return reply


def http_case(dep, what, body, path="/v1/chat/completions", **kw):
    return hostile(dep, what, lambda: http_post(dep.front.http_url, path, body), **kw)


def grpc_case(dep, what, request, **kw):
    return hostile(dep, what, lambda: grpc_generate(dep.front.address, request), **kw)


# ---- a. a $ref chain 4,500 long -------------------------------------------------------------------

REF_CHAIN_4500 = json.dumps(ref_chain(4500))


def test_a_ref_chain_4500_long(protos, local):
    http_case(local, "HTTP schema: $ref chain of 4,500", chat_body(REF_CHAIN_4500), http_ok=(400,),
              words=SCHEMA + "|" + LIMIT + "|chain")
    grpc_case(local, "gRPC schema: $ref chain of 4,500", schema_grpc(REF_CHAIN_4500),
              refusal=(grpc.StatusCode.INVALID_ARGUMENT,), words=SCHEMA + "|" + LIMIT + "|chain")


# ---- b. tool call arguments nested 250,000 deep -------------------------------------------------------

def deep_arguments_body(depth):
    args = deep_objects(depth)
    body = {"model": "test", "max_tokens": 4,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"a": {}}}}}],
            "messages": [
                {"role": "user", "content": "call f"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "@@ARGS@@"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"},
                {"role": "user", "content": "thanks"}]}
    return with_raw(body, ARGS=json.dumps(args))


def test_b_tool_call_arguments_nested_250000_deep(protos, local):
    body = deep_arguments_body(250_000)
    assert len(body) < 4 * MB - 4096  # under --max-message-bytes: the body reaches the parser
    http_case(local, "tool_calls[0].function.arguments nested 250,000 deep", body, http_ok=(400,),
              words=r"arguments|tool_calls|" + LIMIT)


# ---- c. gRPC json_schema nested 200,000 deep -----------------------------------------------------------

DEEP_ITEMS = '{"items":' * 200_000 + "{}" + "}" * 200_000
DEEP_CONST = '{"const":' + "[" * 200_000 + "]" * 200_000 + "}"


@pytest.mark.parametrize("variant", ["items", "const"])
def test_c_grpc_schema_nested_200000_deep(protos, local, variant):
    schema = DEEP_ITEMS if variant == "items" else DEEP_CONST
    grpc_case(local, f"gRPC json_schema, {variant} nested 200,000 deep", schema_grpc(schema),
              refusal=(grpc.StatusCode.INVALID_ARGUMENT,), words=SCHEMA + "|" + LIMIT)


# ---- d. 20,000 optional properties -------------------------------------------------------------------

WIDE_OBJECT = json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}})


def test_d_twenty_thousand_optional_properties(protos, local):
    words = r"propert|" + SCHEMA + "|" + LIMIT
    http_case(local, "HTTP schema: 20,000 optional properties", chat_body(WIDE_OBJECT), may_serve=True, words=words)
    grpc_case(local, "gRPC schema: 20,000 optional properties", schema_grpc(WIDE_OBJECT), may_serve=True, words=words)


# ---- e. cyclic schemas, a missing target, a moderate chain ------------------------------------------------

CYCLIC = {
    "left-recursive anyOf": json.dumps({"anyOf": [{"$ref": "#"}, {"type": "null"}]}),
    "$ref to itself": json.dumps({"$ref": "#"}),
    "$ref to nothing": json.dumps({"$ref": "#/$defs/missing", "$defs": {"there": {"type": "null"}}}),
    "$ref chain of 200": json.dumps(ref_chain(200)),
    "$defs cycle": json.dumps({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
    "items of itself": json.dumps({"type": "array", "items": {"$ref": "#"}, "minItems": 1}),
}
CYCLE_WORDS = SCHEMA + r"|recurs|cycl|loop|itself|finite|nothing|" + LIMIT


@pytest.mark.parametrize("name", list(CYCLIC))
def test_e_cyclic_and_dangling_schemas(protos, local, name):
    http_case(local, f"HTTP schema: {name}", chat_body(CYCLIC[name]), may_serve=True, words=CYCLE_WORDS)
    grpc_case(local, f"gRPC schema: {name}", schema_grpc(CYCLIC[name]), may_serve=True, words=CYCLE_WORDS)


# ---- f. choices and log-probabilities at and over their maxima -----------------------------------------

def test_f_choices_and_logprobs_over_their_maxima_are_refused(protos, local):
    chat = "/v1/chat/completions"
    cmpl = "/v1/completions"
    for what, path, body, words in [
            ("n = 65", chat, chat_body(n=65), r"\bn\b|choices|64"),
            ("n = 2**31", chat, chat_body(n=2 ** 31), r"\bn\b|choices|int"),
            ("n = 10**30", chat, chat_body(n=10 ** 30), r"\bn\b|choices|int"),
            ("n = 0", chat, chat_body(n=0), r"\bn\b"),
            ("top_logprobs = 21", chat, chat_body(logprobs=True, top_logprobs=21), r"top_logprobs"),
            ("top_logprobs = 2**31", chat, chat_body(logprobs=True, top_logprobs=2 ** 31), r"top_logprobs"),
            ("top_logprobs = -1", chat, chat_body(logprobs=True, top_logprobs=-1), r"top_logprobs"),
            ("completions logprobs = 6", cmpl, json.dumps({"prompt": PROMPT, "max_tokens": 2, "logprobs": 6}),
             r"logprobs"),
            ("65 prompts", cmpl, json.dumps({"prompt": [PROMPT] * 65, "max_tokens": 2}), r"prompt|choices|64"),
            ("8 prompts x n = 9", cmpl, json.dumps({"prompt": [PROMPT] * 8, "n": 9, "max_tokens": 2}),
             r"\bn\b|prompt|choices|64"),
            ("max_tokens = 2**31 - 1", chat, chat_body(max_tokens=2 ** 31 - 1), r"max_tokens|context"),
            ("max_tokens = 2**40", chat, chat_body(max_tokens=2 ** 40), r"max_tokens"),
    ]:
        http_case(local, f"HTTP {what}", body, path=path, words=words)
    for what, sampling, words in [("top_logprobs = 21", dict(top_logprobs=21), r"top_logprobs"),
                                  ("top_logprobs = 2**31 - 1", dict(top_logprobs=2 ** 31 - 1), r"top_logprobs"),
                                  ("top_logprobs = -2**31", dict(top_logprobs=-2 ** 31), r"top_logprobs")]:
        req = generate_request(prompt_token_ids=PROMPT, max_tokens=2)
        for k, v in sampling.items():
            setattr(req.sampling, k, v)
        grpc_case(local, f"gRPC {what}", req, words=words)
    grpc_case(local, "gRPC max_tokens = 2**31 - 1", generate_request(prompt_token_ids=PROMPT, max_tokens=2 ** 31 - 1),
              words=r"max_tokens|context")


def first_bytes_then_all(base_url, path, body, timeout=120):
    """Streams a request: (seconds to the status line, status, seconds to the end, the SSE text)."""
    u = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.monotonic()
    try:
        conn.request("POST", path, body=body.encode(), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        first = time.monotonic() - t0
        data = r.read().decode("utf-8", "replace")
        return first, r.status, time.monotonic() - t0, data
    except (OSError, http.client.HTTPException) as e:
        return time.monotonic() - t0, None, time.monotonic() - t0, f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def test_f_choices_and_logprobs_at_their_maxima(protos, local):
    """At the limits: 64 choices, each the rest of the 1024-token context, with 20 alternatives per
    token. Served (the answer starts within 2 s and completes) or refused by admission (4xx), never
    a crash; memory bounded."""
    cases = [
        ("chat n = 64, max_tokens = rest of context, top_logprobs = 20", "/v1/chat/completions",
         json.dumps({"model": "test", "messages": [{"role": "user", "content": "hi"}], "n": 64, "logprobs": True,
                     "top_logprobs": 20, "temperature": 1.0, "stream": True})),
        ("completions 8 prompts x n = 8, max_tokens = 1000, logprobs = 5", "/v1/completions",
         json.dumps({"prompt": [PROMPT] * 8, "n": 8, "max_tokens": 1000, "logprobs": 5, "temperature": 1.0,
                     "stream": True})),
    ]
    for what, path, body in cases:
        local.ensure_up()
        marks = local.mark()
        first, status, total, text = first_bytes_then_all(local.front.http_url, path, body)
        seen = local.observe(marks, wait_for_death=status is None)
        desc = f"{what}: status {status}, first bytes {first:.2f} s, whole {total:.2f} s, {text[-300:]!r}; {seen}"
        print(desc)
        assert all(rc is None for rc, _, _ in seen.values()), f"process died: {desc}"
        for n, (_, grew, peak) in seen.items():
            assert grew < RSS_BOUND and (peak is None or peak < RSS_BOUND), f"{n} memory: {desc}"
        assert status is not None and (status == 200 or 400 <= status < 499), desc
        assert first < TIME_BOUND, f"no answer within {TIME_BOUND} s: {desc}"
        if status == 200:
            assert "data: [DONE]" in text and '"error"' not in text, f"the stream did not complete: {desc}"
        assert not local.health_problems(), desc
    # gRPC: top_logprobs 20 for the rest of the context.
    req = generate_request(prompt_token_ids=PROMPT, max_tokens=1024 - len(PROMPT), ignore_eos=True)
    req.sampling.top_logprobs = 20
    local.ensure_up()
    marks = local.mark()
    r = grpc_generate(local.front.address, req, timeout=120)
    seen = local.observe(marks, wait_for_death=r.transport_failed)
    desc = f"gRPC top_logprobs = 20, max_tokens = {req.max_tokens}: {r!r} {r.served_detail}; {seen}"
    print(desc)
    assert all(rc is None for rc, _, _ in seen.values()), f"process died: {desc}"
    for n, (_, grew, peak) in seen.items():
        assert grew < RSS_BOUND and (peak is None or peak < RSS_BOUND), f"{n} memory: {desc}"
    assert r.status in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED), desc
    assert not local.health_problems(), desc


# ---- g. a fresh random set each run ----------------------------------------------------------------------

def random_nesting(rng, depth, inner="1"):
    """JSON text nested `depth` levels deep, each level an array or an object, drawn at random."""
    kinds = [rng.randrange(2) for _ in range(depth)]
    return ("".join('{"k":' if k else "[" for k in kinds) + inner +
            "".join("}" if k else "]" for k in reversed(kinds)))


SCHEMA_LEVELS = [('{"items":', "}"), ('{"anyOf":[', "]}"), ('{"properties":{"a":', "}}"),
                 ('{"additionalProperties":', "}"), ('{"type":"object","properties":{"x":', "}}")]


def random_schema_nesting(rng, depth, budget=3_800_000):
    """A schema nested `depth` levels deep through random keywords (fewer where the text would pass
    `budget` bytes: the request must stay under the 4 MiB message limit to reach the parser)."""
    levels, size = [], 0
    for _ in range(depth):
        level = rng.choice(SCHEMA_LEVELS)
        size += len(level[0]) + len(level[1])
        if size > budget:
            break
        levels.append(level)
    return "".join(o for o, _ in levels) + '{"type":"null"}' + "".join(c for _, c in reversed(levels))


def random_words(rng, n):
    return [f"w{rng.randrange(1 << 30):x}" for _ in range(n)]


def counted_limit(rng):
    v = rng.choice([1024, 1025, 4096, 2 ** 31, 2 ** 63, 10 ** 30, -1])
    kind = rng.randrange(3)
    if kind == 0:
        return {"type": "string", "maxLength": v, "minLength": min(max(v, 0), rng.choice([0, 1024]))}
    if kind == 1:
        return {"type": "array", "items": {"type": "integer"}, "maxItems": v, "minItems": rng.choice([0, 1, 1024])}
    # Counted limits nested inside one another.
    s = {"type": "string", "maxLength": 1024}
    for _ in range(rng.randrange(2, 7)):
        s = {"type": "array", "items": s, "maxItems": 1024}
    return s


def random_schema_text(rng):
    """(name, schema as JSON text): something a schema compiler must bound."""
    k = rng.randrange(6)
    if k == 0:
        d = rng.randrange(1000, 300_001)
        text = random_schema_nesting(rng, d)
        return f"schema nested {text.count('{')} deep", text
    if k == 1:
        n = rng.randrange(10_000, 100_001)
        return f"enum of {n}", json.dumps({"enum": random_words(rng, n)})
    if k == 2:
        n = rng.randrange(2_000, 20_001)
        return f"anyOf of {n}", json.dumps({"anyOf": [{"const": w} for w in random_words(rng, n)]})
    if k == 3:
        n = rng.randrange(1_000, 10_001)
        return f"$ref chain of {n}", json.dumps(ref_chain(n))
    if k == 4:
        s = counted_limit(rng)
        return f"counted limits {json.dumps(s)[:80]}", json.dumps(s)
    n = rng.randrange(1_000, 20_001)
    return f"{n} properties, all required", json.dumps({"type": "object", "required": [f"p{i}" for i in range(n)],
                                                        "properties": {f"p{i}": {"type": "string"} for i in range(n)}})


BAD_UTF8 = ["\\ud800", "\\udfff\\ud800", "\\uZZZZ", "\\u12", "\\x41", "\udcff"]


def random_case(rng):
    """(what, kind 'http' | 'grpc', path, payload) of one random hostile request."""
    k = rng.randrange(10)
    d = rng.randrange(1000, 300_001)
    base = {"model": "test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    chat = "/v1/chat/completions"
    if k == 0:
        body = with_raw({**base, "messages": [{"role": "user", "content": "@@DEEP@@"}]},
                        DEEP=random_nesting(rng, d, '{"type":"text","text":"x"}'))
        return f"messages[0].content nested {d} deep", "http", chat, body
    if k == 1:
        body = with_raw({**base, "tools": [{"type": "function", "function": {"name": "f", "parameters": "@@DEEP@@"}}],
                         "tool_choice": rng.choice(["auto", "required"])},
                        DEEP=random_nesting(rng, d, "{}"))
        return f"tools[0].function.parameters nested {d} deep", "http", chat, body
    if k == 2:
        text = random_schema_nesting(rng, d)
        if rng.random() < 0.5:  # the gRPC field reaches the schema's own parser, not the body's
            return f"gRPC json_schema nested {text.count('{')} deep", "grpc", None, schema_grpc(text)
        return f"response_format schema nested {text.count('{')} deep", "http", chat, chat_body(text)
    if k == 3:
        args = json.dumps(random_nesting(rng, d))
        body = with_raw({**base, "messages": [
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                  "function": {"name": "f", "arguments": "@@ARGS@@"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "1"}, {"role": "user", "content": "ok"}],
            "tools": [{"type": "function", "function": {"name": "f"}}]}, ARGS=args)
        return f"tool_calls arguments nested {d} deep", "http", chat, body
    if k == 4:
        if rng.random() < 0.5:
            body = with_raw({**base, "logit_bias": "@@DEEP@@"}, DEEP=random_nesting(rng, d))
            return f"logit_bias nested {d} deep", "http", chat, body
        n = rng.randrange(10_000, 100_001)
        body = json.dumps({**base, "logit_bias": {str(rng.randrange(-2 ** 40, 2 ** 40)): 100 for _ in range(n)}})
        return f"logit_bias with {n} keys", "http", chat, body
    if k == 5:
        if rng.random() < 0.5:
            body = with_raw({**base, "stop": "@@DEEP@@"}, DEEP=random_nesting(rng, d, '"x"'))
            return f"stop nested {d} deep", "http", chat, body
        n = rng.randrange(10_000, 100_001)
        if rng.random() < 0.5:
            return f"stop list of {n}", "http", chat, json.dumps({**base, "stop": random_words(rng, n)})
        return f"gRPC stop list of {n}", "grpc", None, generate_request(prompt_token_ids=PROMPT, max_tokens=4,
                                                                        stop=random_words(rng, n))
    if k == 6:
        bad = rng.choice(BAD_UTF8)
        where = rng.choice(["content", "role", "model", "stop", "schema key"])
        body = json.dumps({**base, "messages": [{"role": "user", "content": "@@C@@"}]})
        if where == "content":
            body = body.replace('"@@C@@"', f'"a{bad}b"')
        elif where == "role":
            body = body.replace('"role": "user"', f'"role": "us{bad}er"').replace('"@@C@@"', '"x"')
        elif where == "model":
            body = body.replace('"model": "test"', f'"model": "te{bad}st"').replace('"@@C@@"', '"x"')
        elif where == "stop":
            body = body.replace('"@@C@@"', '"x"')[:-1] + f', "stop": ["{bad}"]}}'
        else:
            body = chat_body('{"type":"object","properties":{"k' + bad + '":{"type":"string"}}}')
        raw = body.encode("utf-8", "surrogateescape") if bad == "\udcff" else body.encode()
        return f"invalid UTF-8 {bad!r} in {where}", "http", chat, raw
    # 7-9: a schema in a random place.
    name, schema = random_schema_text(rng)
    place = rng.choice(["response_format", "forced tool call", "gRPC"])
    if place == "response_format":
        return f"response_format: {name}", "http", chat, chat_body(schema)
    if place == "forced tool call":
        body = with_raw({**base, "tools": [{"type": "function", "function": {"name": "f", "parameters": "@@S@@"}}],
                         "tool_choice": {"type": "function", "function": {"name": "f"}}}, S=schema)
        return f"forced tool call parameters: {name}", "http", chat, body
    return f"gRPC json_schema: {name}", "grpc", None, schema_grpc(schema)


def test_g_a_fresh_random_set(protos, local):
    seed = random.randrange(1 << 30)
    print(f"hostile set seed {seed}")
    rng = random.Random(seed)
    words = (r"messages|content|role|model|tools|parameters|arguments|tool_calls|logit_bias|stop|prompt|UTF|utf-8|"
             r"JSON|escape|surrogate|enum|anyOf|propert|required|maxLength|maxItems|minLength|minItems|integer|"
             r"not supported|" + SCHEMA + "|" + LIMIT)
    for i in range(30):
        what, kind, path, payload = random_case(rng)
        what = f"seed {seed}, case {i}: {what}"
        if kind == "http":
            assert len(payload) < 4 * MB - 4096, what
            http_case(local, what, payload, path=path, may_serve=True, words=words)
        else:
            assert payload.ByteSize() < 4 * MB - 4096, what
            grpc_case(local, what, payload, may_serve=True, words=words)


# ---- h. the schema cases on separate workers ----------------------------------------------------------------

SPLIT_SCHEMAS = {"$ref chain of 4,500": (REF_CHAIN_4500, False), "items nested 200,000 deep": (DEEP_ITEMS, False),
                 "const nested 200,000 deep": (DEEP_CONST, False),
                 **{name: (text, True) for name, text in CYCLIC.items()}}


@pytest.mark.parametrize("name", list(SPLIT_SCHEMAS))
def test_h_schemas_through_the_frontend_hurt_no_worker(protos, split, name):
    schema, may_serve = SPLIT_SCHEMAS[name]
    words = CYCLE_WORDS if may_serve else SCHEMA + "|" + LIMIT
    if len(schema) < 1_000_000:  # the 200,000-deep ones would only meet the body's depth limit over HTTP
        http_case(split, f"split HTTP schema: {name}", chat_body(schema), may_serve=may_serve, words=words,
                  input_error=True)
    grpc_case(split, f"split gRPC schema: {name}", schema_grpc(schema), may_serve=may_serve, words=words,
              input_error=True)


def worker_call(address, method, request, response_type, timeout=10):
    t0 = time.monotonic()
    try:
        with grpc.insecure_channel(address) as ch:
            if method == "Prefill":
                call = ch.unary_stream("/baton.v1.PrefillWorker/Prefill", request_serializer=_identity,
                                       response_deserializer=response_type.FromString)
                list(call(request.SerializeToString(), timeout=timeout))
            else:
                call = ch.unary_unary(f"/baton.v1.DecodeWorker/{method}", request_serializer=_identity,
                                      response_deserializer=response_type.FromString)
                call(request.SerializeToString(), timeout=timeout)
        return Reply("gRPC", grpc.StatusCode.OK, "", time.monotonic() - t0)
    except grpc.RpcError as e:
        return Reply("gRPC", e.code(), e.details() or "", time.monotonic() - t0)


def decode_load(dep, name="decode-0"):
    with grpc.insecure_channel(dep.servers[name].address) as ch:
        return PB.worker_grpc.DecodeWorkerStub(ch).GetLoad(PB.worker.LoadRequest(), timeout=10)


@pytest.mark.parametrize("name", list(SPLIT_SCHEMAS))
def test_h_schemas_straight_to_the_workers(protos, split, name):
    """A deployment peer (or anyone who reaches the internal port) sends the schema straight to a
    decode worker's Admit and to the prefill worker's Prefill: the worker compiles it again, and
    must refuse it (or admit a valid one) as the frontend does."""
    schema, may_serve = SPLIT_SCHEMAS[name]
    words = CYCLE_WORDS if may_serve else SCHEMA + "|" + LIMIT
    split.ensure_up()
    fingerprint = decode_load(split).model_fingerprint
    W = PB.worker
    sampling = PB.gen.SamplingParams()
    sampling.response_format.type = PB.gen.ResponseFormat.JSON_SCHEMA
    sampling.response_format.json_schema = schema
    rid = f"hostile-admit-{random.randrange(1 << 30)}"
    admit = W.AdmitRequest(request_id=rid, n_prompt_tokens=len(PROMPT), max_tokens=4, sampling=sampling,
                           model_fingerprint=fingerprint)
    for d in ("decode-0", "decode-1"):
        addr = split.servers[d].address
        r = hostile(split, f"Admit on {d} with schema {name}", lambda: worker_call(addr, "Admit", admit, W.AdmitResponse),
                    refusal=(grpc.StatusCode.INVALID_ARGUMENT,), may_serve=may_serve, words=words)
        if r.served:
            worker_call(addr, "Release", W.ReleaseRequest(request_id=rid), W.ReleaseResponse)
    if may_serve:
        return  # an accepted schema would prefill and hand KV to a decode worker that admitted nothing
    prefill = W.PrefillRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=sampling,
                               decode_address=split.servers["decode-0"].address)
    paddr = split.servers["prefill"].address
    hostile(split, f"Prefill with schema {name}", lambda: worker_call(paddr, "Prefill", prefill, W.PrefillEvent),
            refusal=(grpc.StatusCode.INVALID_ARGUMENT,), words=words)


# ---- j. the prefix cache leaks nothing across tenants --------------------------------------------

def completions_usage(base_url, prompt, key=None, **extra):
    body = json.dumps({"model": "test", "prompt": prompt, "max_tokens": 2, **extra}).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    u = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body, headers)
        r = conn.getresponse()
        data = r.read()
        assert r.status == 200, (r.status, data[:300])
        return json.loads(data)["usage"]["prompt_tokens_details"]["cached_tokens"]
    finally:
        conn.close()


def test_j_cached_tokens_tell_no_tenant_about_another(test_model, server_factory, tmp_path, rng):
    """With API keys, each key is its own tenant: a prompt cached for one is not a hit for another
    (so usage's cached_tokens is no oracle of other clients' prompts), nor for the same key under
    another cache_salt; the same key and salt hit. Without keys, the salt alone scopes."""
    keys = ["tenant-a-" + "%016x" % rng.getrandbits(64), "tenant-b-" + "%016x" % rng.getrandbits(64)]
    key_file = tmp_path / "keys"
    key_file.write_text("\n".join(keys) + "\n")
    srv = server_factory(test_model, "--dtype", "f32", *HTTP, "--api-key-file", str(key_file))
    a, b = keys
    prompt = [rng.randrange(3, 250) for _ in range(70)]  # four whole blocks of 16, fresh each run
    assert completions_usage(srv.http_url, prompt, a) == 0
    assert completions_usage(srv.http_url, prompt, a) == 64  # the same tenant hits
    assert completions_usage(srv.http_url, prompt, b) == 0   # another tenant does not
    assert completions_usage(srv.http_url, prompt, b) == 64  # ... until it has cached its own
    assert completions_usage(srv.http_url, prompt, a, cache_salt="s1") == 0
    assert completions_usage(srv.http_url, prompt, a, cache_salt="s1") == 64
    assert completions_usage(srv.http_url, prompt, b, cache_salt="s1") == 0  # a salt is no way into a's scope

    open_srv = server_factory(test_model, "--dtype", "f32", *HTTP)
    prompt = [rng.randrange(3, 250) for _ in range(70)]
    assert completions_usage(open_srv.http_url, prompt) == 0
    assert completions_usage(open_srv.http_url, prompt, cache_salt="x") == 0
    assert completions_usage(open_srv.http_url, prompt, cache_salt="x") == 64
    assert completions_usage(open_srv.http_url, prompt) == 64
    reply = http_post(open_srv.http_url, "/v1/completions",
                      json.dumps({"model": "test", "prompt": "hi", "cache_salt": "s" * 257}).encode())
    assert reply.status == 400 and "cache_salt" in reply.message, reply


# ---- k. n choices count against the request bound ------------------------------------------------

def test_k_n_choices_count_against_max_requests(test_model, server_factory):
    """--max-requests counts an n-choice request as n: more choices than the bound is a 400 at once,
    and n that does not fit beside the requests in flight is a 429, then served once they end."""
    srv = server_factory(test_model, *HTTP, "--max-requests", "8")
    body = lambda n, max_tokens=4: json.dumps(  # noqa: E731
        {"model": "test", "prompt": PROMPT, "n": n, "max_tokens": max_tokens, "ignore_eos": True}).encode()
    over = http_post(srv.http_url, "/v1/completions", body(9))
    assert over.status == 400 and "max-requests" in over.message, over
    assert http_post(srv.http_url, "/v1/completions", body(8)).status == 200
    # Six choices in flight (a stream's status comes with its first token: they are admitted),
    # then four more do not fit beside them; once the stream ends they do.
    u = urllib.parse.urlsplit(srv.http_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    try:
        six = json.loads(body(6, max_tokens=900))
        six["stream"] = True
        conn.request("POST", "/v1/completions", json.dumps(six).encode(), {"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.status == 200, stream.read()[:300]
        refused = http_post(srv.http_url, "/v1/completions", body(4))
        assert refused.status == 429 and "choices" in refused.message, refused
        assert http_post(srv.http_url, "/v1/completions", body(2)).status == 200  # 6 + 2 fit
        stream.read()
    finally:
        conn.close()
    deadline = time.monotonic() + 10
    while http_post(srv.http_url, "/v1/completions", body(4)).status != 200:
        assert time.monotonic() < deadline, "four choices still refused after the stream ended"
        time.sleep(0.05)


# ---- l. distinct large schemas do not grow a worker without bound ---------------------------------

def test_l_distinct_large_schemas_keep_a_worker_bounded(protos, test_model, server_factory):
    """Each request with its own large schema compiles an automaton that the worker caches; the
    cache is bounded in bytes (256 MiB a worker; `baton local` has two), so after it fills the
    process stops growing: 40 distinct 60,000-value enums (an automaton of about 43 MB each,
    bench/schema_bench.cpp) grew it by 1.5 GB, steadily, before the bound. The first 20 fill the
    caches (and the allocator's arenas); the next 20 must add far less than keeping them would."""
    srv = server_factory(test_model, *HTTP)
    pid = srv.proc.pid
    rss = [proc_status(pid)[0]]
    for i in range(40):
        values = ",".join(f'"v{i}-{j}"' for j in range(60_000))
        schema = '{"enum":[' + values + "]}"
        body = chat_body(schema, max_tokens=2)
        r = http_post(srv.http_url, "/v1/chat/completions", body, timeout=60)
        assert r.status == 200, r
        assert srv.proc.poll() is None
        if i in (19, 39):
            rss.append(proc_status(pid)[0])
    first, second = rss[1] - rss[0], rss[2] - rss[1]
    print(f"RSS +{first / MB:.0f} MB over the first 20 schemas, +{second / MB:.0f} MB over the next 20")
    assert second < 300 * MB, f"grew {second / MB:.0f} MB over the second 20 schemas (+{first / MB:.0f} MB over the first)"
