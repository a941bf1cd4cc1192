"""The deployment, run for real: the image built by scripts/build-image.sh (from the tests' own
binaries: --prebuilt), the cpu overlay played as pods by scripts/deploy-local.sh (frontend, prefill
and decode as separate pods under podman, mutual TLS between them, the model volume filled by the
model Job's pod), and from outside the pods:

- the image runs as the manifests run it (uid 10001, read-only root, no capabilities): --version,
  and `baton generate` against a mounted model equals the host's `baton generate`;
- `up` ends with the OpenAI base URL and the gRPC address; a chat request through the OpenAI
  client and a Generate through gRPC each equal `baton generate`;
- the real Prometheus, with deploy/prometheus/prometheus.yml's jobs and relabelling (its DNS
  discovery given the pods' addresses: podman has no Service DNS on the host), scrapes all three
  roles, and the TTFT histogram's count moves with a request;
- every probe command the played manifests hold, run inside its pod, reports healthy; an engine
  stalled for real (its step thread stopped with ptrace) turns liveness and readiness NOT_SERVING,
  and they recover when it moves;
- the decode pod's process killed (SIGKILL) mid-stream: the stream completes with the same greedy
  text, podman restarts the container under the pod's restart policy, and the frontend uses it again;
- `down` leaves no container, pod, volume, Secret or network behind.

The test's overlay adds two settings to deploy/podman: the exact mode (--dtype f32 on every role,
so re-prefilling after the failover reproduces the decoded positions to rounding, and `baton
generate --dtype f32` is the reference) and a 5 s stall timeout (the default is 120 s)."""

import ctypes
import json
import os
import random
import re
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from deploy_helpers import DEPLOY, REPO
from serving_harness import free_port
from test_prometheus_live import Prometheus

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?",
             "What do bees make?", "How many legs does a spider have?", "What is ice made of?"]
STALL_TIMEOUT = 5


def run(*args, timeout=600, check=True):
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        pytest.fail(f"{' '.join(map(str, args))} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


@pytest.fixture(scope="module")
def model():
    path = os.environ.get("BATON_MODEL")
    if not path:
        path = run(REPO / "scripts" / "fetch-model.sh").stdout.strip().splitlines()[-1]
    return path


@pytest.fixture(scope="module")
def image(baton_bin):
    """The image from the tests' binaries, under a tag of its own (removed afterwards)."""
    tag = f"localhost/baton-test:{os.getpid()}"
    start = time.monotonic()
    p = run(REPO / "scripts" / "build-image.sh", "--prebuilt", baton_bin.parent, "--tag", tag, timeout=1800)
    print(f"build-image.sh --prebuilt: {time.monotonic() - start:.0f} s; {p.stderr.strip().splitlines()[-1]}")
    assert p.stdout.strip().splitlines()[-1] == tag
    assert re.search(rf"build-image: {re.escape(tag)}: \d+ MB", p.stderr), "the image's size is not printed"
    yield tag
    run("podman", "rmi", "--force", tag, check=False)


@pytest.fixture(scope="module")
def deployment(image, tmp_path_factory):
    """`deploy-local.sh up` with the test's overlay; `down` afterwards (the last test checks it)."""
    overlay = tmp_path_factory.mktemp("overlay")
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(DEPLOY / "podman", overlay)],
        "configMapGenerator": [{"name": "baton-common", "behavior": "merge",
                                "literals": ["BATON_DTYPE=f32", f"BATON_STALL_TIMEOUT={STALL_TIMEOUT}"]}]}))
    http_port, grpc_port = free_port(), free_port()
    start = time.monotonic()
    p = run(REPO / "scripts" / "deploy-local.sh", "up", "--image", image, "--overlay", overlay,
            "--http-port", http_port, "--grpc-port", grpc_port, check=False)
    up_seconds = time.monotonic() - start
    if p.returncode != 0:
        run(REPO / "scripts" / "deploy-local.sh", "down", check=False)
        pytest.fail(f"deploy-local.sh up exited {p.returncode}:\n{p.stderr[-6000:]}")
    state = baton_cache() / "deploy-local"
    d = {"stdout": p.stdout, "http_port": http_port, "grpc_port": grpc_port, "up_seconds": up_seconds,
         "played": [o for o in yaml.safe_load_all((state / "deployments.yaml").read_text()) if o]}
    print(f"deploy-local.sh up: {up_seconds:.0f} s")
    yield d
    run(REPO / "scripts" / "deploy-local.sh", "down", check=False)


def baton_cache():
    """Where scripts/env.sh keeps what the scripts make (deploy-local.sh: the manifests it played)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "baton"
    return Path(os.environ.get("BATON_CACHE", default))


def reference(baton_bin, model, question, max_tokens, ignore_eos=False):
    """`baton generate --dtype f32` on the host: the text, without its last newline."""
    args = [baton_bin, "generate", "--model", model, "--dtype", "f32", "--chat", question, "--max-tokens", max_tokens]
    out = run(*args, *(["--ignore-eos"] if ignore_eos else [])).stdout
    assert out.endswith("\n")
    return out[:-1]


def container(pod):
    return f"{pod}-pod-0-baton"


def inspect(name, fmt):
    return run("podman", "inspect", "--format", fmt, name).stdout.strip()


def pod_ip(pod):
    infra = run("podman", "pod", "inspect", "--format", "{{.InfraContainerID}}", f"{pod}-pod-0").stdout.strip()
    return inspect(infra, "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")


def metrics_of(pod):
    with urllib.request.urlopen(f"http://{pod_ip(pod)}:9464/metrics", timeout=10) as r:
        return r.read().decode()


def counter(text, name):
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{") or
               line.startswith(name + " "))


class ChatStream:
    """A greedy gRPC chat Generate in a thread, from the host to the published gRPC port."""

    def __init__(self, pb, address, question, max_tokens):
        self.tokens, self.texts, self.final, self.error = 0, [], None, None
        self.first = threading.Event()
        req = pb.gen.GenerateRequest(messages=[pb.gen.ChatMessage(role="user", content=question)],
                                     max_tokens=max_tokens, ignore_eos=True)
        self.thread = threading.Thread(target=self._run, args=(pb, address, req), daemon=True)
        self.thread.start()

    def _run(self, pb, address, req):
        try:
            with grpc.insecure_channel(address) as ch:
                for m in pb.gen_grpc.GenerationStub(ch).Generate(req, timeout=600):
                    self.texts.append(m.text)
                    self.tokens += len(m.token_ids)
                    if m.HasField("final"):
                        self.final = m.final
                    if self.tokens:
                        self.first.set()
        except grpc.RpcError as e:
            self.error = f"{e.code()}: {e.details()}"
        self.first.set()

    def wait_tokens(self, n, timeout=120):
        deadline = time.time() + timeout
        while self.tokens < n and self.thread.is_alive() and time.time() < deadline:
            time.sleep(0.02)
        assert self.tokens >= n, f"{self.tokens} tokens after {timeout} s ({self.error})"

    def join(self):
        self.thread.join(timeout=600)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.error is None, self.error
        return "".join(self.texts)


def probe_commands(played):
    """{(deployment, probe): exec command} of every baton container in the played manifests."""
    out = {}
    for d in played:
        if d["kind"] != "Deployment":
            continue
        (c,) = [c for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "baton"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            out[(d["metadata"]["name"], probe)] = c[probe]["exec"]["command"]
    return out


def in_container(name, *command):
    """`command` run inside the container, as `podman exec` runs it. From a chroot (as
    scripts/fresh-machine-check.sh runs the tests) on this VM's kernel, runc cannot enter a
    container's root to start it ("chdir to cwd ... no such file or directory"); nsenter into all
    of its namespaces, its root and its user then does what podman exec would."""
    p = run("podman", "exec", name, *command, check=False)
    if p.returncode in (126, 127) and "OCI runtime" in p.stderr:
        pid = inspect(name, "{{.State.Pid}}")
        user = inspect(name, "{{.Config.User}}").split(":")
        p = run("nsenter", "--target", pid, "--all", "--root", "--wd=/", "-S", user[0], "-G", user[-1], *command,
                check=False)
    return p


def probe(deployment, name, which):
    command = probe_commands(deployment["played"])[(name, which)]
    return in_container(container(name), *command)


# ---- the image -------------------------------------------------------------------------------------

def test_image_runs_as_the_manifests_run_it(image, baton_bin, model):
    config = json.loads(run("podman", "image", "inspect", image).stdout)[0]["Config"]
    assert config["User"] == "10001:10001" and config["Entrypoint"] == ["baton"], config
    locked = ["podman", "run", "--rm", "--read-only", "--user", "10001:10001", "--cap-drop", "ALL",
              "--security-opt", "no-new-privileges"]
    version = re.search(r"project\(baton VERSION ([0-9.]+)", (REPO / "CMakeLists.txt").read_text()).group(1)
    assert run(*locked, image, "--version").stdout == f"baton {version}\n"
    question = random.choice(QUESTIONS)
    folder, name = os.path.split(model)
    got = run(*locked, "--volume", f"{folder}:/models:ro", image, "generate", "--model", f"/models/{name}", "--dtype",
              "f32", "--chat", question, "--max-tokens", "40").stdout
    assert got[:-1] == reference(baton_bin, model, question, 40), question


# ---- requests from outside the pods ----------------------------------------------------------------

def test_up_ends_with_the_openai_url_and_the_grpc_address(deployment):
    lines = deployment["stdout"].strip().splitlines()
    assert lines[-2:] == [f"http://127.0.0.1:{deployment['http_port']}/v1", f"grpc 127.0.0.1:{deployment['grpc_port']}"]


def test_openai_and_grpc_requests_equal_baton_generate(deployment, pb, baton_bin, model):
    from openai import OpenAI

    first, second = random.sample(QUESTIONS, 2)
    client = OpenAI(base_url=deployment["stdout"].strip().splitlines()[-2], api_key="none")
    name = client.models.list().data[0].id
    start = time.monotonic()
    r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": first}], max_tokens=48,
                                       temperature=0)
    print(f"first request through the OpenAI API: {time.monotonic() - start:.2f} s, "
          f"{deployment['up_seconds'] + time.monotonic() - start:.0f} s after `up` began")
    assert r.choices[0].message.content == reference(baton_bin, model, first, 48), first

    address = deployment["stdout"].strip().splitlines()[-1].split()[1]
    req = pb.gen.GenerateRequest(messages=[pb.gen.ChatMessage(role="user", content=second)], max_tokens=48)
    with grpc.insecure_channel(address) as ch:
        msgs = list(pb.gen_grpc.GenerationStub(ch).Generate(req, timeout=120))
    assert "".join(m.text for m in msgs) == reference(baton_bin, model, second, 48), second
    assert msgs[-1].final.timing.kv_transfer_seconds > 0, "the KV went from the prefill pod to the decode pod"


# ---- metrics ---------------------------------------------------------------------------------------

def scrape_config(tmp_path):
    """deploy/prometheus/prometheus.yml: its jobs and relabelling as shipped, 1 s intervals, and each
    job's DNS names given as the pods' addresses (a static target carrying the __meta_dns_name that
    DNS discovery would set, so the shipped relabelling runs on it)."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str((DEPLOY / "prometheus" / f).resolve()) for f in config["rule_files"]]
    for job in config["scrape_configs"]:
        static = []
        for sd in job.pop("dns_sd_configs"):
            for dns_name in sd["names"]:
                role = re.match(r"baton-([a-z]+)\.", dns_name).group(1)
                static.append({"targets": [f"{pod_ip('baton-' + role)}:{sd['port']}"],
                               "labels": {"__meta_dns_name": dns_name}})
        job["static_configs"] = static
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path, [job["job_name"] for job in config["scrape_configs"]]


def test_prometheus_scrapes_the_three_roles(deployment, pb, tmp_path):
    config, jobs = scrape_config(tmp_path)
    prom = Prometheus(config, tmp_path)
    try:
        def all_up():
            _, result = prom.query("up")
            got = {(m["job"], m.get("component"), m.get("namespace")): v for m, v in result}
            return got if len(got) == 3 and all(v == 1 for v in got.values()) else None
        got = prom.wait("the three roles up", all_up, 60)
        assert set(got) == {(job, job.split("-")[1], "baton") for job in jobs}, got

        def ttft_count():
            _, result = prom.query('sum(baton_time_to_first_token_seconds_count{component="frontend"})')
            return result[0][1] if result else None
        before = prom.wait("the TTFT histogram", lambda: ttft_count() is not None, 30) and ttft_count()
        address = deployment["stdout"].strip().splitlines()[-1].split()[1]
        ChatStream(pb, address, random.choice(QUESTIONS), 8).join()
        prom.wait("the TTFT count to move", lambda: (ttft_count() or 0) > before, 30)
        for job in jobs:  # each role's own families reach Prometheus
            _, result = prom.query(f'count({{job="{job}", __name__=~"baton_.+"}})')
            assert result and result[0][1] > 0, job
    finally:
        prom.stop()


# ---- probes ----------------------------------------------------------------------------------------

def test_every_probe_command_reports_healthy_inside_its_pod(deployment):
    commands = probe_commands(deployment["played"])
    assert {name for name, _ in commands} == {"baton-frontend", "baton-prefill", "baton-decode"}
    for (name, which), command in commands.items():
        p = probe(deployment, name, which)
        assert (p.returncode, p.stdout) == (0, "SERVING\n"), (name, which, command, p.stderr)


class StoppedThread:
    """One thread of a process stopped for real (ptrace: seized and interrupted; the rest of the
    process runs on), until `resume`. The thread that stops it must resume it."""
    PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT, WALL = 17, 0x4206, 0x4207, 0x40000000

    def __init__(self, tid):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.ptrace.restype = ctypes.c_long
        self.libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        self.tid = tid
        for request in (self.PTRACE_SEIZE, self.PTRACE_INTERRUPT):
            if self.libc.ptrace(request, tid, None, None) != 0:
                raise OSError(ctypes.get_errno(), f"ptrace {request:#x} of thread {tid}")
        status = ctypes.c_int()
        assert self.libc.waitpid(tid, ctypes.byref(status), self.WALL) == tid

    def resume(self):
        if self.libc.ptrace(self.PTRACE_DETACH, self.tid, None, None) != 0:
            raise OSError(ctypes.get_errno(), f"ptrace detach of thread {self.tid}")


def thread_named(pid, name):
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            if f.read().strip() == name:
                return int(tid)
    pytest.fail(f"no thread '{name}' in process {pid}")


def wait_for(what, predicate, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return time.time()
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def test_a_stalled_engine_fails_liveness_until_it_moves(deployment, pb, baton_bin, model):
    question = random.choice(QUESTIONS)
    address = deployment["stdout"].strip().splitlines()[-1].split()[1]
    stream = ChatStream(pb, address, question, 160)
    stream.wait_tokens(5)
    step = thread_named(int(inspect(container("baton-decode"), "{{.State.Pid}}")), "decode-step")
    stopped = StoppedThread(step)
    stopped_at = time.time()
    try:
        # A token the step finished just before it stopped may still be on its way through the
        # frontend: count from when that has arrived.
        time.sleep(1.0)
        at = stream.tokens
        failed_at = wait_for("liveness to fail", lambda: probe(deployment, "baton-decode", "livenessProbe").returncode
                              == 1, STALL_TIMEOUT + 15)
        assert stream.tokens == at, "tokens came while the engine was stopped"
        p = probe(deployment, "baton-decode", "readinessProbe")
        assert (p.returncode, p.stdout) == (1, "NOT_SERVING\n"), p.stderr
        for name in ("baton-frontend", "baton-prefill"):  # the other pods are not to blame
            assert probe(deployment, name, "livenessProbe").returncode == 0, name
    finally:
        stopped.resume()
    wait_for("liveness to recover", lambda: probe(deployment, "baton-decode", "livenessProbe").returncode == 0, 15)
    print(f"liveness failed {failed_at - stopped_at:.1f} s after the step thread stopped (stall timeout "
          f"{STALL_TIMEOUT} s)")
    assert stream.join() == reference(baton_bin, model, question, 160, ignore_eos=True)
    assert stream.tokens == 160


# ---- failover --------------------------------------------------------------------------------------

def test_decode_pod_killed_mid_stream(deployment, pb, baton_bin, model):
    question = random.choice(QUESTIONS)
    address = deployment["stdout"].strip().splitlines()[-1].split()[1]
    decode = container("baton-decode")
    restarts, pid = int(inspect(decode, "{{.RestartCount}}")), int(inspect(decode, "{{.State.Pid}}"))
    stream = ChatStream(pb, address, question, 160)
    stream.wait_tokens(10)
    os.kill(pid, 9)
    killed_at = time.time()
    text = stream.join()
    assert text == reference(baton_bin, model, question, 160, ignore_eos=True), question
    assert stream.tokens == 160 and stream.final.timing.failovers >= 1, stream.final.timing
    print(f"the stream completed {time.time() - killed_at:.1f} s after the kill")
    wait_for("the decode container to run again",
             lambda: inspect(decode, "{{.State.Status}} {{.RestartCount}}") == f"running {restarts + 1}", 60)
    assert int(inspect(decode, "{{.State.Pid}}")) != pid
    # The frontend sends the restarted worker new work: a new stream runs on it.
    again = ChatStream(pb, address, random.choice(QUESTIONS), 96)
    running = 0
    while again.thread.is_alive() and not running:
        running = counter(metrics_of("baton-decode"), "baton_running_sequences")
        time.sleep(0.05)
    again.join()
    assert running >= 1, "the restarted decode worker never ran the new stream"


# ---- down ------------------------------------------------------------------------------------------

def test_down_leaves_nothing_behind(deployment):
    start = time.monotonic()
    run(REPO / "scripts" / "deploy-local.sh", "down")
    print(f"deploy-local.sh down: {time.monotonic() - start:.0f} s")
    names = {
        "containers": run("podman", "ps", "--all", "--format", "{{.Names}}").stdout.split(),
        "pods": run("podman", "pod", "ps", "--format", "{{.Name}}").stdout.split(),
        "volumes": run("podman", "volume", "ls", "--format", "{{.Name}}").stdout.split(),
        "networks": run("podman", "network", "ls", "--format", "{{.Name}}").stdout.split(),
        "secrets": run("podman", "secret", "ls", "--format", "{{.Name}}").stdout.split(),
    }
    left = {kind: [n for n in found if n.startswith("baton")] for kind, found in names.items()}
    assert not any(left.values()), left
