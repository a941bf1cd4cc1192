"""deploy/grafana/baton-dashboard.json: valid JSON in Grafana's dashboard model, every query reads
only metric names the binary exports (common/metrics.cpp) and labels baton series carry, every
query is PromQL that promtool parses, every exported metric is on the dashboard, and the panels
the operators need are there: the TTFT breakdown (queue / prefill / KV transfer / first token) per
percentile, throughput and KV blocks."""

import json
import re
import shutil
import subprocess

import pytest
import yaml

from deploy_helpers import (DEPLOY, KNOWN_LABELS, dashboard_exprs, grafana_to_promql, promql_label_names,
                            promql_series_names, series_names)

DASHBOARD = DEPLOY / "grafana" / "baton-dashboard.json"


@pytest.fixture(scope="module")
def dashboard():
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard):
    out = []

    def walk(panels):
        for p in panels:
            out.append(p)
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    return out


def test_dashboard_model(dashboard):
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", f"{p['title']}: hard-wired data source"
        assert p["targets"], f"{p['title']}: no query"
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, f"{p['title']}: outside the 24-column grid"


def test_queries_use_only_exported_metrics_and_labels(dashboard, metrics):
    known = series_names(metrics) | {"up"}
    problems = []
    for title, expr in dashboard_exprs(dashboard):
        for name in promql_series_names(grafana_to_promql(expr)):
            if name not in known:
                problems.append(f"{title}: {name} is not exported by baton (common/metrics.cpp)")
        for label in promql_label_names(expr) - KNOWN_LABELS:
            problems.append(f"{title}: label {label} is on no baton series")
    assert not problems, "\n".join(problems)


def test_every_exported_metric_is_on_the_dashboard(dashboard, metrics):
    used = set()
    for _, expr in dashboard_exprs(dashboard):
        used |= promql_series_names(grafana_to_promql(expr))
    for name, kind in metrics.items():
        forms = {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
        assert used & forms, f"{name} is exported but on no panel"


def test_queries_are_valid_promql(dashboard, tmp_path):
    """promtool parses every query (as recording rules), Grafana variables filled in."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed (Debian package prometheus)"
    rules = [{"record": f"dashboard:query:{i}", "expr": grafana_to_promql(expr)}
             for i, (_, expr) in enumerate(dashboard_exprs(dashboard))]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ttft_breakdown_per_percentile(dashboard):
    stages = {"baton_request_queue_seconds", "baton_request_prefill_seconds", "baton_kv_transfer_seconds",
              "baton_time_to_first_token_seconds"}
    panels = {p["title"]: p for p in all_panels(dashboard)}
    for name, q in (("p50", "0.5"), ("p90", "0.9"), ("p99", "0.99")):
        title = f"TTFT breakdown {name}"
        assert title in panels, f"no panel {title!r}"
        seen = set()
        for t in panels[title]["targets"]:
            m = re.match(r"histogram_quantile\(([\d.]+), sum by \(le\) \(rate\((\w+)_bucket", t["expr"])
            assert m, f"{title}: {t['expr']}"
            assert m.group(1) == q, f"{title}: quantile {m.group(1)}"
            seen.add(m.group(2))
        assert seen == stages, f"{title}: {seen}"


def test_throughput_and_kv_block_panels(dashboard):
    exprs = " ".join(e for _, e in dashboard_exprs(dashboard))
    for needle in ("rate(baton_generation_tokens_total", "rate(baton_requests_total", "baton_kv_blocks_free",
                   "baton_kv_blocks_capacity"):
        assert needle in exprs, f"no panel uses {needle}"
