"""Shared helpers of the deploy/ tests: paths, the flags `baton serve` accepts, the metric names
the binary exports, rendering the kustomize overlays and reading the objects they render, and
picking names out of PromQL."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))


def baton_binary():
    path = Path(os.environ.get("BATON_BIN", REPO / "build" / "baton"))
    return path if path.exists() else None


# ---- flags -----------------------------------------------------------------------------------

class Flags:
    """The options of `baton serve`: env[flag] = its BATON_* variable (or None), spec[flag] = CLI11's
    type text from --help (`INT:INT in [1 - 4096]`, `TEXT:{f32,bf16}`; None when read from source)."""

    def __init__(self, env, spec, where):
        self.env, self.spec, self.where = env, spec, where
        self.by_env = {e: f for f, e in env.items() if e}


def flags_from_help(text):
    env, spec = {}, {}
    for line in text.splitlines():
        m = re.match(r"\s+(?:-\w,)?(--[a-z0-9][a-z0-9-]*)\b(.*)", line)
        if m and m.group(1) != "--help":
            rest = m.group(2)
            e = re.search(r"\(Env:(\w+)\)", rest)
            env[m.group(1)] = e.group(1) if e else None
            spec[m.group(1)] = re.sub(r"\s*\(Env:\w+\)|\s*REQUIRED", "", rest).strip() or None
    return env, spec


def _statement_end(src, i):
    """Index of the `;` that ends the C++ statement going on at src[i] (one inside a string literal,
    e.g. in an option's help text, does not end it)."""
    in_string = False
    while i < len(src):
        ch = src[i]
        if in_string:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == ";":
            return i
        i += 1
    return i


def _options(src, receiver=""):
    """{flag: env or None} of the add_option calls in src (on `receiver->` when given)."""
    flags = {}
    prefix = rf"\b{receiver}->" if receiver else ""
    for m in re.finditer(prefix + r'add_option\("(--[a-z0-9-]+)"', src):
        statement = src[m.end():_statement_end(src, m.end())]
        env = re.search(r'envname\("(\w+)"\)', statement)
        flags[m.group(1)] = env.group(1) if env else None
    return flags


def flags_from_source(subcommand="serve"):
    """{flag: env or None} of `baton serve` (or `local`) read from app/serve_commands.cpp:
    the common flags (add_common_flags) plus those added to that subcommand's CLI::App."""
    src = (REPO / "app" / "serve_commands.cpp").read_text()
    common = src[src.index("void add_common_flags("):]
    common = common[:common.index("\n}\n")]
    flags = _options(common)
    body = src[src.index("void add_serve_commands("):]
    flags.update(_options(body, "s" if subcommand == "serve" else "l"))
    return flags


def serve_flags():
    """What `baton serve` accepts: from `build/baton serve --help` when the binary is built (the
    truth: it is what runs), else from the source."""
    binary = baton_binary()
    if binary is None:
        env = flags_from_source("serve")
        return Flags(env, {f: None for f in env}, "app/serve_commands.cpp")
    out = subprocess.run([str(binary), "serve", "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    env, spec = flags_from_help(out.stdout)
    return Flags(env, spec, f"`{binary} serve --help`")


def value_problem(spec, value):
    """Why `value` is not acceptable for a flag of CLI11 type text `spec`, or None."""
    if spec is None:
        return None
    choices = re.search(r"\{([^}]*)\}", spec)
    if choices and value not in choices.group(1).split(","):
        return f"{value!r} is not one of {{{choices.group(1)}}}"
    if spec.startswith("INT"):
        try:
            n = int(value)
        except ValueError:
            return f"{value!r} is not an integer"
        r = re.search(r"in \[(-?\d+) - (-?\d+)\]", spec)
        if r and not int(r.group(1)) <= n <= int(r.group(2)):
            return f"{n} is outside [{r.group(1)}, {r.group(2)}]"
        if "NONNEGATIVE" in spec and n < 0:
            return f"{n} is negative"
        if ":POSITIVE" in spec and n <= 0:
            return f"{n} is not positive"
    return None


# ---- metrics ---------------------------------------------------------------------------------

def exported_metrics():
    """{name: type} of every metric family common/metrics.cpp registers."""
    src = (REPO / "common" / "metrics.cpp").read_text()
    found = re.findall(r'family<prometheus::(Histogram|Counter|Gauge)>\(\*r,\s*"(baton_\w+)"', src)
    assert found, "no metric families found in common/metrics.cpp"
    return {name: kind.lower() for kind, name in found}


def series_names(metrics):
    """Every series name a scrape can show: histograms as _bucket/_sum/_count."""
    names = set()
    for name, kind in metrics.items():
        names |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
    return names


# Label names: baton's own (common/metrics.h: role, worker; src, dst, transport of a KV link; code;
# reason; a KV probe's result), the histogram bucket bound, and the target labels the scrape configs set.
KNOWN_LABELS = {"role", "worker", "src", "dst", "transport", "code", "reason", "result", "le", "namespace", "pod",
                "component", "instance", "job", "deployment"}
# Series from elsewhere the rules may read: the scrape's `up` and kube-state-metrics.
EXTERNAL_SERIES = {"up", "kube_deployment_status_replicas_available"}

PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values", "group",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "rate", "irate", "increase", "delta", "idelta", "deriv", "predict_linear", "histogram_quantile", "absent",
    "absent_over_time", "clamp_min", "clamp_max", "vector", "scalar", "time", "label_replace", "label_join",
    "avg_over_time", "max_over_time", "min_over_time", "sum_over_time", "count_over_time", "changes", "resets",
    "abs", "ceil", "floor", "round", "sort", "sort_desc", "timestamp", "exp", "ln", "log2", "log10", "sqrt",
    "inf", "nan", "e", "s", "m", "h", "d", "w", "y", "ms",
}


def strip_strings(expr):
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)


def promql_label_names(expr):
    """Label names used in matchers and in by/without/on/ignoring clauses."""
    e = strip_strings(expr)
    names = set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*\"", e))
    for clause in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", e):
        names |= {n.strip() for n in clause.split(",") if n.strip()}
    return names


def promql_series_names(expr):
    """The series names (and recording-rule names, which contain ':') an expression reads."""
    e = strip_strings(expr)
    e = re.sub(r"\{[^}]*\}", "{}", e)                                   # label matchers
    e = re.sub(r"\[[^\]]*\]", "[]", e)                                  # ranges
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][\w:]*)", e):
        word = m.group(1)
        following = e[m.end():].lstrip()
        if word in PROMQL_WORDS or following.startswith("("):
            continue
        names.add(word)
    return names


GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h", "$namespace": ".*"}


def grafana_to_promql(expr):
    for k, v in GRAFANA_VARIABLES.items():
        expr = expr.replace(k, v)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def dashboard_exprs(dashboard):
    exprs = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                exprs.append((p["title"], t["expr"]))
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    return exprs


# ---- kustomize -------------------------------------------------------------------------------

def kubectl():
    path = shutil.which("kubectl")
    assert path, "kubectl is not on PATH (scripts/fetch-kubectl.sh puts the pinned one in $BATON_CACHE/bin)"
    return path


def kustomize(directory):
    out = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {directory} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


# Overlays plus a component that deploy/README.md tells users to add (left out by default): rendered
# and checked like the overlays themselves. name: (overlay, components)
VARIANTS = {
    "cpu+autoscaling": ("cpu", ("autoscaling",)),
    "gpu+kv-nccl": ("gpu", ("kv-nccl",)),
}


def kustomize_variant(overlay, components, workdir):
    """`kubectl kustomize` of a kustomization in `workdir` that takes an overlay and adds components
    in the overlay's namespace, as adding them to the overlay's `components` would."""
    rel = lambda p: os.path.relpath(p, workdir)
    namespace = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())["namespace"]
    (workdir / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": namespace,
        "resources": [rel(K8S / "overlays" / overlay)],
        "components": [rel(K8S / "components" / c) for c in components]}))
    return kustomize(workdir)


# ---- Prometheus Adapter ------------------------------------------------------------------------

ADAPTER_VALUES = K8S / "components" / "autoscaling" / "prometheus-adapter-values.yaml"


def adapter_rules():
    """{"custom": [rule], "external": [rule]} of the Prometheus Adapter's Helm values."""
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]
    return {kind: rules.get(kind) or [] for kind in ("custom", "external")}


def adapter_series_name(rule):
    """The metric name a rule's seriesQuery discovers (`name{...}` or `{__name__="name",...}`)."""
    q = rule["seriesQuery"].strip()
    m = re.match(r"([a-zA-Z_:][\w:]*)\s*(?:\{|$)", q) or re.search(r'__name__\s*=\s*"([a-zA-Z_:][\w:]*)"', q)
    assert m, f"seriesQuery {q!r} names no single metric"
    return m.group(1)


def adapter_metric_name(rule):
    """The name the adapter serves a rule's metric under (name.matches / name.as)."""
    series = adapter_series_name(rule)
    name = rule.get("name", {})
    m = re.search(name.get("matches", ".*"), series)
    assert m, f"name.matches {name.get('matches')!r} does not match {series}"
    as_ = name.get("as") or ("$1" if m.groups() else "$0")
    return re.sub(r"\$\{?(\d+)\}?", lambda g: m.group(int(g.group(1))), as_)


def adapter_query(rule, kind):
    """A rule's metricsQuery as the adapter would send it for one namespace (custom rules: for two
    pods, grouped by the label that names them), for promtool and for reading its series."""
    overrides = rule.get("resources", {}).get("overrides", {})
    by_resource = {v["resource"]: label for label, v in overrides.items()}
    namespace = by_resource.get("namespace", "namespace")
    matchers, group_by = [f'{namespace}="baton"'], ""
    if kind == "custom":
        (label,) = [l for r, l in by_resource.items() if r != "namespace"]
        matchers.append(f'{label}=~"baton-decode-a|baton-decode-b"')
        group_by = label
    q = rule["metricsQuery"]
    for field, value in (("Series", adapter_series_name(rule)), ("LabelMatchers", ",".join(matchers)),
                         ("GroupBy", group_by)):
        q = re.sub(r"<<\s*\." + field + r"\s*>>", lambda _: value, q)
    assert "<<" not in q and ">>" not in q, f"unknown template field left in {q!r}"
    return q


def find(objects, kind, name=None):
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    return found


# ---- rendered objects --------------------------------------------------------------------------

ROLES = ("frontend", "prefill", "decode")


def deployment(objects, role):
    found = [d for d in find(objects, "Deployment")
             if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == role]
    assert len(found) == 1, f"expected one {role} Deployment, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def main_container(dep):
    containers = dep["spec"]["template"]["spec"]["containers"]
    found = [c for c in containers if c["name"] == "baton"]
    assert len(found) == 1, f"{dep['metadata']['name']}: no container named baton"
    return found[0]


def container_env(objects, container):
    """{name: value} of a container: envFrom ConfigMaps, then env (values; valueFrom as the dict)."""
    env = {}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]["name"]
        cms = find(objects, "ConfigMap", ref)
        assert cms, f"envFrom names ConfigMap {ref}, which is not rendered"
        env.update(cms[0].get("data", {}))
    for e in container.get("env", []):
        env[e["name"]] = e.get("value", e.get("valueFrom"))
    return env


def labels_match(selector, labels):
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value = labels.get(expr["key"])
        op = expr["operator"]
        if op == "In" and value not in expr["values"] or op == "NotIn" and value in expr["values"]:
            return False
        if op == "Exists" and value is None or op == "DoesNotExist" and value is not None:
            return False
    return True


def named_ports(container):
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def pod_volume(spec, name):
    found = [v for v in spec.get("volumes", []) if v["name"] == name]
    assert len(found) == 1, f"no volume {name}"
    return found[0]


def kv_transport(objects, role):
    return container_env(objects, main_container(deployment(objects, role))).get("BATON_KV_TRANSPORT", "tcp")


# ---- Dockerfile ------------------------------------------------------------------------------

DOCKERFILE = DEPLOY / "docker" / "Dockerfile"


class Stage:
    def __init__(self, base, name):
        self.base, self.name, self.instructions = base, name, []

    def all(self, keyword):
        return [args for k, args in self.instructions if k == keyword]


def parse_dockerfile(path=DOCKERFILE):
    """Stages of a Dockerfile: each with its (INSTRUCTION, arguments) list, continuations joined
    and comments dropped. ARGs before the first FROM go to a stage named None."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    stages = [Stage(None, None)]
    for line in lines:
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            m = re.match(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", args, re.I)
            stages.append(Stage(m.group(1), m.group(2)))
        else:
            stages[-1].instructions.append((keyword, args))
    return stages


def dockerfile_env(stage):
    """{name: value} of a stage's ENV instructions (the `ENV A=1 B=2` form)."""
    env = {}
    for args in stage.all("ENV"):
        for m in re.finditer(r'(\w+)=("[^"]*"|\S+)', args):
            env[m.group(1)] = m.group(2).strip('"')
    return env


def runtime_stage():
    return parse_dockerfile()[-1]
