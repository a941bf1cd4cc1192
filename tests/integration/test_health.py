"""grpc.health.v1 as probes see it, through `batonctl health` (the exec probe of runtimes without
native gRPC probes, deploy/podman): every role answers "" (readiness) and "liveness" on its main
port and on the plaintext --health-listen port. Readiness follows what the role can take (a
frontend without workers is not ready) and liveness only whether the process works: a frontend
whose workers are gone, or a role that drains, stays live, so a liveness probe restarts neither.
An unknown service, an unreachable address and bad flags are each one error line with exit 1 or 2."""

import signal
import subprocess
import time

import pytest

from serving_harness import Server, free_port
from test_drain import start_streams


def health(batonctl, address, *extra):
    return subprocess.run([str(batonctl), "health", "--address", address, *extra], capture_output=True, text=True,
                          timeout=30)


def one_error_line(proc, code, text):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1, (proc.returncode, proc.stderr)
    assert lines[0].startswith("batonctl: error: ") and text in lines[0], lines[0]


def test_readiness_and_liveness_of_every_role(batonctl, baton_bin, test_model, server_factory):
    worker_health = {}
    for role in ("prefill", "decode"):
        worker_health[role] = f"127.0.0.1:{free_port()}"
        w = server_factory(test_model, "--health-listen", worker_health[role], subcommand=("serve", "--role", role))
        for address in (w.address, worker_health[role]):
            for service in ([], ["--service", "liveness"]):
                p = health(batonctl, address, *service)
                assert (p.returncode, p.stdout) == (0, "SERVING\n"), (role, address, service, p.stderr)
    one_error_line(health(batonctl, worker_health["decode"], "--service", "no.such.Service"), 1,
                   "does not report this service")


def test_a_frontend_without_workers_is_live_but_not_ready(batonctl, baton_bin, test_model, server_factory):
    gone = f"127.0.0.1:{free_port()}"  # nobody listens there
    port = f"127.0.0.1:{free_port()}"
    server_factory(test_model, "--prefill-addresses", gone, "--decode-addresses", gone, "--health-listen", port,
                   subcommand=("serve", "--role", "frontend"))
    deadline = time.time() + 30
    while (p := health(batonctl, port)).returncode == 0 and time.time() < deadline:
        time.sleep(0.2)  # until its first polls of the workers have failed
    assert p.stdout == "NOT_SERVING\n", (p.stdout, p.stderr)
    one_error_line(p, 1, f"{port} is NOT_SERVING")
    live = health(batonctl, port, "--service", "liveness")
    assert (live.returncode, live.stdout) == (0, "SERVING\n"), live.stderr


def test_a_draining_role_is_not_ready_and_still_live(pb, batonctl, baton_bin, test_model):
    port = f"127.0.0.1:{free_port()}"
    srv = Server(baton_bin, test_model, "--drain-timeout", "60", "--health-listen", port)
    try:
        threads, results, _, started = start_streams(pb, srv, 4, 900)
        started.wait(timeout=60)
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 10
        while (ready := health(batonctl, port)).returncode == 0 and time.time() < deadline:
            time.sleep(0.05)
        live = health(batonctl, port, "--service", "liveness")
        still_streaming = any(t.is_alive() for t in threads)
        for t in threads:
            t.join(timeout=120)
        assert ready.stdout == "NOT_SERVING\n", (ready.stdout, ready.stderr)
        assert (live.returncode, live.stdout) == (0, "SERVING\n"), live.stderr
        assert still_streaming, "the checks must come while the drain still has streams to finish"
        assert results == [900] * 4, results
        assert srv.proc.wait(timeout=60) == 0
    finally:
        srv.stop()


def test_errors_are_one_line(batonctl):
    closed = f"127.0.0.1:{free_port()}"
    one_error_line(health(batonctl, closed, "--timeout", "2"), 1, "health check failed: UNAVAILABLE")
    one_error_line(health(batonctl, closed, "--timeout", "0"), 2, "--timeout")
    one_error_line(health(batonctl, closed, "--tls-ca", "/nonexistent/ca.pem"), 2, "--tls-ca")
