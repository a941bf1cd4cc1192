"""The Kubernetes manifests (deploy/k8s): every overlay renders with `kubectl kustomize`, the
objects validate against the Kubernetes JSON schemas (kubernetes-validate, bundled, offline), and
what the pods run agrees with the binary: flags and BATON_* variables that `baton serve` accepts
with acceptable values, ports and native gRPC probes on the ports baton listens on, worker
discovery through the headless Services, draining on SIGTERM, the model volume, the image, GPUs
only where the overlay says, and Prometheus Operator objects that select real ports."""

import os
import re
from pathlib import PurePosixPath

import pytest
import yaml

from deploy_helpers import (DEPLOY, K8S, REPO, dockerfile_env, find, kustomize, parse_dockerfile,
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


@pytest.fixture(scope="module")
def pvc_variant(tmp_path_factory):
    """The base with components/model-pvc, the way an overlay would include it."""
    d = tmp_path_factory.mktemp("kustomize-model-pvc")
    rel = lambda p: os.path.relpath(p, d)
    (d / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "baton",
        "resources": [rel(K8S / "base")], "components": [rel(K8S / "components" / "model-pvc")],
        "images": [{"name": "baton", "newName": "baton", "newTag": "0.1.0"}]}))
    return kustomize(d)


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
def test_objects_validate_against_kubernetes_schemas(rendered, pvc_variant, version):
    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: run scripts/install-deps.sh --tests")
    for name, objects in list(rendered.items()) + [("base+model-pvc", pvc_variant)]:
        errors, custom = validate_objects(objects, version)
        assert not errors, f"{name} against Kubernetes {version}:\n" + "\n".join(errors)
        for o in custom:
            assert o["kind"] in CUSTOM_KINDS.get(o["apiVersion"], set()), f"{o['apiVersion']} {o['kind']}"
            assert o["metadata"].get("name") and isinstance(o.get("spec"), dict)


# ---- the binary's flags ------------------------------------------------------------------------

def test_flags_and_variables_exist_in_the_binary(rendered, pvc_variant, flags):
    """Every `--flag` in the args and every BATON_* variable a baton container gets is one that
    `baton serve` has, with a value its --help type accepts."""
    problems = []
    for name, objects in list(rendered.items()) + [("base+model-pvc", pvc_variant)]:
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
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = c.get(probe)
                assert p, f"{where}: no {probe}"
                # Native gRPC probe on grpc.health.v1: the server-wide status (service ""), on the
                # plaintext health port (the kubelet speaks no TLS; the gRPC port requires it).
                assert set(p) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, f"{where}: {probe} {p}"
                assert p["grpc"]["port"] == health_port, f"{where}: {probe} probes port {p['grpc']['port']}"
                assert p["grpc"].get("service", "") == "", f"{where}: baton reports only the server-wide status"
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
        role_labels = {r: deployment(objects, r)["spec"]["template"]["metadata"]["labels"] for r in ROLES}
        want = {  # (from, to, port): allowed
            (None, "frontend", "grpc"): True, (None, "prefill", "grpc"): False, (None, "decode", "grpc"): False,
            (None, "frontend", "http"): True, ("prefill", "frontend", "http"): True,
            ("frontend", "prefill", "grpc"): True, ("frontend", "decode", "grpc"): True,
            ("prefill", "decode", "grpc"): True, ("decode", "prefill", "grpc"): False,
            ("decode", "decode", "grpc"): False,
            (None, "decode", "metrics"): True, (None, "prefill", "health"): True,
            (None, "decode", 40000): False, ("frontend", "decode", 40000): False,
            ("prefill", "decode", 40000): name == "gpu", ("decode", "prefill", 40000): name == "gpu",
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

def test_model_volume_holds_the_file_baton_reads(rendered, pvc_variant):
    file_name = fetch_model_file_name()
    for name, objects in list(rendered.items()) + [("base+model-pvc", pvc_variant)]:
        for role in ROLES:
            dep = deployment(objects, role)
            spec = dep["spec"]["template"]["spec"]
            c = main_container(dep)
            model = PurePosixPath(container_env(objects, c)["BATON_MODEL"])
            assert model.name == file_name, f"{name} {role}: BATON_MODEL {model}, fetch-model.sh writes {file_name}"
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            assert str(model.parent) in mounts, f"{name} {role}: nothing mounted at {model.parent}"
            volume = mounts[str(model.parent)]["name"]
            assert mounts[str(model.parent)].get("readOnly"), f"{name} {role}: model mounted writable"
            inits = {i["name"]: i for i in spec.get("initContainers", [])}
            if name == "base+model-pvc":
                vol = next(v for v in spec["volumes"] if v["name"] == volume)
                assert vol["persistentVolumeClaim"]["claimName"] == find(objects, "PersistentVolumeClaim")[0]["metadata"]["name"]
                assert "fetch-model" not in inits and "wait-for-model" in inits
                job = find(objects, "Job", "baton-fetch-model")[0]["spec"]["template"]["spec"]
                fetcher = job["containers"][0]
                pvc_vols = {v["name"] for v in job["volumes"] if "persistentVolumeClaim" in v}
                fetch_mount = next(m for m in fetcher["volumeMounts"] if m["name"] in pvc_vols)
            else:
                assert "fetch-model" in inits, f"{name} {role}: no fetch-model init container"
                fetcher = inits["fetch-model"]
                fetch_mount = next(m for m in fetcher["volumeMounts"] if m["name"] == volume)
            assert fetcher["command"] == ["baton-fetch-model"]
            cache = {e["name"]: e.get("value") for e in fetcher.get("env", [])}.get("BATON_CACHE")
            assert cache == fetch_mount["mountPath"] == str(model.parent), \
                f"{name} {role}: fetch-model writes to {cache}, mounted at {fetch_mount['mountPath']}"
    # The image ships scripts/fetch-model.sh under that name.
    copies = runtime_stage().all("COPY")
    assert any("scripts/fetch-model.sh" in c and c.endswith("/usr/local/bin/baton-fetch-model") for c in copies), copies


def test_one_image_for_every_container(rendered, pvc_variant):
    for name, objects in list(rendered.items()) + [("base+model-pvc", pvc_variant)]:
        images = set()
        for o in objects:
            if o["kind"] in ("Deployment", "Job"):
                spec = o["spec"]["template"]["spec"]
                images |= {c["image"] for c in spec.get("initContainers", []) + spec["containers"]}
        assert len(images) == 1, f"{name}: images {images}"
        image = images.pop()
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), f"{name}: unpinned image {image}"


def test_pods_run_as_the_image_user_without_privileges(rendered, pvc_variant):
    uid = image_user_id()
    assert uid != 0
    for name, objects in list(rendered.items()) + [("base+model-pvc", pvc_variant)]:
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


def test_gpu_overlay_gives_workers_gpus_and_nccl_settings(rendered):
    objects = rendered["gpu"]
    for role in ("prefill", "decode"):
        dep = deployment(objects, role)
        c = main_container(dep)
        assert gpus(c, "requests") >= 1 and gpus(c, "requests") == gpus(c, "limits"), f"gpu {role}: {c['resources']}"
        env = container_env(objects, c)
        for var in ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_DEBUG"):
            assert var in env, f"gpu {role}: {var} not set"
        spec = dep["spec"]["template"]["spec"]
        shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
        vol = next(v for v in spec["volumes"] if v["name"] == shm["name"])
        assert vol["emptyDir"]["medium"] == "Memory"
        assert any(t["key"] == "nvidia.com/gpu" for t in spec.get("tolerations", []))
    frontend = main_container(deployment(objects, "frontend"))
    assert gpus(frontend, "requests") == gpus(frontend, "limits") == 0, "the frontend needs no GPU"


def test_cpu_overlay_needs_no_gpu(rendered):
    for o in rendered["cpu"]:
        assert "nvidia.com/gpu" not in yaml.safe_dump(o), f"cpu overlay: {o['kind']}/{o['metadata']['name']} asks for a GPU"


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
