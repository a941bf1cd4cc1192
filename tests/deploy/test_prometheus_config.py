"""deploy/prometheus: `promtool check config` on the scrape configs, `promtool check rules` and
`promtool test rules` (the alert unit tests) on the rules; the rules read only series the binary
exports (common/metrics.cpp), their own recording rules, `up` and kube-state-metrics; the
alerts the deployment needs exist; the scrape configs find the Services the manifests define.
The Prometheus Adapter rules of deploy/k8s/components/autoscaling discover and query only series
baton exports, with labels they carry, in PromQL that promtool accepts."""

import shutil
import subprocess

import pytest
import yaml

from deploy_helpers import (ADAPTER_VALUES, DEPLOY, EXTERNAL_SERIES, KNOWN_LABELS, adapter_metric_name,
                            adapter_query, adapter_rules, adapter_series_name, find, promql_label_names,
                            promql_series_names, series_names)

PROM = DEPLOY / "prometheus"
CONFIGS = sorted(PROM.glob("prometheus*.yml"))
RULES = sorted((PROM / "rules").glob("*.yml"))
RULE_TESTS = sorted((PROM / "tests").glob("*.yml"))


@pytest.fixture(scope="module")
def promtool():
    path = shutil.which("promtool")
    assert path, "promtool is not installed (Debian package prometheus)"
    return path


def run(*args):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=60)


def rules():
    out = []
    for f in RULES:
        for group in yaml.safe_load(f.read_text())["groups"]:
            out += group["rules"]
    return out


def test_files_are_there():
    assert {c.name for c in CONFIGS} >= {"prometheus.yml", "prometheus-local.yml"}
    assert RULES and RULE_TESTS


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_promtool_check_config(promtool, config):
    out = run(promtool, "check", "config", str(config))
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_check_rules(promtool):
    out = run(promtool, "check", "rules", *map(str, RULES))
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_test_rules(promtool):
    out = run(promtool, "test", "rules", *map(str, RULE_TESTS))
    assert out.returncode == 0, out.stdout + out.stderr


def test_rules_read_only_series_that_exist(metrics):
    known = series_names(metrics) | EXTERNAL_SERIES
    records = {r["record"] for r in rules() if "record" in r}
    problems = []
    for r in rules():
        name = r.get("record") or r.get("alert")
        for s in promql_series_names(r["expr"]):
            if s not in known and s not in records:
                problems.append(f"{name}: {s} is neither exported by baton nor recorded here")
        for label in promql_label_names(r["expr"]) - KNOWN_LABELS:
            problems.append(f"{name}: label {label} is on no baton series")
    assert not problems, "\n".join(problems)
    # Every exported family is used by some rule or by the dashboard (test_grafana_dashboard).


def test_the_alerts_the_deployment_needs():
    alerts = {r["alert"]: r for r in rules() if "alert" in r}
    for name, metric in [("BatonTTFTP99OverSLO", "baton_time_to_first_token_seconds"),
                         ("BatonQueueGrowing", "baton_queue_depth"),
                         ("BatonKVTransferErrors", "baton_kv_transfer_errors"),
                         ("BatonNoHealthyDecodeWorker", 'component="decode"')]:
        assert name in alerts, f"no alert {name}"
        recorded = {r["record"]: r["expr"] for r in rules() if "record" in r}
        expr = alerts[name]["expr"]
        expanded = expr + " ".join(v for k, v in recorded.items() if k in expr)
        assert metric in expanded, f"{name} does not look at {metric}"
    for a in alerts.values():
        assert a["labels"]["severity"] in {"warning", "critical"}
        assert a["annotations"].get("summary") and a["annotations"].get("description")


def test_scrape_configs_label_every_target_with_its_component(rendered):
    """The alerts select targets by `component`; prometheus.yml's DNS names must be the headless
    Services the overlays render, on the metrics port of the pods."""
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    objects = rendered["cpu"]
    names = set()
    for job in cfg["scrape_configs"]:
        relabels = job.get("relabel_configs", [])
        assert any(r.get("target_label") == "component" for r in relabels), f"{job['job_name']}: no component label"
        for sd in job.get("dns_sd_configs", []):
            for dns in sd["names"]:
                service, namespace = dns.split(".")[:2]
                svc = find(objects, "Service", service)
                assert svc, f"{job['job_name']}: {dns} is no Service of the manifests"
                assert svc[0]["spec"].get("clusterIP") == "None", f"{service} is not headless"
                assert svc[0]["metadata"]["namespace"] == namespace
                metrics_ports = [p["port"] for p in svc[0]["spec"]["ports"] if p["name"] == "metrics"]
                assert sd["port"] in metrics_ports, f"{job['job_name']}: port {sd['port']}, Service {metrics_ports}"
                names.add(service)
    assert names == {"baton-frontend", "baton-prefill", "baton-decode"}, names
    local = yaml.safe_load((PROM / "prometheus-local.yml").read_text())
    for job in local["scrape_configs"]:
        for sc in job["static_configs"]:
            assert sc["labels"]["component"] == "local"


def test_adapter_rules_read_series_that_baton_exports(promtool, metrics, tmp_path):
    """Every Prometheus Adapter rule: its seriesQuery discovers a series baton exports, with labels
    baton or the scrape sets; the labels it maps to Kubernetes resources are such labels; its
    metricsQuery, filled in the way the adapter fills it for an HPA's query, reads only exported
    series and known labels, and parses (promtool check rules)."""
    known = series_names(metrics)
    rules = adapter_rules()
    assert rules["custom"] and rules["external"], f"{ADAPTER_VALUES}: no custom or no external rules"
    problems, names, exprs = [], [], []
    for kind, kind_rules in rules.items():
        for r in kind_rules:
            series = adapter_series_name(r)
            name = adapter_metric_name(r)
            where = f"{kind} rule {name}"
            names.append(name)
            if series not in known:
                problems.append(f"{where}: seriesQuery {series} is not exported by baton")
            overrides = r.get("resources", {}).get("overrides", {})
            if not any(v["resource"] == "namespace" for v in overrides.values()):
                problems.append(f"{where}: no namespace mapping (HPAs query per namespace)")
            for label in (promql_label_names(r["seriesQuery"]) | set(overrides)) - KNOWN_LABELS:
                problems.append(f"{where}: label {label} is on no baton series")
            query = adapter_query(r, kind)
            exprs.append(query)
            for s in promql_series_names(query) - known:
                problems.append(f"{where}: metricsQuery reads {s}, which baton does not export")
            for label in promql_label_names(query) - KNOWN_LABELS:
                problems.append(f"{where}: metricsQuery uses label {label}, which no baton series has")
    assert not problems, "\n".join(problems)
    assert len(names) == len(set(names)), f"two rules serve one name: {names}"
    path = tmp_path / "adapter-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "adapter", "rules": [
        {"record": f"adapter:query{i}:value", "expr": e} for i, e in enumerate(exprs)]}]}))
    out = run(promtool, "check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr + "\n".join(exprs)
