"""`batonctl doctor` against real `baton serve` processes on loopback (the random test model):

- a healthy deployment of 2 prefill and 2 decode workers: exit 0, every link measured with a
  bandwidth > 0 over tcp, the JSON has every field; the probes show up in baton_kv_probes_total
  and in no request metric, hold no KV block, and serving gives the same greedy tokens after;
- through the frontend (Admin.ListWorkers): the same workers, found without listing them; the
  list is refused without the privilege (no key, a key without `admin`, a remote caller of a
  frontend without keys) and given to a key marked `admin`;
- a decode worker of another model, a worker with another --kv-dtype, a killed worker: exit 1,
  the problem and its fix named on the right row;
- a worker whose clock is 5 s off (a fake worker that reports a skewed wall clock): flagged; the
  same fake with a true clock is not;
- mutual TLS inside: doctor works with the deployment's certificate and fails clearly without
  one or with another CA's;
- the probe RPCs' bounds hold against a caller that ignores batonctl's, and bad flags exit 2.
"""

import json
import os
import re
import socket
import subprocess
import time
from concurrent import futures

import grpc
import pytest

from serving_harness import Pki, internal_flags, make_test_model, metric_values
from test_serving import generate, reference_ids

PROMPT = [5, 17, 99, 3, 250, 41, 7, 12]
KEY = "key-" + os.urandom(16).hex()
ADMIN_KEY = "key-" + os.urandom(16).hex()
SMALL = ("--kv-bytes", "1MiB", "--rounds", "2")  # quick probes where the numbers do not matter


@pytest.fixture(scope="module")
def other_model(baton_bin, tmp_path_factory):
    """The test model's shape with other weights: another fingerprint."""
    return make_test_model(baton_bin, tmp_path_factory.mktemp("other") / "other.gguf", seed=8, layers=2, dim=64,
                           heads=4, kv_heads=2, ffn=128, ctx=1024)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    p = Pki(tmp_path_factory.mktemp("pki"))
    p.internal_ca = p.ca("baton-internal-ca")
    p.public_ca = p.ca("baton-public-ca")
    p.rogue_ca = p.ca("rogue-ca")
    p.roles = {r: p.leaf(f"baton-{r}", p.internal_ca) for r in ("frontend", "prefill", "decode", "doctor")}
    p.rogue = p.leaf("rogue", p.rogue_ca)
    p.public = p.leaf("baton-public", p.public_ca)
    p.client = p.leaf("client-ops", p.public_ca)
    return p


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(f"{KEY}\n{ADMIN_KEY} admin\n")
    return path


def worker(server_factory, model, role, *extra):
    return server_factory(model, "--threads", "1", "--dtype", "f32", *extra, subcommand=("serve", "--role", role))


def frontend(server_factory, model, prefill, decode, *extra, listen="127.0.0.1:0"):
    return server_factory(model, "--prefill-addresses", ",".join(p.address for p in prefill), "--decode-addresses",
                          ",".join(d.address for d in decode), *extra, subcommand=("serve", "--role", "frontend"),
                          listen=listen)


def doctor(batonctl, *args, env=None, timeout=180):
    return subprocess.run([str(batonctl), "doctor", *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def lists(prefill, decode):
    return ("--prefill-addresses", ",".join(p.address for p in prefill), "--decode-addresses",
            ",".join(d.address for d in decode))


def row(stdout, *cells):
    """The table line holding every one of `cells`."""
    lines = [line for line in stdout.splitlines() if all(c in line for c in cells)]
    assert lines, f"no line with {cells} in:\n{stdout}"
    return lines[0]


def problem_block(stdout, subject):
    """'- <subject>: what' and its 'fix:' line, as one string."""
    m = re.search(r"^  - " + re.escape(subject) + r": (.*)\n    fix: (.*)$", stdout, re.M)
    assert m, f"no problem for {subject!r} in:\n{stdout}"
    return m.group(1) + " | fix: " + m.group(2)


@pytest.fixture
def deployment(test_model, server_factory):
    prefill = [worker(server_factory, test_model, "prefill") for _ in range(2)]
    decode = [worker(server_factory, test_model, "decode") for _ in range(2)]
    front = frontend(server_factory, test_model, prefill, decode)
    return front, prefill, decode


def test_a_healthy_deployment_passes_with_every_link_measured(batonctl, pb, baton_bin, test_model, deployment,
                                                             tmp_path):
    front, prefill, decode = deployment
    out = tmp_path / "doctor.json"
    got = doctor(batonctl, *lists(prefill, decode), "--json", out)
    assert got.returncode == 0, got.stdout + got.stderr
    assert "no problems" in got.stdout
    for w in prefill + decode:
        assert " OK " in row(got.stdout, w.address, "SERVING")
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["frontend"] is None
    assert report["kv_bytes"] == 16 << 20 and report["rounds"] == 3
    assert len(report["workers"]) == 4 and not report["problems"]
    for w in report["workers"]:
        assert w["ok"] and w["reachable"] and w["health"] == "SERVING"
        assert w["kv_dtype"] == "f32" and w["block_size"] == 16 and w["version"]
        assert len(w["model_fingerprint"]) == 16
        assert abs(w["clock_offset_seconds"]) < 1 and w["rtt_seconds"] > 0
        assert (w["kv_transport"] == "tcp") if w["role"] == "prefill" else ("tcp" in w["kv_transports"])
    assert {(l["prefill"], l["decode"]) for l in report["links"]} == {
        (p.address, d.address) for p in prefill for d in decode}
    for link in report["links"]:
        assert link["ok"] and link["measured"] and link["transport"] == "tcp"
        assert link["bandwidth_bytes_per_second"] > 0 and len(link["seconds"]) == 3
        assert 0 < link["bytes"] <= 16 << 20 and link["latency_median_seconds"] > 0
        assert link["bandwidth_bytes_per_second"] == pytest.approx(link["bytes"] / sorted(link["seconds"])[1])
        assert row(got.stdout, f"{link['prefill']} -> {link['decode']}", "tcp", " OK ")

    # The probes are counted apart: in baton_kv_probes_total, in no request metric, on no KV block.
    for p in prefill:
        text = p.metrics()
        assert sum(metric_values(text, "baton_kv_probes_total").get(k, 0) for k in
                   metric_values(text, "baton_kv_probes_total") if 'result="ok"' in k) == 2  # one per decode worker
        assert not any(v for v in metric_values(text, "baton_kv_transfer_bytes_total").values())
    for d in decode:
        text = d.metrics()
        ok = [v for k, v in metric_values(text, "baton_kv_probes_total").items() if 'result="ok"' in k]
        assert ok == [2 * 2 * 3]  # 2 prefill workers x (3 minimal + 3 large transfers)
        assert sum(metric_values(text, "baton_kv_probe_bytes_total").values()) >= 2 * 3 * report["links"][0]["bytes"]
        assert metric_values(text, "baton_kv_blocks_free") == metric_values(text, "baton_kv_blocks_capacity")
    assert not any(v for k, v in metric_values(front.metrics(), "baton_requests_total").items())
    # Serving is undisturbed: the same greedy tokens as a single process.
    want = reference_ids(baton_bin, test_model, PROMPT, 12)
    assert generate(pb, front.address, prompt_token_ids=PROMPT, max_tokens=12, ignore_eos=True)[0] == want


def test_the_frontend_lists_its_workers_to_a_caller_on_its_host(batonctl, deployment, tmp_path):
    front, prefill, decode = deployment
    out = tmp_path / "doctor.json"
    got = doctor(batonctl, "--frontend", front.address, *SMALL, "--json", out)
    assert got.returncode == 0, got.stdout + got.stderr
    report = json.loads(out.read_text())
    assert report["frontend"]["address"] == front.address and report["frontend"]["ok"]
    assert report["frontend"]["model_fingerprint"] == report["workers"][0]["model_fingerprint"]
    assert sorted(w["address"] for w in report["workers"] if w["role"] == "prefill") == sorted(
        p.address for p in prefill)
    assert sorted(w["address"] for w in report["workers"] if w["role"] == "decode") == sorted(
        d.address for d in decode)
    assert all(w["frontend_healthy"] is True for w in report["workers"])
    assert len(report["links"]) == 4 and all(l["measured"] for l in report["links"])
    assert " OK " in row(got.stdout, "frontend", front.address)


def local_ipv4():
    """This host's address on a non-loopback interface (None when it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this picks the route's source address
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_listing_the_workers_needs_the_privilege(batonctl, test_model, server_factory, key_file):
    prefill = [worker(server_factory, test_model, "prefill")]
    decode = [worker(server_factory, test_model, "decode")]
    front = frontend(server_factory, test_model, prefill, decode, "--api-key-file", key_file)
    got = doctor(batonctl, "--frontend", front.address, *SMALL)
    assert got.returncode == 1, got.stdout + got.stderr
    block = problem_block(got.stdout, f"frontend {front.address}")
    assert "ListWorkers refused (UNAUTHENTICATED" in block and "admin" in block and "--api-key" in block
    assert prefill[0].address not in got.stdout  # nothing of the topology
    got = doctor(batonctl, "--frontend", front.address, *SMALL, env={"BATONCTL_API_KEY": KEY})
    assert got.returncode == 1
    block = problem_block(got.stdout, f"frontend {front.address}")
    assert "PERMISSION_DENIED" in block and "add 'admin'" in block
    assert prefill[0].address not in got.stdout
    got = doctor(batonctl, "--frontend", front.address, *SMALL, "--api-key", ADMIN_KEY)
    assert got.returncode == 0, got.stdout + got.stderr
    assert prefill[0].address in got.stdout and decode[0].address in got.stdout

    # Without API keys only callers on the frontend's host: one reached over another interface is not.
    ip = local_ipv4()
    if ip is None:
        pytest.skip("no non-loopback interface to call the frontend from another address")
    remote = frontend(server_factory, test_model, prefill, decode, "--insecure", listen=f"{ip}:0")
    got = doctor(batonctl, "--frontend", f"{ip}:{remote.port}", *SMALL)
    assert got.returncode == 1
    block = problem_block(got.stdout, f"frontend {ip}:{remote.port}")
    assert "PERMISSION_DENIED" in block and "own host" in block
    assert prefill[0].address not in got.stdout


def test_a_decode_worker_of_another_model_is_named_with_the_fix(batonctl, test_model, other_model, server_factory):
    prefill = [worker(server_factory, test_model, "prefill")]
    decode = [worker(server_factory, test_model, "decode"), worker(server_factory, other_model, "decode")]
    got = doctor(batonctl, *lists(prefill, decode), *SMALL)
    assert got.returncode == 1, got.stdout + got.stderr
    block = problem_block(got.stdout, f"decode worker {decode[1].address}")
    assert "fingerprint" in block and "deploy the same model file on every role" in block
    assert "PROBLEM" in row(got.stdout, "decode", decode[1].address)
    assert " OK " in row(got.stdout, "decode", decode[0].address)
    # The probe to it is refused by the decode worker's own check, as real KV would be.
    link = problem_block(got.stdout, f"link {prefill[0].address} -> {decode[1].address}")
    assert "FAILED_PRECONDITION" in link and "same model file" in link
    assert " OK " in row(got.stdout, f"{prefill[0].address} -> {decode[0].address}")


def test_a_worker_with_another_kv_dtype_is_named(batonctl, test_model, server_factory, tmp_path):
    prefill = [worker(server_factory, test_model, "prefill")]
    decode = [worker(server_factory, test_model, "decode"), worker(server_factory, test_model, "decode",
                                                                   "--kv-dtype", "bf16")]
    out = tmp_path / "doctor.json"
    got = doctor(batonctl, *lists(prefill, decode), *SMALL, "--json", out)
    assert got.returncode == 1, got.stdout + got.stderr
    block = problem_block(got.stdout, f"decode worker {decode[1].address}")
    assert "KV dtype differs" in block and "bf16" in block and "--kv-dtype" in block
    problems = json.loads(out.read_text())["problems"]
    assert {(p["kind"], p["address"]) for p in problems} == {
        ("decode", decode[1].address), ("link", f"{prefill[0].address} -> {decode[1].address}")}
    assert all(p["fix"] for p in problems)


def test_a_killed_worker_is_unreachable(batonctl, deployment):
    front, prefill, decode = deployment
    decode[1].proc.kill()
    decode[1].proc.wait()
    got = doctor(batonctl, *lists(prefill, decode), *SMALL)
    assert got.returncode == 1, got.stdout + got.stderr
    block = problem_block(got.stdout, f"decode worker {decode[1].address}")
    assert "unreachable (UNAVAILABLE" in block and "NetworkPolicy" in block
    assert "unreachable" in row(got.stdout, "decode", decode[1].address)
    for p in prefill:
        assert "SKIPPED" in row(got.stdout, f"{p.address} -> {decode[1].address}")
        assert " OK " in row(got.stdout, f"{p.address} -> {decode[0].address}")
    # Through the frontend too: it still lists the worker, and sees it unhealthy.
    got = doctor(batonctl, "--frontend", front.address, *SMALL)
    assert got.returncode == 1
    assert "unreachable" in problem_block(got.stdout, f"decode worker {decode[1].address}")


class FakePrefillWorker:
    """A prefill worker that answers health, GetLoad (a copy of `like`'s report, its wall clock
    `offset` seconds off) and ProbeKv (a plausible measurement): what doctor sees of a worker on a
    node whose clock is wrong, without touching any real clock."""

    def __init__(self, pb, like, offset):
        w, wg = pb.worker, pb.worker_grpc

        class Servicer(wg.PrefillWorkerServicer):
            def GetLoad(self, request, context):
                r = w.LoadReport()
                r.CopyFrom(like)
                r.kv_transport, r.wall_time_unix_nanos = "tcp", time.time_ns() + int(offset * 1e9)
                del r.kv_transports[:]
                return r

            def ProbeKv(self, request, context):
                return w.KvProbeResponse(transport="tcp", bytes=request.bytes, seconds=[0.01] * request.rounds,
                                         latency_bytes=512, latency_seconds=[0.001] * request.rounds)

        def health(request, context):
            return b"\x08\x01"  # HealthCheckResponse{status: SERVING}

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        wg.add_PrefillWorkerServicer_to_server(Servicer(), self.server)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
            "Check": grpc.unary_unary_rpc_method_handler(health, request_deserializer=lambda b: b,
                                                         response_serializer=lambda b: b)}),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()


@pytest.mark.parametrize("offset", [5.0, -5.0, 0.0])
def test_a_skewed_clock_is_flagged(batonctl, pb, test_model, server_factory, offset):
    decode = [worker(server_factory, test_model, "decode")]
    with grpc.insecure_channel(decode[0].address) as ch:
        like = pb.worker_grpc.DecodeWorkerStub(ch).GetLoad(pb.worker.LoadRequest(), timeout=10)
    fake = FakePrefillWorker(pb, like, offset)
    try:
        got = doctor(batonctl, "--prefill-addresses", fake.address, "--decode-addresses", decode[0].address, *SMALL)
    finally:
        fake.server.stop(None)
    if offset == 0:
        assert got.returncode == 0, got.stdout + got.stderr
        return
    assert got.returncode == 1, got.stdout + got.stderr
    block = problem_block(got.stdout, f"prefill worker {fake.address}")
    assert ("ahead of" if offset > 0 else "behind") in block and "NTP" in block
    # One exchange bounds the offset to within half its round trip (the fake stamps its clock
    # somewhere inside it): on a busy machine the round trip is tens of milliseconds.
    m = re.search(r"clock is (\d+\.\d+) s (?:ahead of|behind) this machine's \(round trip (\d+\.\d+) s", block)
    assert m, block
    assert abs(float(m[1]) - 5.0) <= float(m[2]) / 2 + 0.01, block
    assert got.stdout.count("  - ") == 1  # the only problem


def test_mutual_tls_inside_needs_the_deployment_certificate(batonctl, pki, test_model, server_factory, key_file,
                                                           tmp_path):
    prefill = [worker(server_factory, test_model, "prefill", *internal_flags(pki, "prefill"))]
    decode = [worker(server_factory, test_model, "decode", *internal_flags(pki, "decode")) for _ in range(2)]
    front = frontend(server_factory, test_model, prefill, decode, *internal_flags(pki, "frontend"), "--tls-cert",
                     pki.public[0], "--tls-key", pki.public[1], "--tls-client-ca", pki.public_ca[0],
                     "--api-key-file", key_file)
    crt, key = pki.roles["doctor"]
    mtls = ("--internal-tls-ca", pki.internal_ca[0], "--internal-tls-cert", crt, "--internal-tls-key", key)
    got = doctor(batonctl, *lists(prefill, decode), *SMALL, *mtls)
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stdout.count(" OK ") >= 3 + 2  # three workers, two links
    # The same from the roles' environment variables, as in a pod with common.env.
    env = {"BATON_INTERNAL_TLS_CA": str(pki.internal_ca[0]), "BATON_INTERNAL_TLS_CERT": str(crt),
           "BATON_INTERNAL_TLS_KEY": str(key)}
    out = tmp_path / "doctor.json"
    got = doctor(batonctl, "--frontend", front.address, "--tls-ca", pki.public_ca[0], "--tls-cert", pki.client[0],
                 "--tls-key", pki.client[1], "--api-key", ADMIN_KEY, *SMALL, "--json", out, env=env)
    assert got.returncode == 0, got.stdout + got.stderr
    assert all(l["measured"] for l in json.loads(out.read_text())["links"])

    # Without a certificate, or with another CA's: every worker unreachable, and the fix says so.
    got = doctor(batonctl, *lists(prefill, decode), *SMALL)
    assert got.returncode == 1
    for w in prefill + decode:
        block = problem_block(got.stdout, f"{'prefill' if w in prefill else 'decode'} worker {w.address}")
        assert "unreachable" in block and "--internal-tls-ca" in block
    got = doctor(batonctl, *lists(prefill, decode), *SMALL, "--internal-tls-ca", pki.rogue_ca[0], "--internal-tls-cert",
                 pki.rogue[0], "--internal-tls-key", pki.rogue[1])
    assert got.returncode == 1
    assert "same internal CA" in problem_block(got.stdout, f"prefill worker {prefill[0].address}")
    # A public client certificate opens nothing inside either.
    got = doctor(batonctl, *lists(prefill, decode), *SMALL, "--internal-tls-ca", pki.internal_ca[0],
                 "--internal-tls-cert", pki.client[0], "--internal-tls-key", pki.client[1])
    assert got.returncode == 1 and "unreachable" in problem_block(got.stdout, f"decode worker {decode[0].address}")


def test_probe_bounds_hold_for_any_caller(pb, test_model, server_factory):
    """What batonctl checks before asking, the workers check again: ProbeKv's size and rounds, and
    a probe transfer's size at the decode worker (the worker carries on after each refusal)."""
    prefill = worker(server_factory, test_model, "prefill")
    decode = worker(server_factory, test_model, "decode")
    w = pb.worker
    with grpc.insecure_channel(prefill.address) as ch:
        stub = pb.worker_grpc.PrefillWorkerStub(ch)
        for bytes_, rounds in ((0, 1), ((256 << 20) + 1, 1), (1024, 0), (1024, 33)):
            with pytest.raises(grpc.RpcError) as e:
                stub.ProbeKv(w.KvProbeRequest(decode_address=decode.address, bytes=bytes_, rounds=rounds), timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (bytes_, rounds)
        r = stub.ProbeKv(w.KvProbeRequest(decode_address=decode.address, bytes=1 << 20, rounds=2), timeout=60)
        assert r.transport == "tcp" and len(r.seconds) == 2 and r.bytes <= 1 << 20
    with grpc.insecure_channel(decode.address) as ch:
        load = pb.worker_grpc.DecodeWorkerStub(ch).GetLoad(w.LoadRequest(), timeout=10)
        # One token of every layer is 2 x 2 kv heads x 16 x 4 bytes x 2 layers = 512 bytes: a header for
        # more than 256 MiB of them is refused before a chunk moves.
        n_tokens = (256 << 20) // 512 + 1
        header = w.KvHeader(request_id="probe-x", model_fingerprint=load.model_fingerprint, dtype="f32", n_layers=2,
                            n_kv_heads=2, head_dim=16, n_tokens=n_tokens, token_ids=[0] * n_tokens, probe=True)
        with pytest.raises(grpc.RpcError) as e:
            pb.worker_grpc.DecodeWorkerStub(ch).TransferKv(iter([w.KvMessage(header=header)]), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit" in e.value.details()
    failed = [v for k, v in metric_values(decode.metrics(), "baton_kv_probes_total").items() if 'result="failed"' in k]
    assert failed == [1]


def test_bad_usage_exits_2(batonctl, tmp_path):
    for args, pattern in [((), "either --frontend"),
                          (("--frontend", "127.0.0.1:1", "--decode-addresses", "127.0.0.1:2"), "excludes"),
                          (("--decode-addresses", "127.0.0.1:2", "--kv-bytes", "300MiB"), "kv-bytes"),
                          (("--decode-addresses", "127.0.0.1:2", "--rounds", "0"), "rounds"),
                          (("--decode-addresses", "127.0.0.1:2", "--internal-tls-ca", tmp_path / "none.pem"),
                           "mutual TLS needs")]:
        got = doctor(batonctl, *args)
        assert got.returncode == 2, (args, got.stdout, got.stderr)
        assert re.search(pattern, got.stderr), (args, got.stderr)
