"""A bounded request fuzzer against a live `baton local` HTTP API (--http-listen) on the random
test model, in the style of test_request_fuzz.py (which fuzzes gRPC Generate).

Bodies are JSON objects built field by field from the OpenAI request schema, every field sometimes
of the wrong type or an extreme value (huge, negative, NaN-free floats past float's range, random
Unicode, empty), unknown fields, duplicate keys, and then, for a third of them, damaged as text:
truncated, bytes flipped, invalid UTF-8, nesting past the limit, a body over --max-message-bytes,
plain garbage. They go to the completion endpoints (and now and then to another path or with
another method, a body on a GET included), a fifth of them streamed, some of those abandoned
mid-stream. About one in eight is served (200), so the pipeline past validation is reached too.

Asserted for every request:
  * an HTTP response on a kept-alive connection, never a reset or a broken connection;
  * its status is 200 or a client error the request deserves (400, 403, 404, 413), never 5xx;
  * the body is JSON: an error in OpenAI's shape ({"error": {message, type, param, code}}, the
    message short: < 1 KB) or a completion whose usage matches its text's end; a stream is
    `data:` events that each parse, chunks of one id, ending in [DONE] after a finish_reason;
  * the server is still alive.
After the random requests: every KV block is free again and a plain request still works.

Random requests for BATON_FUZZ_SECONDS (default 10) seconds from a random seed, printed;
BATON_FUZZ_SEED=<seed> replays the same sequence. One input of each kind of finding is written to
the test's tmp dir.
"""

from __future__ import annotations

import collections
import json
import os
import random
import time

import httpx2
import pytest

from serving_harness import Server, wait_blocks_free

MAX_BODY = 65536
ALLOWED = {200, 400, 403, 404, 413}
VOCAB, CTX = 275, 1024
WORDS = ["hello", "the", "<|im_start|>", "<|im_end|>", "\u00e9", "\U0001f355", "\u4e2d\u6587", "\x00", "\r\n", " ", ""]


class Fuzzer:
    def __init__(self, seed):
        self.r = random.Random(seed)

    def text(self, max_len=30):
        r = self.r
        x = r.random()
        if x < 0.5:
            return "".join(r.choice(WORDS) for _ in range(r.randint(0, 6)))
        if x < 0.9:
            return "".join(chr(r.choice([r.randint(0x20, 0x7E), r.randint(0xA0, 0xD7FF), r.randint(0xE000, 0x10FFFF)]))
                           for _ in range(r.randint(1, max_len)))
        return "a" * r.choice([300, 3000, 30000])

    def number(self):
        r = self.r
        return r.choice([0, 1, -1, 0.5, 1.5, 2, 1e-45, 1e39, -1e39, 1e300, 2**31, 2**31 - 1, -2**31 - 1, 2**63, 2**64 + 1,
                         r.uniform(-3, 3), r.randint(-5, 2000)])

    def anything(self, depth=0):
        r = self.r
        kinds = ["null", "bool", "number", "string"] + (["array", "object"] if depth < 3 else [])
        k = r.choice(kinds)
        if k == "null":
            return None
        if k == "bool":
            return r.random() < 0.5
        if k == "number":
            return self.number()
        if k == "string":
            return self.text()
        if k == "array":
            return [self.anything(depth + 1) for _ in range(r.randint(0, 4))]
        return {self.text(8): self.anything(depth + 1) for _ in range(r.randint(0, 4))}

    def maybe_wrong(self, good):
        """Mostly `good`, sometimes any JSON value at all."""
        return good if self.r.random() < 0.93 else self.anything()

    def prompt(self):
        r = self.r
        x = r.random()
        if x < 0.4:
            return self.text()
        if x < 0.8:
            n = r.choice([1, 2, r.randint(3, 40), r.randint(40, 300), CTX, CTX + 3])
            return [r.randrange(VOCAB) if r.random() < 0.97 else r.choice([-1, VOCAB, 2**31, 2**40]) for _ in range(n)]
        return r.choice([[self.text()], [[1, 2, 3]], [self.text(), self.text()], [], [[]]])

    def messages(self):
        r = self.r
        out = []
        for _ in range(r.choice([0, 1, 1, 2, 3, 10])):
            m = {"role": self.maybe_wrong(r.choice(["system", "user", "assistant", "developer", "tool"])),
                 "content": self.maybe_wrong(self.text() if r.random() < 0.8 else [{"type": "text", "text": self.text()}])}
            if r.random() < 0.1:
                del m[r.choice(["role", "content"])]
            out.append(m)
        return self.maybe_wrong(out)

    def body(self, chat):
        r = self.r
        b = {}
        if r.random() < 0.8:
            b["model"] = self.maybe_wrong("test" if r.random() < 0.9 else self.text(10))
        if chat:
            b["messages"] = self.messages()
        elif r.random() < 0.95:
            b["prompt"] = self.maybe_wrong(self.prompt())
        fields = {
            "max_tokens": lambda: r.randint(1, 12) if r.random() < 0.7 else self.number(),
            "temperature": lambda: r.choice([0, 0.7, 1.0]) if r.random() < 0.6 else self.number(),
            "top_p": lambda: r.choice([0.5, 0.9, 1.0]) if r.random() < 0.6 else self.number(),
            "top_k": lambda: r.randint(0, 50),
            "seed": lambda: r.randint(-2**63, 2**64 - 1),
            "stop": lambda: r.choice([self.text(4), [self.text(4) for _ in range(r.randint(0, 20))]]),
            "n": lambda: r.choice([1, 1, 2, 3, 100]),
            "stream_options": lambda: {"include_usage": r.random() < 0.5},
            "ignore_eos": lambda: r.random() < 0.5,
            "priority": lambda: r.choice([0, -5, 1, 2000]),
            "logprobs": lambda: r.choice([False, True, None]),
            "presence_penalty": lambda: r.choice([0, 0.5, 2.5]),
            "frequency_penalty": lambda: r.choice([0, -1.5, 3]),
            "repetition_penalty": lambda: r.choice([1, 1.3, 0]),
            "top_logprobs": lambda: r.randint(0, 25),
            "user": lambda: self.text(),
            "max_completion_tokens": lambda: r.randint(1, 12),
        }
        for name, make in fields.items():
            if r.random() < 0.25:
                b[name] = self.maybe_wrong(make())
        for _ in range(r.choice([0, 0, 0, 1, 3])):  # fields OpenAI does not define
            b[self.text(12)] = self.anything()
        return b

    def request(self):
        """(method, path, body bytes, stream?, abandon after the first event?)."""
        r = self.r
        chat = r.random() < 0.5
        body = self.body(chat)
        stream = r.random() < 0.2
        if stream:
            body["stream"] = True
        elif r.random() < 0.05:
            body["stream"] = self.anything()
        data = json.dumps(body, ensure_ascii=r.random() < 0.5).encode("utf-8", "surrogatepass")
        if r.random() < 0.25:
            data = self.damage(data)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        method = "POST"
        if r.random() < 0.05:
            method, path = r.choice([("GET", path), ("PUT", path), ("POST", "/v1/" + "".join(r.choice("abcxyz/._-%") for _ in range(8))), ("GET", "/v1/models"),
                                     ("GET", "/health"), ("DELETE", "/v1/models/test")])
        return method, path, data, stream, stream and r.random() < 0.2

    def damage(self, data):
        r = self.r
        kind = r.randrange(8)
        if kind == 0 and data:
            return data[:r.randrange(len(data))]
        if kind == 1 and data:
            b = bytearray(data)
            for _ in range(r.randint(1, 4)):
                b[r.randrange(len(b))] = r.getrandbits(8)
            return bytes(b)
        if kind == 2:
            return data.replace(b'"', b'"\xff', 1)
        if kind == 3:
            depth = r.choice([30, 40, 1000])
            return data[:-1] + b', "deep": ' + b"[" * depth + b"]" * depth + b"}"
        if kind == 4:
            return data[:-1] + b', "pad": "' + b"x" * (MAX_BODY + r.randint(0, 5000)) + b'"}'
        if kind == 5:
            return r.randbytes(r.randint(0, 300))
        if kind == 6:
            return data[:-1] + b', "max_tokens": 1, "max_tokens": 2}'  # a duplicate key: the last wins
        return b" " * r.randint(0, 3) + data + b"\n" * r.randint(0, 3)


def check_error(body, status):
    try:
        j = json.loads(body)
    except ValueError:
        return f"{status}: the body is not JSON: {body[:200]!r}"
    e = j.get("error") if isinstance(j, dict) else None
    if not isinstance(e, dict) or set(e) != {"message", "type", "param", "code"}:
        return f"{status}: not an OpenAI error object: {body[:200]!r}"
    if not isinstance(e["message"], str) or not e["message"]:
        return f"{status}: an empty error message"
    if len(e["message"].encode()) >= 1024:
        return f"{status}: a {len(e['message'].encode())}-byte error message"
    return None


def check_completion(j, path):
    if "choices" in j and "usage" in j:
        if (not j["choices"] or [c["index"] for c in j["choices"]] != list(range(len(j["choices"])))
                or any(c["finish_reason"] not in ("stop", "length") for c in j["choices"])):
            return f"a completion with choices {j['choices']!r}"
        return None
    if path.startswith("/v1/models") or path == "/health":
        return None
    return f"a 200 that is no completion: {json.dumps(j)[:200]}"


def check_stream(lines):
    """`lines`: the SSE body's lines. None when it is a well-formed stream."""
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "a stream that does not end with [DONE]"
    finish, ids = None, set()
    for e in events[:-1]:
        try:
            chunk = json.loads(e)
        except ValueError:
            return f"an event that is not JSON: {e[:200]!r}"
        if "error" in chunk:
            return f"an error event in a stream that then says [DONE]: {e[:200]}"
        ids.add(chunk["id"])
        for c in chunk["choices"]:
            finish = c["finish_reason"] or finish
    if finish not in ("stop", "length"):
        return f"a stream without a finish_reason ({finish!r})"
    if len(ids) != 1:
        return f"chunks of {len(ids)} ids"
    return None


def one(client, method, path, data, stream, abandon):
    """(status or 'reset', a finding or None)."""
    headers = {"content-type": "application/json"}
    try:
        with client.stream(method, path, content=data, headers=headers) as r:
            if r.status_code not in ALLOWED:
                return r.status_code, f"status {r.status_code}: {r.read()[:300]!r}"
            if r.status_code != 200:
                return r.status_code, check_error(r.read(), r.status_code)
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    if abandon:
                        return "abandoned", None
                return 200, check_stream(lines)
            body = r.read()
            try:
                j = json.loads(body)
            except ValueError:
                return 200, f"a 200 that is not JSON: {body[:200]!r}"
            return 200, check_completion(j, path)
    except httpx2.HTTPError as e:
        return "reset", f"{type(e).__name__}: {e}"


@pytest.fixture(scope="module")
def fuzz_server(baton_bin, test_model):
    s = Server(baton_bin, test_model, "--max-message-bytes", str(MAX_BODY), "--http-listen", "127.0.0.1:0")
    yield s
    s.stop_clean()


def test_random_json_requests_get_a_clean_answer(fuzz_server, tmp_path):
    seconds = float(os.environ.get("BATON_FUZZ_SECONDS", "10"))
    seed = int(os.environ.get("BATON_FUZZ_SEED", random.randrange(1 << 31)))
    print(f"fuzz seed {seed} (BATON_FUZZ_SEED={seed} replays it), {seconds:g} s")
    srv = fuzz_server
    fuzzer = Fuzzer(seed)
    findings, outcomes = {}, collections.Counter()
    n, deadline = 0, time.monotonic() + seconds
    with httpx2.Client(base_url=srv.http_url, timeout=60) as client:
        while time.monotonic() < deadline:
            method, path, data, stream, abandon = fuzzer.request()
            status, finding = one(client, method, path, data, stream, abandon)
            outcomes[status] += 1
            if finding:
                kind = finding.split(":")[0]
                if kind not in findings:
                    p = tmp_path / f"seed{seed}-request{n}.bin"
                    p.write_bytes(data)
                    findings[kind] = f"request {n} ({method} {path}, {p}, {len(data)} bytes): {finding}"
            assert srv.proc.poll() is None, f"the server died on request {n} of seed {seed}: {list(srv.stderr_tail)[-20:]}"
            n += 1
    print(f"{n} random requests ({dict(outcomes.most_common())}), {len(findings)} kinds of finding")
    problems = list(findings.values())
    if outcomes[200] == 0:
        problems.append("no request was served: the fuzzer never got past validation")
    if not wait_blocks_free(srv, timeout=30, roles=("decode", "prefill")):
        problems.append("KV blocks did not return to the total after the fuzzing")
    r = httpx2.post(srv.http_url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True},
                    timeout=60)
    if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != 8:
        problems.append(f"a plain request after the fuzzing did not get its 8 tokens: {r.status_code} {r.text[:300]}")
    assert not problems, "\n".join(problems)
