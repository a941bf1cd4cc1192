"""Helpers for the serving tests: a running `baton` process, Prometheus text parsing, certificates
and API keys for the secure flags, and the OpenAI client on the HTTP API."""

import collections
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def compile_protos(out):
    """Generates the Python modules of proto/baton/v1 into `out` (grpcio-tools) and returns them as
    one object with .gen, .gen_grpc, .worker, .worker_grpc."""
    import sys

    import grpc_tools
    from grpc_tools import protoc

    protos = [str(p.relative_to(REPO / "proto")) for p in (REPO / "proto" / "baton" / "v1").glob("*.proto")]
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    rc = protoc.main(["protoc", f"-I{REPO / 'proto'}", f"-I{include}", f"--python_out={out}", f"--grpc_python_out={out}"]
                     + protos)
    assert rc == 0, "protoc failed on proto/baton/v1"
    sys.path.insert(0, str(out))
    import baton.v1.generate_pb2 as gen
    import baton.v1.generate_pb2_grpc as gen_grpc
    import baton.v1.worker_pb2 as worker
    import baton.v1.worker_pb2_grpc as worker_grpc

    class Modules:
        pass

    m = Modules()
    m.gen, m.gen_grpc, m.worker, m.worker_grpc = gen, gen_grpc, worker, worker_grpc
    return m


def make_test_model(baton_bin, path, seed, layers, dim, heads, kv_heads, ffn, ctx):
    """Writes a random Llama GGUF with `baton tools make-test-model` and returns its path."""
    subprocess.run([str(baton_bin), "tools", "make-test-model", "--out", str(path), "--seed", str(seed), "--layers",
                    str(layers), "--dim", str(dim), "--heads", str(heads), "--kv-heads", str(kv_heads), "--ffn",
                    str(ffn), "--ctx", str(ctx)], check=True)
    return path


def real_model_path():
    """The real model (SmolLM2): $BATON_MODEL, else what scripts/fetch-model.sh fetches."""
    model = os.environ.get("BATON_MODEL")
    if not model:
        model = subprocess.run([str(REPO / "scripts" / "fetch-model.sh")], check=True, capture_output=True,
                               text=True).stdout.strip().splitlines()[-1]
    return Path(model)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running `baton local` (or `baton serve`) process."""

    def __init__(self, baton_bin, model, *extra, subcommand=("local",), listen="127.0.0.1:0", wrapper=()):
        """`wrapper`: a command that runs baton (e.g. ip netns exec NAME): the server then listens and
        serves its metrics on `listen`'s host."""
        host = listen.rsplit(":", 1)[0]
        self.metrics_host = host if wrapper else "127.0.0.1"
        self.metrics_port = free_port()
        log_level = [] if "--log-level" in extra else ["--log-level", "warn"]  # the test may ask for another
        args = [*wrapper, str(baton_bin), *subcommand, "--model", str(model), "--listen", listen,
                "--metrics-listen", f"{self.metrics_host}:{self.metrics_port}", *log_level, *map(str, extra)]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     errors="replace")
        deadline = time.time() + 120
        self.port = None
        self.http_port = None  # with --http-listen: the HTTP API's port (printed before the gRPC one)
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            m = re.match(r"http listening on port (\d+)", line)
            if m:
                self.http_port = int(m.group(1))
                continue
            m = re.match(r"listening on port (\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
        if self.port is None:
            self.proc.kill()
            raise RuntimeError(f"baton did not start: {self.proc.stderr.read()}")
        self.address = f"{host if host not in ('', '0.0.0.0', '[::]') else '127.0.0.1'}:{self.port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}" if self.http_port else None
        # Both streams are read all the time (the log goes to stdout, sanitizer reports to stderr): a
        # test that makes the server log a lot (the request fuzzer, --log-level debug) must not fill
        # a pipe and block the server in a write. The last lines of both are kept, in one tail.
        self.stderr_tail = collections.deque(maxlen=200)
        self.n_output_lines = 0  # every line read so far (the tail keeps the last 200)
        self._output_lock = threading.Lock()
        self._readers = [threading.Thread(target=self._read, args=(f,), daemon=True)
                         for f in (self.proc.stdout, self.proc.stderr)]
        for r in self._readers:
            r.start()

    def _read(self, stream):
        for line in stream:
            with self._output_lock:
                self.stderr_tail.append(line.rstrip("\n"))
                self.n_output_lines += 1

    def log_mark(self):
        """A mark for log_since: the number of output lines (log and stderr) read so far."""
        with self._output_lock:
            return self.n_output_lines

    def log_since(self, mark):
        """The output lines read after `mark` (at most the last 200)."""
        with self._output_lock:
            n = self.n_output_lines - mark
            return list(self.stderr_tail)[-n:] if n > 0 else []

    def wait_for_log(self, pattern, mark=0, timeout=10):
        """The first output line after `mark` that matches the regex `pattern`, waiting up to
        `timeout` s for it."""
        deadline = time.time() + timeout
        while True:
            for line in self.log_since(mark):
                if re.search(pattern, line):
                    return line
            assert time.time() < deadline, f"no line matching {pattern!r} in {timeout} s: {self.log_since(mark)[-20:]}"
            time.sleep(0.02)

    def metrics(self):
        with urllib.request.urlopen(f"http://{self.metrics_host}:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def stop_clean(self):
        """Stops the process (SIGTERM) and asserts it went cleanly: exit status 0 and no sanitizer
        report (under scripts/sanitize.sh a leak or a use-after-free in the shutdown path shows
        only here). A process the test killed itself is exempt."""
        killed_by_test = self.proc.poll() == -signal.SIGKILL
        rc = self.stop()
        if killed_by_test:
            return
        for r in self._readers:
            r.join(timeout=10)
        reports = [line for line in self.stderr_tail if "Sanitizer" in line or "runtime error:" in line]
        assert rc == 0 and not reports, (f"{' '.join(self.proc.args[1:4])} exited {rc}:\n" +
                                         "\n".join(list(self.stderr_tail)[-40:]))


class Stream:
    """One Generate call read on its own thread: token ids with their arrival times, the final message."""

    def __init__(self, pb, address, prompt_ids, max_tokens, timeout=300, seed=None, sampling=None):
        """Greedy, or seeded sampling at temperature 0.8 when `seed` is given; `sampling`: more
        SamplingParams fields (penalties, top_logprobs)."""
        self.ids, self.times, self.logprobs, self.final, self.error = [], [], [], None, None
        self.started = time.monotonic()
        self._args = (pb, address, prompt_ids, max_tokens, timeout, seed, sampling or {})
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        import grpc

        pb, address, prompt_ids, max_tokens, timeout, seed, sampling = self._args
        req = pb.gen.GenerateRequest(prompt_token_ids=prompt_ids, max_tokens=max_tokens, ignore_eos=True)
        if seed is not None:
            req.sampling.temperature = 0.8
            req.sampling.seed = seed
        for name, value in sampling.items():
            setattr(req.sampling, name, value)
        try:
            with grpc.insecure_channel(address) as ch:
                for m in pb.gen_grpc.GenerationStub(ch).Generate(req, timeout=timeout):
                    now = time.monotonic()
                    for t in m.token_ids:
                        self.ids.append(t)
                        self.times.append(now)
                    self.logprobs.extend(m.logprobs)
                    if m.HasField("final"):
                        self.final = m.final
        except grpc.RpcError as e:
            self.error = e

    def join(self):
        self.thread.join(timeout=600)
        assert not self.thread.is_alive()


HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
SERVING, NOT_SERVING = 1, 2


def _identity(b):
    return b


def _varint(b, i):
    shift = value = 0
    while True:
        byte = b[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def health_status(raw):
    """The `status` (field 1, varint) of a serialized grpc.health.v1.HealthCheckResponse.

    grpcio-health-checking is not a dependency, so its two messages are written by hand:
    HealthCheckRequest {string service = 1} is sent empty (the whole server), HealthCheckResponse
    is {ServingStatus status = 1} with SERVING = 1, NOT_SERVING = 2."""
    i, status = 0, 0  # absent: UNKNOWN (0)
    while i < len(raw):
        key, i = _varint(raw, i)
        assert key & 7 == 0, f"unexpected wire type in HealthCheckResponse {raw!r}"
        value, i = _varint(raw, i)
        if key >> 3 == 1:
            status = value
    return status


def health_check(address, timeout=5):
    """The server's grpc.health.v1 status (SERVING / NOT_SERVING)."""
    import grpc

    with grpc.insecure_channel(address) as ch:
        raw = ch.unary_unary(HEALTH_CHECK, request_serializer=_identity, response_deserializer=_identity)(
            b"", timeout=timeout)
    return health_status(raw)


def metric_values(text, name):
    """{labels string: value} of every sample of `name` in Prometheus text format."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            out[key[len(name):]] = float(value)
    return out


def wait_blocks_free(srv, timeout=10, roles=("decode",), role=None):
    """True once every worker of `roles` (or of the one `role`) has all its KV blocks free
    (baton_kv_blocks_free equal to baton_kv_blocks_capacity) within `timeout` s. A prefill worker
    counts the idle blocks of its prefix cache as free: no request holds them."""
    if role is not None:
        roles = (role,)
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = srv.metrics()
        free = metric_values(text, "baton_kv_blocks_free")
        total = metric_values(text, "baton_kv_blocks_capacity")
        if all(kv_blocks_of(free, role) and kv_blocks_of(free, role) == kv_blocks_of(total, role) for role in roles):
            return True
        time.sleep(0.1)
    return False


def kv_blocks_of(samples, role):
    """{labels: value} of the samples of one role."""
    return {k: v for k, v in samples.items() if f'role="{role}"' in k}


# ---- certificates, API keys, secure flags ------------------------------------------------------

PROMPT = [5, 17, 99, 3, 250, 41, 7, 12]  # token ids of the test model, for the TLS and API-key tests
# API keys the tests' clients send (conftest's pki fixture lists both in pki.keys).
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

    def rotate(self, crt, key, name, ca_name):
        """cert-manager's way: a new key pair `name` from a new CA `ca_name`, swapped in over crt and key by
        rename. Returns the new CA."""
        new_ca = self.ca(ca_name)
        new_crt, new_key = self.leaf(name, new_ca)
        replace_file(new_key, key)
        replace_file(new_crt, crt)
        return new_ca


def replace_file(src, dst):
    """Swaps `dst` for a copy of `src` by rename, as a Secret volume update does."""
    tmp = dst.with_suffix(dst.suffix + ".new")
    tmp.write_bytes(src.read_bytes())
    os.replace(tmp, dst)


def retry_until(attempt, errors, what, timeout=15):
    """attempt() until it stops raising one of `errors`; fails with `what` after `timeout` seconds."""
    deadline = time.time() + timeout
    while True:
        try:
            return attempt()
        except errors:
            assert time.time() < deadline, f"{what} within {timeout} s"
            time.sleep(0.5)


def internal_flags(pki, role):
    crt, key = pki.roles[role]
    return ["--internal-tls-cert", crt, "--internal-tls-key", key, "--internal-tls-ca", pki.internal_ca[0]]


def creds(ca, leaf=None):
    import grpc

    read = lambda p: p.read_bytes()  # noqa: E731
    if leaf is None:
        return grpc.ssl_channel_credentials(root_certificates=read(ca[0]))
    return grpc.ssl_channel_credentials(root_certificates=read(ca[0]), private_key=read(leaf[1]),
                                        certificate_chain=read(leaf[0]))


def tls_generate(pb, address, channel_creds, metadata=(("authorization", f"Bearer {KEY}"),), **fields):
    import grpc

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


# ---- the OpenAI-compatible HTTP API -----------------------------------------------------------

HTTP = ("--http-listen", "127.0.0.1:0")
TEST_MODEL = "test"  # the served name: the file's stem (conftest: test.gguf)


def client(srv, **kw):
    """The openai client on `srv`'s HTTP API, without retries (a refusal must reach the test)."""
    import openai

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


def random_ids(rng, n):
    return [rng.randrange(3, 275) for _ in range(n)]
