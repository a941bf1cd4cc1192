"""A real Prometheus server (Debian package prometheus) scrapes a running `baton local` with the
shipped deploy/prometheus/prometheus-local.yml (scrape and rule intervals cut to 1 s, the target
moved to the test's port) and its rules; after a few Generate requests the TTFT p90 query returns
a number, the recording rules evaluate, and every dashboard query runs on real data."""

import json
import math
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import grpc
import pytest
import yaml

from deploy_helpers import DEPLOY, dashboard_exprs, grafana_to_promql
from serving_harness import Server, free_port

TTFT_P90 = "histogram_quantile(0.9, sum by (le) (rate(baton_time_to_first_token_seconds_bucket[1m])))"
# Families that appear only once something happens that these requests do not cause.
ONLY_ON_EVENTS = {"baton_kv_transfer_errors_total"}


class Prometheus:
    def __init__(self, config, workdir):
        binary = shutil.which("prometheus")
        assert binary, "prometheus is not installed (Debian package prometheus)"
        self.port = free_port()
        self.log = open(workdir / "prometheus.log", "w+")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def get(self, path, timeout=5):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout) as r:
            return r.read().decode()

    def query(self, expr):
        """The API's answer to an instant query: (status, [(labels, float)])."""
        body = json.loads(self.get("/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
        result = body.get("data", {}).get("result", [])
        if body.get("data", {}).get("resultType") == "scalar":
            result = [{"metric": {}, "value": result}]
        return body["status"], [(r["metric"], float(r["value"][1])) for r in result]

    def wait(self, what, predicate, timeout):
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            assert self.proc.poll() is None, f"prometheus exited: {self.logs()}"
            try:
                last = predicate()
                if last:
                    return last
            except (OSError, ValueError) as e:  # not listening yet
                last = e
            time.sleep(0.25)
        pytest.fail(f"timed out waiting for {what} (last: {last}); prometheus log:\n{self.logs()}")

    def logs(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def finite_value(prom, expr):
    status, result = prom.query(expr)
    assert status == "success"
    values = [v for _, v in result if math.isfinite(v)]
    return values[0] if values else None


def generate(pb, address, prompt_ids, max_tokens):
    req = pb.gen.GenerateRequest(prompt_token_ids=prompt_ids, max_tokens=max_tokens, ignore_eos=True)
    with grpc.insecure_channel(address) as ch:
        msgs = list(pb.gen_grpc.GenerationStub(ch).Generate(req, timeout=30))
    assert msgs and msgs[-1].HasField("final")
    return msgs[-1].final


def live_families(text):
    return {m[0]: m[1] for m in (line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE baton_"))}


@pytest.fixture
def baton_local(baton_bin, test_model):
    server = Server(baton_bin, test_model, "--drain-timeout", "5")
    yield server
    server.stop()


def local_config(baton_local, tmp_path):
    """deploy/prometheus/prometheus-local.yml with 1 s intervals, scraping the test's baton local."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-local.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str((DEPLOY / "prometheus" / f).resolve()) for f in config["rule_files"]]
    (job,) = config["scrape_configs"]
    job["static_configs"][0]["targets"] = [f"127.0.0.1:{baton_local.metrics_port}"]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path, job


def test_prometheus_scrapes_baton_local(baton_local, pb, metrics, tmp_path):
    path, job = local_config(baton_local, tmp_path)
    prom = Prometheus(path, tmp_path)
    try:
        prom.wait("Prometheus to be ready", lambda: "Ready" in prom.get("/-/ready"), 30)
        # A scrape before the requests, so that rate() sees the counts change.
        prom.wait("the first scrape of baton", lambda: finite_value(prom, f'up{{job="{job["job_name"]}"}}') == 1, 20)

        # The frontend creates its latency histograms at the first request: one request, a scrape
        # that sees them, then more, so that rate() sees their counts grow.
        generate(pb, baton_local.address, [3, 17, 42], max_tokens=2)
        prom.wait("the TTFT histogram in a scrape",
                  lambda: finite_value(prom, "sum(baton_time_to_first_token_seconds_count)"), 20)
        for i in range(5):
            final = generate(pb, baton_local.address, [5 + i, 17, 42, 99, 7], max_tokens=4)
            assert final.usage.completion_tokens == 4

        p90 = prom.wait("a number from the TTFT p90 query", lambda: finite_value(prom, TTFT_P90), 30)
        assert 0 < p90 < 120, p90  # within the histogram's buckets

        # The shipped recording rules evaluate on the same data.
        prom.wait("the TTFT p99 recording rule",
                  lambda: finite_value(prom, "namespace:baton_time_to_first_token_seconds:p99_5m"), 15)
        ok = prom.wait("the requests rate rule", lambda: prom.query('namespace_code:baton_requests:rate5m{code="OK"}')[1], 15)
        assert ok[0][1] > 0

        # Every dashboard query is accepted and evaluated by Prometheus; the TTFT ones give numbers.
        for title, expr in dashboard_exprs(json.loads((DEPLOY / "grafana" / "baton-dashboard.json").read_text())):
            status, result = prom.query(grafana_to_promql(expr))
            assert status == "success", f"{title}: {expr}"
            if "time_to_first_token" in expr and "histogram_quantile" in expr:
                assert any(math.isfinite(v) for _, v in result), f"{title}: no number from {expr}"

        # The alerts load; with baton local healthy none of the health alerts fires.
        rules = json.loads(prom.get("/api/v1/rules"))["data"]["groups"]
        alerts = {r["name"]: r for g in rules for r in g["rules"] if r["type"] == "alerting"}
        assert "BatonNoHealthyDecodeWorker" in alerts
        for name in ("BatonNoHealthyDecodeWorker", "BatonNoHealthyPrefillWorker", "BatonFrontendDown"):
            assert alerts[name]["state"] == "inactive", f"{name} is {alerts[name]['state']} for a healthy baton local"
    finally:
        prom.stop()

    # What the binary serves is what common/metrics.cpp declares (the dashboard test reads the latter).
    live = live_families(baton_local.metrics())
    assert {n: t for n, t in live.items() if n in metrics} == live, f"undeclared families: {set(live) - set(metrics)}"
    assert all(metrics[n] == t for n, t in live.items())
    assert set(metrics) - set(live) <= ONLY_ON_EVENTS, f"declared, never served: {set(metrics) - set(live)}"


def test_idle_connections_cannot_blind_monitoring(baton_local, tmp_path):
    """200 connections to the metrics port, 50 times its 4 threads: half send nothing (idle
    clients), half half a request line (a slowloris). The real Prometheus keeps scraping (fresh
    successful scrapes while they are open), a direct fetch is answered at once, and promtool
    accepts what it returns."""
    path, job = local_config(baton_local, tmp_path)
    prom = Prometheus(path, tmp_path)
    idle = []
    try:
        prom.wait("Prometheus to be ready", lambda: "Ready" in prom.get("/-/ready"), 30)
        up = f'up{{job="{job["job_name"]}"}}'
        prom.wait("the first scrape of baton", lambda: finite_value(prom, up) == 1, 20)
        for i in range(200):
            s = socket.create_connection(("127.0.0.1", baton_local.metrics_port), timeout=5)
            if i % 2:
                s.sendall(b"GET /metr")
            idle.append(s)
        opened = time.time()
        t0 = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{baton_local.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        fetch_s = time.monotonic() - t0
        assert fetch_s < 2, f"/metrics took {fetch_s:.1f} s with 200 idle or slow connections open"
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        # Scrapes that started after the idle connections opened, and succeeded.
        prom.wait("a successful scrape with the idle connections open",
                  lambda: finite_value(prom, f"timestamp({up})") > opened + 1 and finite_value(prom, up) == 1, 15)
    finally:
        for s in idle:
            s.close()
        prom.stop()
