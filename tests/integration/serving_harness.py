"""Helpers for the serving tests: a running `baton` process, Prometheus text parsing."""

import collections
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running `baton local` (or `baton serve`) process."""

    def __init__(self, baton_bin, model, *extra, subcommand=("local",)):
        self.metrics_port = free_port()
        args = [str(baton_bin), *subcommand, "--model", str(model), "--listen", "127.0.0.1:0",
                "--metrics-listen", f"127.0.0.1:{self.metrics_port}", "--log-level", "warn", *extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     errors="replace")
        deadline = time.time() + 120
        self.port = None
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            m = re.match(r"listening on port (\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
        if self.port is None:
            self.proc.kill()
            raise RuntimeError(f"baton did not start: {self.proc.stderr.read()}")
        self.address = f"127.0.0.1:{self.port}"
        # stderr is read all the time: a test that makes the server log a lot (the request fuzzer)
        # must not fill the pipe and block the server in a write. The last lines are kept.
        self.stderr_tail = collections.deque(maxlen=200)
        self._stderr_reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr_reader.start()

    def _read_stderr(self):
        for line in self.proc.stderr:
            self.stderr_tail.append(line.rstrip("\n"))

    def metrics(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
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


def metric_values(text, name):
    """{labels string: value} of every sample of `name` in Prometheus text format."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            out[key[len(name):]] = float(value)
    return out


def wait_blocks_free(srv, timeout=10):
    """True once every decode worker's free KV blocks equal its capacity (within `timeout` s)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = srv.metrics()
        free = metric_values(text, "baton_kv_blocks_free")
        total = metric_values(text, "baton_kv_blocks_capacity")
        decode_free = {k: v for k, v in free.items() if 'role="decode"' in k}
        decode_total = {k: v for k, v in total.items() if 'role="decode"' in k}
        if decode_free and decode_free == decode_total:
            return True
        time.sleep(0.1)
    return False
