"""Helpers for the serving tests: a running `baton` process, Prometheus text parsing."""

import re
import signal
import socket
import subprocess
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
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
